"""``tqexport bench speed``: decode speed on ONNX Runtime CPU per kv dtype, and KV memory.

Per configuration, B sequences with C tokens already cached (block tables as the block manager
would hold them, :mod:`~tqexport.bench.filled`; the cache bytes are zeros, decode cost does not
depend on their values) take N single-token decode steps; the fastest step after a warm-up one
counts. The kv dtypes of one (context, batch) point run
interleaved, step by step, in one process, so a loaded machine slows them alike and the ratios
hold. Every configuration runs under each kernel choice asked (labels ``fp8 [native]``,
``fp8 [bodies]``), interleaved too. Reported: ms per step, tokens/s, the ratio to ``auto`` under
the same kernels and native over bodies, all measured in the same run; what ran each label's
layers, its ORT session options and the load average around each point; KV bytes per token, and
the tokens a fixed KV budget holds.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqexport import __version__
from tqexport.bench.filled import filled_tables
from tqexport.contract.artifact import Artifact, open_artifact
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.errors import TQExportError
from tqexport.runtime.backends.ort import OrtBackend, session_summary
from tqexport.runtime.memory import resolve_num_blocks
from tqexport.spec import BuildRequest
from tqexport.spec.request import DEFAULT_WEIGHTS
from tqexport.validate import DEFAULT_KV_CACHE_MEMORY, parse_memory


def artifact_dir(model: str, kv_cache_dtype: str, workdir: Path, recent_window: int = 0,
                 weights: str = DEFAULT_WEIGHTS) -> Path:  # fmt: skip
    """Where :func:`artifact_for` keeps MODEL's artifact of this configuration in ``workdir``."""
    suffix = f"-recent{recent_window}" if recent_window else ""
    return workdir / f"{Path(model).name}-{kv_cache_dtype}{suffix}-{weights}"


def artifact_for(model: str, kv_cache_dtype: str, workdir: Path, recent_window: int = 0,
                 weights: str = DEFAULT_WEIGHTS):  # fmt: skip
    """The artifact of MODEL at this kv dtype, recent window and ``--weights``, built into
    ``workdir`` once and then reused (refused if the folder holds another build, or one by
    another tqexport version)."""
    from tqexport.export.artifact_build import build_artifact

    out = artifact_dir(model, kv_cache_dtype, workdir, recent_window, weights)
    request = BuildRequest(kv_cache_dtype, recent_window=recent_window, weights=weights)
    if not (out / "tqexport.json").is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        build_artifact(model, out, request)
    art = open_artifact(out)
    if art.spec.request != request:
        raise TQExportError(
            f"{out} holds another build of {model} than this run asks for; remove it or give "
            "another --workdir"
        )
    if art.spec.tqexport_version != __version__:
        raise TQExportError(
            f"{out} was built by tqexport {art.spec.tqexport_version[:20]}, not this "
            f"{__version__}, whose graphs may differ; remove it or give another --workdir"
        )
    return art


#: a configuration measured under one kernel choice: ``"fp8 [native]"``
_KERNEL_LABEL = re.compile(r"^(.*) \[(native|bodies)\]$")


def kernel_label(name: str, kernels: str) -> str:
    """The label of configuration ``name`` run on ``kernels`` (native or bodies)."""
    return f"{name} [{kernels}]"


def split_label(label: str) -> tuple[str, str | None]:
    """(configuration, kernels) of a label; kernels None for a run that did not record them."""
    m = _KERNEL_LABEL.match(label)
    return (m.group(1), m.group(2)) if m else (label, None)


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded: how busy the machine was around a run."""
    return [round(x, 2) for x in os.getloadavg()]


def parse_kernels(text: str) -> list[str]:
    """``--kernels``: comma-separated choices of :data:`tqexport.native.KERNEL_CHOICES`."""
    from tqexport import validate
    from tqexport.native import KERNEL_CHOICES

    asked = [k.strip() for k in text.split(",") if k.strip()]
    if not asked:
        raise TQExportError(f"--kernels needs one or more of {', '.join(KERNEL_CHOICES)}")
    for k in asked:
        validate.choice(k, "--kernels", KERNEL_CHOICES)
    return asked


def run_kernels(asked: Sequence[str], specs: dict) -> list[str]:
    """The kernel choices a speed run measures (``asked``: :func:`parse_kernels`' output), in
    that order, each native or bodies: ``auto`` is native when the native library serves every
    artifact (label -> spec) and bodies otherwise, so one choice runs every configuration
    alike; ``native`` must serve them all."""
    from tqexport.native.kernel_choice import choose

    out: list[str] = []
    for k in asked:
        if k == "auto":
            native = all(choose(spec, "auto").kernels == "native" for spec in specs.values())
            k = "native" if native else "bodies"
        elif k == "native":
            for label, spec in specs.items():
                try:
                    choose(spec, "native")
                except TQExportError as e:
                    raise TQExportError(f"{label}: {e}") from None
        if k not in out:
            out.append(k)
    return out


def decode_ms(
    art: Artifact,
    context: int,
    batch: int,
    steps: int,
    threads=None,
    extra_blocks: int = 0,
    options: dict | None = None,
) -> float:
    """Fastest decode step (ms) of ``batch`` sequences holding ``context`` cached tokens;
    ``extra_blocks`` grows the cache beyond what they use (in-place updates keep it flat)."""
    ms, _ = decode_run({"x": art}, context, batch, steps, threads, extra_blocks, options)
    return ms["x"]


def decode_run(
    arts: dict[str, Artifact],
    context: int,
    batch: int | dict[str, int],
    steps: int,
    threads=None,
    extra_blocks: int = 0,
    options: dict | None = None,
    step_options: dict | None = None,
    kernels: str | dict[str, str] = "auto",
) -> tuple[dict[str, float], dict[str, dict]]:
    """:func:`decode_ms` of several artifacts (or one artifact under several ``step_options``
    labels: label -> session option overrides; ``batch`` may be label -> batch; ``kernels`` one
    choice or label -> choice) with their steps interleaved: a warm-up step each, then step s of
    every artifact before step s + 1 of any. Returns (ms per label, label -> what ran its layers
    and why, and its session's options)."""
    backends, tables = {}, {}
    for label, art in arts.items():
        b = batch[label] if isinstance(batch, dict) else batch
        # a warm-up step and ``steps`` timed ones write positions context .. context + steps
        counts, tables[label] = filled_tables(art.spec, b, context + steps + 1, context)
        opts = {**(options or {}), **((step_options or {}).get(label) or {})}
        k = kernels[label] if isinstance(kernels, dict) else kernels
        backends[label] = OrtBackend(art, [n + extra_blocks for n in counts], threads,
                                     options=opts, kernels=k)  # fmt: skip
    times = {label: [] for label in arts}
    for s in range(steps + 1):
        for label, backend in backends.items():
            spec = arts[label].spec
            step = build_step(spec, [SeqChunk([7], context + s, t) for t in tables[label]])
            t0 = time.perf_counter()
            backend.run(step)
            times[label].append(time.perf_counter() - t0)
    ran = {
        label: {
            "kernels": b.kernel_choice.kernels,
            "reason": b.kernel_choice.reason,
            "session_options": session_summary(b.session.get_session_options()),
        }
        for label, b in backends.items()
    }
    return {label: 1000 * min(t[1:]) for label, t in times.items()}, ran


def measure(
    arts: dict[str, Artifact],
    contexts: list[int],
    batches: list[int],
    steps: int = 4,
    budget: str = DEFAULT_KV_CACHE_MEMORY,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda what: None,
    kernels: Sequence[str] | None = None,
) -> dict:
    """Decode timings per (context, batch) for every artifact (``auto`` first) under every
    kernel choice (:func:`run_kernels`' output; default: what ``auto`` resolves to), and
    memory."""
    from tqexport.bench.bounds import artifact_footprint

    kernels = list(kernels or run_kernels(["auto"], {n: a.spec for n, a in arts.items()}))
    runs = {kernel_label(n, k): art for k in kernels for n, art in arts.items()}
    asked = {label: split_label(label)[1] for label in runs}
    both = {"native", "bodies"} <= set(kernels)
    rows, labels, session = [], {}, None
    run_before = load_average()
    for c in contexts:
        for b in batches:
            progress(f"context {c} batch {b}: {', '.join(runs)}")
            before = load_average()
            ms, ran = decode_run(runs, c, b, steps, threads, kernels=asked)
            after = load_average()
            for label, r in ran.items():
                what = {"configuration": split_label(label)[0], "kernels": r["kernels"]}
                labels.setdefault(label, {**what, "reason": r["reason"]})
                session = session or r["session_options"]
            rows.append({
                "context": c, "batch": b,
                "ms_per_step": ms,
                "tokens_per_second": {n: 1000 * b / v for n, v in ms.items()},
                "kernels": {n: ran[n]["kernels"] for n in ms},
                "speed_vs_auto": {
                    n: ms[kernel_label("auto", asked[n])] / v for n, v in ms.items()
                },
                "native_over_bodies": {
                    n: ms[kernel_label(n, "bodies")] / ms[kernel_label(n, "native")] for n in arts
                } if both else {},
                "loadavg": {"before": before, "after": after},
            })  # fmt: skip
    parse_memory(budget)
    memory = []
    for name, art in arts.items():
        blocks = max(resolve_num_blocks(art, None, budget))  # recent windows (64 seqs) first
        resident = (blocks - 1) * art.spec.block_size
        memory.append({"label": name, "kv_bytes_per_token": art.spec.bytes_per_token,
                       "resident_tokens": resident})  # fmt: skip
    auto = next(m for m in memory if m["label"] == "auto")
    for m in memory:
        m["resident_vs_auto"] = m["resident_tokens"] / auto["resident_tokens"]
        m["bytes_ratio_auto_over_this"] = auto["kv_bytes_per_token"] / m["kv_bytes_per_token"]
    return {
        "threads": threads, "steps": steps, "budget": budget,
        "kernels": kernels,
        "labels": labels,
        "session_options": session,
        "loadavg": {"before": run_before, "after": load_average()},
        "footprint": {n: artifact_footprint(a) for n, a in arts.items()},
        "decode": rows,
        "memory": memory,
    }  # fmt: skip
