"""What ``tqexport bench speed`` prints of a run: the decode table (a row per context, batch and
kernel choice, ratios within the run) and the notes beside it (kernels, ORT session, load)."""

from __future__ import annotations

from tqexport.bench.speed import kernel_label, split_label


def speed_table(speed: dict) -> tuple[list[str], list[list[str]]]:
    """A ``bench speed`` run as (header, rows): a row per (context, batch, kernels), tokens/s
    per configuration, each one's ratio to auto on the same kernels and, where both ran,
    native over bodies (on the native row); a run that recorded no kernels shows "-" there."""
    labels = list(speed["decode"][0]["ms_per_step"])
    configs = list(dict.fromkeys(split_label(n)[0] for n in labels))
    kernels = list(dict.fromkeys(split_label(n)[1] for n in labels))
    both = {"native", "bodies"} <= set(kernels)
    others = [c for c in configs if c != "auto"]
    header = ["context", "batch", "kernels", *[f"{c} tok/s" for c in configs],
              *[f"{c} vs auto" for c in others],
              *([f"{c} native/bodies" for c in configs] if both else [])]  # fmt: skip
    out = []
    for r in speed["decode"]:
        for k in kernels:
            name = {c: kernel_label(c, k) if k else c for c in configs}
            cells = [str(r["context"]), str(r["batch"]), k or "-",
                     *[f"{r['tokens_per_second'][name[c]]:.1f}" for c in configs],
                     *[f"{r['speed_vs_auto'][name[c]]:.2f}x" for c in others]]  # fmt: skip
            if both:
                cells += [f"{r['native_over_bodies'][c]:.2f}x" if k == "native" else "-"
                          for c in configs]  # fmt: skip
            out.append(cells)
    return header, out


def session_text(so: dict) -> str:
    """An ORT session's summarized options, in words."""
    threads = so["intra_op_num_threads"] or "ORT's default"
    on = {True: "on", False: "off"}
    return (
        f"{threads} intra-op threads, spinning {on[so['allow_spinning']]}, "
        f"{so['graph_optimization_level']}, memory pattern {on[so['enable_mem_pattern']]}, "
        f"CPU arena {on[so['enable_cpu_mem_arena']]}"
    )


def load_text(load: dict) -> str:
    """Load averages (1, 5 and 15 minutes) before and after a run."""

    def f(x):
        return "/".join(f"{v:.2f}" for v in x)

    return f"before {f(load['before'])}, after {f(load['after'])}"


def kernels_text(labels: dict) -> str | None:
    """What ran each kernel choice's layers (label -> {"kernels", "reason"}), once per choice."""
    seen = dict.fromkeys((v["kernels"], v["reason"]) for v in labels.values())
    return "; ".join(f"[{k}] {why}" for k, why in seen) or None


def speed_notes(speed: dict) -> list[str]:
    """What a ``bench speed`` run recorded beside its timings (none for earlier runs): the
    kernels, the ORT session, the load average (1, 5 and 15 minutes) around the run."""
    out = []
    if speed.get("labels"):
        out.append(f"Kernels: {kernels_text(speed['labels'])}.")
    if speed.get("session_options"):
        out.append(f"ORT session: {session_text(speed['session_options'])}.")
    if speed.get("loadavg"):
        out.append(f"Load average (1/5/15 min): {load_text(speed['loadavg'])}.")
    return out
