"""The ``tqexport`` command line (typer). Bad input: one line on stderr, exit code 2.

Every argument is checked (:mod:`tqexport.validate`) before any expensive work, usage errors
(a bad type, a missing or unknown option) are one line too, and every user string (paths,
prompts, model names, messages quoting them) is printed literally: the consoles parse no
markup and no emoji codes, and control characters are shown escaped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.runtime.config import EngineConfig
from tqexport.validate import printable

try:  # typer >= 0.16 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions
#: CTRL+C at a prompt (typer's own Abort, and click's where the vendored copy has one)
_ABORTS = (typer.Abort, getattr(click_exceptions, "Abort", typer.Abort))

app = typer.Typer(
    help="Per-layer quantized KV caches (vLLM kv-cache-dtype names and layouts), exported.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Tables are wider than 80 columns; a pipe or CI log gets the full width instead of ellipses.
# No markup, emoji codes or highlighting: user text ('[/x]', 'boundary:100:') prints as it is.
_PLAIN = dict(markup=False, emoji=False, highlight=False)
console = Console(width=None if sys.stdout.isatty() else 160, **_PLAIN)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, **_PLAIN)
#: every serving option's default (run, inspect, serve): defined once, in EngineConfig
_ENGINE = EngineConfig()


def _warn(message: str) -> None:
    err.print(Text.assemble(("warning:", "yellow"), " ", printable(message)), soft_wrap=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def dtype_rows(head_size: int) -> list[dict]:
    """One row per kv-cache dtype at this head size (auto assumed bf16)."""
    from tqexport.kvquant.codecs import compression_vs_bf16, make_codec
    from tqexport.kvquant.modes import KV_CACHE_DTYPES

    rows = []
    for name, entry in KV_CACHE_DTYPES.items():
        row = {"name": name, "mode": entry.mode.name, "summary": entry.summary, "data_bits": None}
        try:
            codec = make_codec(name, head_size, model_dtype="bfloat16")
        except TQExportError as e:
            row.update(available=False, reason=str(e))
            rows.append(row)
            continue
        b = codec.bytes_per_token_head
        layout = getattr(codec, "layout", None)
        if layout is not None:
            row["data_bits"] = f"k{layout.preset.key_bits}v{layout.preset.value_bits}"
        elif entry.data_bits is not None:
            row["data_bits"] = entry.data_bits
        row.update(
            available=True,
            bytes_per_token_head=b,
            bits_per_element=8 * b / (2 * head_size),
            compression_vs_bf16=compression_vs_bf16(codec),
        )
        rows.append(row)
    return rows


@app.command()
def dtypes(
    head_size: Annotated[int, typer.Option(help="Head size D for the byte columns.")] = 128,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """List every kv-cache dtype: mode, bits per element, bytes per token-head (K+V, all in)."""
    from tqexport.kvquant.codecs import MAX_HEAD_SIZE

    if head_size <= 0:
        raise TQExportError(f"--head-size must be positive, got {head_size}")
    if head_size > MAX_HEAD_SIZE:
        raise TQExportError(f"--head-size must be at most {MAX_HEAD_SIZE}, got {head_size}")
    rows = dtype_rows(head_size)
    if as_json:
        print(json.dumps({"head_size": head_size, "dtypes": rows}, indent=2))
        return
    t = Table(title=f"kv-cache dtypes at head size {head_size} (auto shown as bf16)")
    for col in ("name", "mode", "data bits", "bytes/token-head", "bits/elem all-in", "vs bf16"):
        t.add_column(col, justify="left" if col in ("name", "mode") else "right")
    notes = []
    for r in rows:
        if not r["available"]:
            t.add_row(r["name"], r["mode"], "-", "n/a", "n/a", "n/a")
            notes.append(f"{r['name']}: {r['reason']}")
            continue
        t.add_row(
            r["name"],
            r["mode"],
            str(r["data_bits"] or "model"),
            str(r["bytes_per_token_head"]),
            f"{r['bits_per_element']:.2f}",
            f"{r['compression_vs_bf16']:.2f}x",
        )
    console.print(t)
    for note in notes:
        console.print(printable(note))


SkipOption = Annotated[
    list[str] | None,
    typer.Option(
        "--skip-layers",
        help="Layers kept unquantized: 5, -1, 0-3, sw, full, boundary:N (repeatable, or a,b).",
    ),
]


KvDtypeOption = Annotated[str, typer.Option(help="vLLM kv-cache dtype name.")]
BoundaryOption = Annotated[
    bool, typer.Option(help="TurboQuant boundary protection (first/last 2 layers).")
]
BlockSizeOption = Annotated[int, typer.Option(help="Tokens per cache block.")]
RecentWindowOption = Annotated[
    int,
    typer.Option(
        "--kv-recent-window",
        help="Also keep each quantized layer's last N tokens in the model dtype (0 = off).",
    ),
]


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="HF dir, config.json, .gguf, or built-in name.")],
    kv_cache_dtype: KvDtypeOption = "auto",
    skip_layers: SkipOption = None,
    boundary: BoundaryOption = True,
    block_size: BlockSizeOption = 16,
    recent_window: RecentWindowOption = 0,
    dtype: Annotated[
        str | None, typer.Option(help="Model dtype (default: the config's, else float32).")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the per-layer spec as JSON.")
    ] = False,
    vllm_args: Annotated[
        bool,
        typer.Option(
            "--vllm-args",
            help="Print the `vllm serve` command giving the same per-layer caches (exit 1 and "
            "say why when vLLM cannot express the plan).",
        ),
    ] = False,
):
    """Print the per-layer cache plan of MODEL from its config alone (no weights loaded)."""
    from tqexport.models.config import describe_model
    from tqexport.resolve import resolve

    validate.block_size(block_size)
    validate.recent_window(recent_window)
    desc = describe_model(model, dtype)
    res = resolve(
        desc, kv_cache_dtype, skip_layers or [], boundary=boundary, block_size=block_size,
        recent_window=recent_window,
    )  # fmt: skip
    for w in res.warnings:
        _warn(w)
    spec = res.spec
    if as_json:
        print(json.dumps(spec.plan_dict(), indent=2))
        return
    if vllm_args:
        from tqexport.vllm_bridge import vllm_args as bridge

        flags = bridge(spec)
        if flags.unsupported:
            _error("vLLM cannot serve this plan: " + "; ".join(flags.unsupported), 1)
        print(flags.command(model))
        return
    t = Table(
        title=printable(
            f"{desc.name} ({desc.architecture}, {desc.dtype}): --kv-cache-dtype {kv_cache_dtype}"
        )
    )
    for col in (
        "layer",
        "attention",
        "window",
        "kv dtype",
        "mode",
        "storage",
        "bytes/token",
        "group",
        "recent window",
        "why unquantized",
    ):
        t.add_column(col)
    for la in spec.layers:
        t.add_row(
            str(la.index),
            la.attention_type.value,
            str(la.window) if la.window else "-",
            la.kv_cache_dtype,
            la.mode.name,
            la.cache.storage_dtype,
            str(la.cache.bytes_per_token),
            str(la.group),
            f"{la.recent_window} (group {la.recent_group})" if la.recent else "-",
            printable(la.skipped_by or ""),
        )
    console.print(t)
    groups = ", ".join(
        f"group {g.id}: {'recent ' if g.recent else ''}"
        f"{'full' if g.window is None else f'window {g.window}'} ({len(g.layers)} layers)"
        for g in spec.groups
    )
    ratio = spec.bf16_bytes_per_token / spec.bytes_per_token
    console.print(
        f"cache groups: {groups}\n"
        f"KV bytes per token, all layers: {_fmt_bytes(spec.bytes_per_token)}; "
        f"an all-bf16 cache: {_fmt_bytes(spec.bf16_bytes_per_token)} ({ratio:.2f}x this plan)",
    )
    if any(la.skipped_by == "turboquant boundary" for la in spec.layers):
        console.print("TurboQuant boundary layers stay unquantized; --no-boundary quantizes them.")


@app.command()
def build(
    model: Annotated[str, typer.Argument(help="HF dir, .gguf, or built-in name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Artifact directory to create.")],
    kv_cache_dtype: KvDtypeOption = "auto",
    skip_layers: SkipOption = None,
    boundary: BoundaryOption = True,
    block_size: BlockSizeOption = 16,
    recent_window: RecentWindowOption = 0,
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 | float16 | bfloat16 (bf16 is a GPU target). Default: float32."),
    ] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset (21..23).")] = 21,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact directory.")] = False,
    kv_scales: Annotated[
        str,
        typer.Option(
            help="fp8/nvfp4 per-layer scales: a number (1.0, vLLM's default) or calibrate."
        ),
    ] = "1.0",
    calibration_text: Annotated[
        Path | None,
        typer.Option(help="Text file for --kv-scales calibrate (default: pydoc topics)."),
    ] = None,
):
    """Export MODEL with per-layer KV caches: model.onnx + tqexport.json + tokenizer."""
    import time

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from tqexport.export.artifact import BuildOptions, build_artifact, parse_kv_scales

    if not 21 <= opset <= 23:
        raise TQExportError(f"--opset must be 21..23 (fp8 casts need 21+), got {opset}")
    validate.block_size(block_size)
    validate.recent_window(recent_window)
    parse_kv_scales(kv_scales)
    if dtype is not None:
        validate.choice(dtype, "--dtype", ("float32", "float16", "bfloat16"))
    options = BuildOptions(
        kv_cache_dtype=kv_cache_dtype,
        skip_layers=skip_layers or [],
        boundary=boundary,
        block_size=block_size,
        recent_window=recent_window,
        dtype=dtype or "float32",
        opset=opset,
        force=force,
        kv_scales=kv_scales,
        calibration_text=calibration_text,
    )
    labels = {
        "load": "loading weights",
        "calibrate": "calibrating kv scales",
        "export": "exporting ONNX",
        "save": "saving",
    }
    # A terminal gets a live display (cleared if the build fails); a log gets the stages once,
    # after success, so a failed build prints its error line only.
    live = err.is_terminal
    started: dict[str, float] = {}
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
        console=err, disable=not live,
    ) as bar:  # fmt: skip
        current = {}

        def stage(name):
            for task in current.values():
                bar.update(task, completed=1, total=1)
            current[name] = bar.add_task(labels[name], total=None)
            started[name] = time.monotonic()

        try:
            result = build_artifact(model, out, options, progress=stage)
        except BaseException:
            bar.live.transient = True
            raise
        for task in current.values():
            bar.update(task, completed=1, total=1)
    if not live:
        ends = [*list(started.values())[1:], time.monotonic()]
        for (name, t0), t1 in zip(started.items(), ends, strict=True):
            err.print(f"  {labels[name]} {t1 - t0:.1f} s")
    for w in result.warnings:
        _warn(w)
    spec = result.spec
    if spec.dtype == "bfloat16":
        err.print(
            "note: bfloat16 artifacts are for GPUs; ONNX Runtime's CPU provider has no bf16 MatMul."
        )
    t = Table(title=printable(f"built {result.out_dir}"))
    t.add_column("kv dtype")
    t.add_column("mode")
    t.add_column("layers")
    t.add_column("bytes/token")
    by_dtype: dict[str, list] = {}
    for la in spec.layers:
        by_dtype.setdefault(la.kv_cache_dtype, []).append(la)
    for name, layers in by_dtype.items():
        t.add_row(
            name,
            layers[0].mode.name,
            ",".join(str(la.index) for la in layers),
            str(sum(la.cache.bytes_per_token for la in layers)),
        )
    console.print(t)
    console.print(
        f"KV bytes per token: {spec.bytes_per_token} (all-bf16: {spec.bf16_bytes_per_token}, "
        f"{spec.bf16_bytes_per_token / spec.bytes_per_token:.2f}x); "
        f"artifact size: {_fmt_bytes(result.size_bytes)}",
    )
    if spec.recent_window:
        console.print(
            f"recent window: the last {spec.recent_window} tokens of each sequence also kept in "
            f"{spec.dtype}, {spec.recent_bytes_per_token} bytes per token of the window",
        )


@app.command()
def parity(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    steps: Annotated[int, typer.Option(help="Decode steps after the prefill.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Longest prompt; others are shorter.")] = 24,
    batch: Annotated[int, typer.Option(help="Number of sequences.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed for the random prompts.")] = 0,
):
    """Run the artifact on ONNX Runtime and the torch reference side by side; exit 1 on mismatch."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.runtime.engine import position_limit
    from tqexport.verify.parity import run_parity

    validate.integer(steps, "--steps", 0, MAX_PARITY_STEPS)
    validate.integer(prompt_len, "--prompt-len", 1, MAX_PARITY_PROMPT_LEN)
    validate.integer(batch, "--batch", 1, MAX_PARITY_BATCH)
    validate.seed(seed)
    art = open_artifact(artifact)
    limit = position_limit(art)
    if limit is not None and prompt_len + steps > limit:
        raise TQExportError(
            f"--prompt-len {prompt_len} + --steps {steps} is more than the model's position "
            f"limit of {limit} tokens; lower them"
        )
    report = run_parity(art, steps, prompt_len, batch, seed)
    judged = "judged" if report.logits_judged else "not judged: quantized layers, see per-layer"
    t = Table(title=f"end-to-end logits, ONNX Runtime vs torch reference ({judged})")
    for col in ("step", "max abs err", "detail", "within 1e-4"):
        t.add_column(col)
    for c in report.logits:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, _ok(c.ok))
    console.print(t)
    bad = [c for c in report.layers if not c.ok]
    t = Table(title="per layer: reference ops on ORT's own q/k/v (cache bytes, attention)")
    for col in ("check", "max abs err", "detail", "ok"):
        t.add_column(col)
    last_step = [c for c in report.layers if c.what.startswith(report.logits[-1].what + " ")]
    for c in bad or last_step:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, _ok(c.ok))
    console.print(t)
    console.print(
        f"{len(report.layers) - len(bad)}/{len(report.layers)} layer-steps agree "
        f"({'showing failures' if bad else 'showing the last step'})"
    )
    console.print(Text.assemble("parity: ", ("PASS", "green") if report.ok else ("FAIL", "red")))
    if not report.ok:
        raise typer.Exit(1)


#: parity's sizes: it runs every layer twice (ORT and the reference) on every step
MAX_PARITY_STEPS, MAX_PARITY_PROMPT_LEN, MAX_PARITY_BATCH = 1024, 8192, 64


MemoryOptions = (
    Annotated[int | None, typer.Option(help="Cache blocks per layer (block 0 is the null block).")],
    Annotated[
        str | None, typer.Option(help="KV budget, e.g. 512MiB (default when no --num-blocks).")
    ],
)


@app.command()
def inspect(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    num_blocks: MemoryOptions[0] = None,
    kv_cache_memory: MemoryOptions[1] = None,
    max_num_seqs: Annotated[
        int, typer.Option(help="Sequences per step (sizes the recent-window caches).")
    ] = _ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget per step (sizes the recent-window caches).")
    ] = _ENGINE.max_num_batched_tokens,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Per-layer cache allocation of an artifact, and totals vs an all-bf16 cache."""
    from tqexport.contract.artifact import open_artifact

    config = EngineConfig(
        num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )  # fmt: skip
    art = open_artifact(artifact)
    spec = art.spec
    per_group = config.group_blocks(art)
    blocks = max(per_group)
    rows = [
        {
            "index": la.index,
            "attention_type": la.attention_type.value,
            "window": la.window,
            "kv_cache_dtype": la.kv_cache_dtype,
            "quant_mode": la.mode.name,
            "group": la.group,
            "bytes_per_token": la.cache.bytes_per_token,
            "recent_window": la.recent_window,
            "recent_group": la.recent_group,
            "blocks": per_group[la.group],
            "bytes": per_group[la.group] * la.cache.page_size_bytes
            + (per_group[la.recent_group] * la.recent.page_size_bytes if la.recent else 0),
        }
        for la in spec.layers
    ]
    total = sum(r["bytes"] for r in rows)
    bf16 = blocks * spec.block_size * spec.bf16_bytes_per_token
    tokens = (blocks - 1) * spec.block_size
    groups = [
        {"id": g.id, "window": g.window, "recent": g.recent, "layers": list(g.layers),
         "blocks": per_group[g.id] - 1}
        for g in spec.groups
    ]  # fmt: skip
    summary = {
        "num_blocks": blocks,
        "block_size": spec.block_size,
        "usable_tokens_per_group": tokens,
        "total_bytes": total,
        "bf16_total_bytes": bf16,
        "bytes_per_token": spec.bytes_per_token,
        "bf16_bytes_per_token": spec.bf16_bytes_per_token,
    }
    if as_json:
        print(json.dumps({"layers": rows, "groups": groups, "summary": summary}, indent=2))
        return
    t = Table(
        title=printable(
            f"{art.path}: {spec.model['name']} ({spec.dtype}), "
            f"{blocks} blocks of {spec.block_size} tokens"
        )
    )
    for col in (
        "layer",
        "attention",
        "window",
        "kv dtype",
        "mode",
        "group",
        "bytes/token",
        "recent window",
        "blocks",
        "bytes",
    ):
        t.add_column(col)
    for r in rows:
        recent = f"{r['recent_window']} (group {r['recent_group']})" if r["recent_window"] else "-"
        t.add_row(
            str(r["index"]), r["attention_type"], str(r["window"] or "-"), r["kv_cache_dtype"],
            r["quant_mode"], str(r["group"]), str(r["bytes_per_token"]), recent,
            str(r["blocks"]), _fmt_bytes(r["bytes"]),
        )  # fmt: skip
    console.print(t)
    for g in groups:
        what = "full attention" if g["window"] is None else f"window {g['window']}"
        what = f"recent-window caches, {what}" if g["recent"] else what
        console.print(
            f"group {g['id']} ({what}): layers {g['layers']}, {g['blocks']} usable blocks"
        )
    console.print(
        f"total {_fmt_bytes(total)} for {tokens} tokens; an all-bf16 cache of the same blocks: "
        f"{_fmt_bytes(bf16)} ({bf16 / total:.2f}x)",
    )


EngineOptions = (
    Annotated[str, typer.Option(help="ort | torch | trt (needs `tqexport engine`)")],
    Annotated[int, typer.Option(help="Token budget per step.")],
    Annotated[int, typer.Option(help="Sequences per step.")],
    Annotated[int | None, typer.Option(help="ONNX Runtime intra-op threads (default: its own).")],
    Annotated[bool, typer.Option(help="Apply the model's chat template.")],
)


@app.command()
def run(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    prompt: Annotated[
        str | None, typer.Option(help="One prompt; tokens stream as they come.")
    ] = None,
    prompts_file: Annotated[
        Path | None, typer.Option(help="One prompt per line, served as one continuous batch.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per request.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="1.0 = off.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Request i samples with seed + i.")] = 0,
    backend: EngineOptions[0] = _ENGINE.backend,
    num_blocks: MemoryOptions[0] = _ENGINE.num_blocks,
    kv_cache_memory: MemoryOptions[1] = _ENGINE.kv_cache_memory,
    max_num_batched_tokens: EngineOptions[1] = _ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = _ENGINE.max_num_seqs,
    threads: EngineOptions[3] = _ENGINE.threads,
    chat_template: EngineOptions[4] = _ENGINE.chat_template,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
):
    """Generate from an artifact: per-layer paged caches allocated from its spec.

    A prompt that cannot run (longer than the model's position limit, or than the whole
    cache) is rejected with a warning while the others complete; when every prompt is
    rejected the exit code is 1. Arguments and input files are checked before anything runs."""
    import time

    from tqexport.runtime.engine import Engine
    from tqexport.runtime.sequence import SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise TQExportError("give exactly one of --prompt and --prompts-file")
    if prompt is not None and not prompt.strip():
        raise TQExportError("--prompt is empty")
    validate.sampling(
        max_tokens, temperature, top_k, top_p, seed, cli=True, seed_max=validate.SEED_MAX
    )
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template,
    )  # fmt: skip
    texts = [prompt] if prompt is not None else _read_prompts(prompts_file)
    engine = Engine.from_artifact(artifact, config)
    engine.require_tokenizer()
    ids = [engine.encode(t, label=f"prompt {i}") for i, t in enumerate(texts)]
    rids, rejected = {}, {}
    for i, x in enumerate(ids):
        n, limit = max_tokens, engine.max_seq_len
        room = engine.max_new_tokens(len(x))
        if room is not None and 0 < room < n:
            n = room
            what = (
                f"the model's position limit is {limit} tokens"
                if limit == engine.max_model_len
                else f"the KV cache holds {limit} tokens"
            )
            _warn(f"request {i}: at most {n} tokens generated, {what} and the prompt has {len(x)}")
        try:
            rids[i] = engine.add_request(x, SamplingParams(n, temperature, top_k, top_p, seed + i))
        except TQExportError as e:
            rejected[i] = f"rejected: {e}"
    stream = prompt is not None and not as_json

    def on_output(out):
        if stream and out.text:
            print(printable(out.text, keep_newlines=True), end="", flush=True)

    start = time.perf_counter()
    done = engine.drain(on_output)
    wall = time.perf_counter() - start
    if stream:
        print(flush=True)
    results = []
    for i, text in enumerate(texts):
        c = done.get(rids.get(i))
        results.append(
            {
                "prompt": text,
                "prompt_token_ids": ids[i],
                "token_ids": c.token_ids if c else [],
                "text": c.text if c else "",
                "finish_reason": c.finish_reason if c else rejected[i],
            }
        )
    generated = sum(len(r["token_ids"]) for r in results)
    ex, spec = engine.executor, engine.artifact.spec
    summary = {
        "requests": len(results),
        "generated_tokens": generated,
        "seconds": round(wall, 3),
        "tokens_per_second": round(generated / wall, 2) if wall else None,
        "peak_kv_bytes": ex.peak_kv_bytes,
        "peak_kv_bytes_bf16_equivalent": ex.peak_kv_bytes
        * spec.bf16_bytes_per_token
        // spec.bytes_per_token,
        "steps": ex.steps,
        "backend": backend,
    }
    if as_json:
        print(json.dumps({"results": results, "summary": summary}, indent=2))
    elif not stream:
        for i, r in enumerate(results):
            console.rule(f"request {i} ({r['finish_reason']})")
            console.print(printable(r["prompt"]), style="bold")
            console.print(printable(r["text"], keep_newlines=True))
    for i in sorted(rejected):
        _warn(f"request {i}: {rejected[i]}")
    if not as_json:
        err.print(
            f"{summary['requests']} requests, {generated} tokens in {wall:.2f} s "
            f"({summary['tokens_per_second']} tokens/s, {backend}); peak KV "
            f"{_fmt_bytes(summary['peak_kv_bytes'])} (bf16: "
            f"{_fmt_bytes(summary['peak_kv_bytes_bf16_equivalent'])})",
        )
    if rejected and len(rejected) == len(results):
        raise typer.Exit(1)


@app.command()
def serve(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    host: Annotated[
        str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one).")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: ARTIFACT).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TQEXPORT_API_KEY",
            show_envvar=False,
            help="Require 'Authorization: Bearer KEY' on /v1 (or set TQEXPORT_API_KEY).",
        ),
    ] = None,
    backend: EngineOptions[0] = _ENGINE.backend,
    num_blocks: MemoryOptions[0] = _ENGINE.num_blocks,
    kv_cache_memory: MemoryOptions[1] = _ENGINE.kv_cache_memory,
    max_num_batched_tokens: EngineOptions[1] = _ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = _ENGINE.max_num_seqs,
    threads: EngineOptions[3] = _ENGINE.threads,
    chat_template: EngineOptions[4] = _ENGINE.chat_template,
    grace_seconds: Annotated[
        float, typer.Option(help="After SIGTERM, seconds in-flight requests may take to finish.")
    ] = 30.0,
    ray: Annotated[
        bool, typer.Option("--ray", help="Serve as a Ray Serve deployment (scale-out).")
    ] = False,
    replicas: Annotated[
        int, typer.Option(help="With --ray: replicas, each with its own engine and caches.")
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(help="With --ray: join this cluster (e.g. HEAD:6379) instead of a local one."),
    ] = None,
    replica_cpus: Annotated[
        float, typer.Option(help="With --ray: CPUs Ray reserves for each replica.")
    ] = 1.0,
):
    """Serve an artifact over OpenAI's HTTP API: /v1/completions, /v1/chat/completions
    (streamed or whole), /v1/models, /health, /metrics; SIGTERM drains and exits 0."""
    import os

    if api_key is None and os.environ.get("TQEXPORT_API_KEY") == "":
        raise TQExportError("TQEXPORT_API_KEY is set but empty; give a key or unset it")
    validate.integer(port, "--port", 0, 65535)
    validate.number(grace_seconds, "--grace-seconds", 0.0)
    validate.integer(replicas, "--replicas", 1, 1024)
    validate.number(replica_cpus, "--replica-cpus", 0.0)
    if not ray and (replicas != 1 or ray_address is not None):
        raise TQExportError("--replicas and --ray-address need --ray")
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template,
    )  # fmt: skip
    if ray:
        from tqexport.contract.artifact import open_artifact
        from tqexport.serve.ray_serve import serve_on_ray

        open_artifact(artifact)  # a bad artifact fails here, not in every replica
        name = served_model_name or str(artifact)
        serve_on_ray(artifact, config, host, port, name, api_key, replicas, ray_address,
                     replica_cpus, grace_seconds)  # fmt: skip
        return
    from tqexport.serve.runner import serve as run_server

    run_server(artifact, config, host, port, served_model_name, api_key, grace_seconds)


#: the largest --prompts-file read (a prompt longer than any model's context is pointless)
MAX_PROMPTS_FILE_BYTES = 256 * 2**20


def _read_prompts(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 prompts file, or one error naming the file."""
    if not path.is_file():
        raise TQExportError(f"--prompts-file {path} not found")
    try:
        size = path.stat().st_size
        if size > MAX_PROMPTS_FILE_BYTES:
            raise TQExportError(
                f"--prompts-file {path} has {size} bytes, more than {MAX_PROMPTS_FILE_BYTES}"
            )
        data = path.read_bytes()
    except OSError as e:
        raise TQExportError(f"cannot read --prompts-file {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TQExportError(
            f"--prompts-file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); give one prompt per line in UTF-8"
        ) from None
    texts = [ln for ln in text.splitlines() if ln.strip()]
    if not texts:
        raise TQExportError(f"--prompts-file {path} has no prompts")
    return texts


bench_app = typer.Typer(
    help="Quality (perplexity, KL, top-1 vs llama.cpp) and speed benchmarks.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

#: every kv dtype a quality run covers by default (aliases and 16-bit stores left out)
BENCH_DTYPES = (
    "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
    "nvfp4", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "tqx_k4v4_g32", "tqx_k4v3_g32",
)  # fmt: skip
BENCH_SPEED_DTYPES = ("auto", "fp8", "turboquant_4bit_nc")


def _bench_configs(
    dtypes: list[str] | None,
    boundary: str,
    skip_layers: list[str] | None,
    recent: str = "0",
    kv_scales: str = "1.0",
):
    from tqexport.bench.quality import Config
    from tqexport.export.artifact import parse_kv_scales
    from tqexport.kvquant.modes import parse_kv_cache_dtype

    if boundary not in ("on", "off", "both"):
        raise TQExportError(f"--boundary must be on, off or both, got {boundary!r}")
    parse_kv_scales(kv_scales)
    names = _split(dtypes) or list(BENCH_DTYPES)
    for n in names:
        parse_kv_cache_dtype(n)
    skip = tuple(_split(skip_layers))
    windows = _ints(recent, "recent-window", minimum=0, maximum=validate.MAX_RECENT_WINDOW)
    configs = []
    for n in names:
        flags = {"on": [True], "off": [False], "both": [True, False]}[boundary]
        for b in flags if parse_kv_cache_dtype(n).is_turboquant else [True]:
            configs += [Config(n, b, skip, w, kv_scales) for w in (windows if n != "auto" else [0])]
    return configs


def _split(values: list[str] | None) -> list[str]:
    return [x.strip() for v in values or [] for x in v.split(",") if x.strip()]


def _quality(target, configs, text_file, chunk, chunks, peer: bool, threads=None):
    """Run ours (and the llama.cpp peer when asked and possible); returns (results, notes)."""
    from rich.progress import Progress

    from tqexport.bench import evaltext, peers, quality

    text = evaltext.file_text(text_file) if text_file else evaltext.pydoc_topics()
    with Progress(console=err) as bar:
        task = bar.add_task("tqexport: scoring chunks", total=None)
        ours, ids = quality.evaluate(
            target, configs, text, chunk, chunks,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    peer_result, note = None, None
    source = ours["model"]
    gguf = peers.gguf_path(source)
    if not peer:
        note = "not run (--no-peer)"
    elif gguf is None:
        note = f"not run: llama.cpp needs a GGUF model, {source} is not one"
    elif not peers.available():
        note = "not run: llama-cpp-python is not installed (pip install -e '.[peers]')"
    else:
        err.print(f"llama.cpp: scoring {len(ids)} chunks (f16, q8_0, q4_0)")
        peer_result = peers.evaluate(gguf, ids, threads=threads)
    return ours, peer_result, note


@bench_app.command("quality")
def bench_quality(
    target: Annotated[str, typer.Argument(help="MODEL (HF dir, .gguf, built-in) or artifact DIR.")],
    kv_cache_dtype: Annotated[
        list[str] | None,
        typer.Option(help="kv dtypes to score (repeatable or comma-separated; default: all)."),
    ] = None,
    boundary: Annotated[
        str, typer.Option(help="TurboQuant boundary protection: on, off or both.")
    ] = "both",
    skip_layers: SkipOption = None,
    recent_window: Annotated[
        str, typer.Option(help="--kv-recent-window values to score, e.g. 0,32,128.")
    ] = "0",
    kv_scales: Annotated[
        str, typer.Option(help="fp8/nvfp4 per-layer scales: a number, or calibrate (as build).")
    ] = "1.0",
    chunk: Annotated[int, typer.Option(help="Tokens per evaluation window.")] = 1024,
    chunks: Annotated[int, typer.Option(help="Windows scored (from the text's start).")] = 4,
    text_file: Annotated[
        Path | None, typer.Option(help="Evaluate on this UTF-8 text instead of pydoc topics.")
    ] = None,
    peer: Annotated[bool, typer.Option(help="Also run llama.cpp's f16/q8_0/q4_0 caches.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Perplexity, KL and top-1 agreement per kv-cache configuration, through the paged caches."""
    from tqexport.bench.report import with_deltas

    validate.integer(chunk, "--chunk", 2, MAX_BENCH_CHUNK)
    validate.integer(chunks, "--chunks", 1, MAX_BENCH_CHUNKS)
    if text_file is not None and not text_file.is_file():
        raise TQExportError(f"--text-file {text_file} not found")
    configs = _bench_configs(kv_cache_dtype, boundary, skip_layers, recent_window, kv_scales)
    ours, peer_result, note = _quality(target, configs, text_file, chunk, chunks, peer)
    rows = with_deltas(ours, peer_result)
    if as_json:
        print(json.dumps({"quality": ours, "peer": peer_result, "peer_note": note,
                          "rows": rows}, indent=2))  # fmt: skip
        return
    _print_quality(ours, rows, note)


def _print_quality(ours: dict, rows: list[dict], note: str | None) -> None:
    c = ours["chunking"]
    t = Table(
        title=printable(
            f"{ours['model']}: {c['chunks']} x {c['chunk_tokens']} tokens of "
            f"{ours['text']['name']} (sha256 {ours['text']['sha256'][:12]})"
        )
    )
    for col in ("tool", "configuration", "bits/elem", "PPL", "vs own baseline", "KL", "top-1"):
        t.add_column(col, justify="left" if col in ("tool", "configuration") else "right")
    for r in rows:
        t.add_row(
            r["tool"], r["label"], f"{r['bits_per_element']:.2f}", f"{r['ppl']:.4f}",
            f"{r['ppl_delta_pct']:+.2f}%", f"{r.get('kl', 0):.5f}",
            f"{100 * r.get('top1', 1):.2f}%",
        )  # fmt: skip
    console.print(t)
    console.print(
        "bits/elem: all in, unquantized layers counted at 16 bits; KL = KL(baseline || run)",
    )
    if note:
        err.print(printable(f"llama.cpp peer {note}"))


@bench_app.command("speed")
def bench_speed(
    target: Annotated[
        str, typer.Argument(help="MODEL (artifacts built per dtype) or artifact DIR.")
    ],
    kv_cache_dtype: Annotated[
        list[str] | None, typer.Option(help="kv dtypes (default: auto, fp8, turboquant_4bit_nc).")
    ] = None,
    contexts: Annotated[
        str, typer.Option(help="Context lengths, comma-separated.")
    ] = "256,1024,4096",
    batches: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,8",
    steps: Annotated[int, typer.Option(help="Timed decode steps per point.")] = 4,
    budget: Annotated[
        str, typer.Option(help="KV budget for the resident-token column.")
    ] = "512MiB",
    workdir: Annotated[Path, typer.Option(help="Where MODEL's artifacts are built.")] = Path(
        "out/bench"
    ),
    recent_window: Annotated[
        str, typer.Option(help="--kv-recent-window values per quantized dtype, e.g. 0,32.")
    ] = "0",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """Decode tokens/s vs context and batch per kv dtype on ONNX Runtime CPU; KV memory."""
    speed = _speed(target, kv_cache_dtype, contexts, batches, steps, budget, workdir, recent_window)
    if as_json:
        print(json.dumps(speed, indent=2))
        return
    _print_speed(speed)


#: bench sizes: quality windows, decode contexts, batches and timed steps
MAX_BENCH_CHUNK, MAX_BENCH_CHUNKS = 2**17, 10**5
MAX_BENCH_CONTEXT, MAX_BENCH_BATCH, MAX_BENCH_STEPS = 2**20, 4096, 10**4


def _ints(text: str, what: str, minimum: int = 1, maximum: int | None = None) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
        raise TQExportError(f"--{what} must be {kind} separated by commas, got {text!r}")
    if maximum is not None and max(values) > maximum:
        raise TQExportError(f"--{what} values must be at most {maximum}, got {max(values)}")
    return values


def _speed_args(contexts: str, batches: str, steps: int, recent: str):
    ctx = _ints(contexts, "contexts", maximum=MAX_BENCH_CONTEXT)
    bat = _ints(batches, "batches", maximum=MAX_BENCH_BATCH)
    windows = _ints(recent, "recent-window", minimum=0, maximum=validate.MAX_RECENT_WINDOW)
    validate.integer(steps, "--steps", 1, MAX_BENCH_STEPS)
    return ctx, bat, windows


def _check_speed_memory(spec, label: str, ctx: list[int], bat: list[int], steps: int) -> None:
    """The largest decode point's caches must fit in this machine's memory."""
    tokens = max(bat) * (max(ctx) + steps + 2 * spec.block_size)
    need = tokens * (spec.bytes_per_token + spec.recent_bytes_per_token)
    limit = validate.physical_memory()
    if limit is not None and need > limit:
        raise TQExportError(
            f"{label}: context {max(ctx)} x batch {max(bat)} needs {_fmt_bytes(need)} of KV "
            f"cache, more than this machine's {_fmt_bytes(limit)}; lower --contexts or --batches"
        )


def _speed(target, dtypes, contexts, batches, steps, budget, workdir, recent="0") -> dict:
    from tqexport.bench import speed
    from tqexport.contract.artifact import open_artifact
    from tqexport.kvquant.modes import parse_kv_cache_dtype
    from tqexport.runtime.executor import parse_memory

    ctx, bat, windows = _speed_args(contexts, batches, steps, recent)
    parse_memory(budget, "--budget")
    if Path(target).is_dir() and (Path(target) / "tqexport.json").is_file():
        art = open_artifact(target)
        _check_speed_memory(art.spec, str(target), ctx, bat, steps)
        name = art.spec.request["kv_cache_dtype"]
        arts = {"auto": speed.artifact_for(art.spec.model["path"], "auto", workdir)}
        arts[name] = art
    else:
        from tqexport.models.config import describe_model
        from tqexport.resolve import resolve

        names = ["auto", *[n for n in _split(dtypes) or BENCH_SPEED_DTYPES if n != "auto"]]
        for n in names:  # every name and combination first: nothing is built for a typo
            parse_kv_cache_dtype(n)
        desc = describe_model(target)
        plans = {}
        for n in names:
            for w in windows if n != "auto" else [0]:
                label = f"{n} recent {w}" if w else n
                plans[label] = (n, w)
                spec = resolve(desc, n, [], recent_window=w).spec
                _check_speed_memory(spec, label, ctx, bat, steps)
        arts = {}
        for label, (n, w) in plans.items():
            err.print(printable(f"artifact {label}: building or reusing under {workdir}"))
            arts[label] = speed.artifact_for(target, n, workdir, w)
    return speed.measure(
        arts, ctx, bat, steps, budget, progress=lambda what: err.print(printable(what))
    )


def _print_speed(speed: dict) -> None:
    names = list(speed["decode"][0]["ms_per_step"])
    t = Table(title="decode on ONNX Runtime CPU (ratios to auto measured in the same run)")
    for col in ("context", "batch", *[f"{n} tok/s" for n in names],
                *[f"{n} vs auto" for n in names[1:]]):  # fmt: skip
        t.add_column(col, justify="right")
    for r in speed["decode"]:
        t.add_row(
            str(r["context"]), str(r["batch"]),
            *[f"{r['tokens_per_second'][n]:.1f}" for n in names],
            *[f"{r['speed_vs_auto'][n]:.2f}x" for n in names[1:]],
        )  # fmt: skip
    console.print(t)
    m = Table(title=printable(f"KV memory at a {speed['budget']} budget"))
    for col in ("kv dtype", "KV bytes/token", "resident tokens", "vs auto", "bytes ratio"):
        m.add_column(col, justify="right")
    for x in speed["memory"]:
        m.add_row(
            x["label"], str(x["kv_bytes_per_token"]), str(x["resident_tokens"]),
            f"{x['resident_vs_auto']:.3f}x", f"{x['bytes_ratio_auto_over_this']:.3f}x",
        )  # fmt: skip
    console.print(m)


@bench_app.command("report")
def bench_report(
    model: Annotated[str, typer.Argument(help="MODEL (HF dir, .gguf, built-in).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Report directory.")],
    chunks: Annotated[int, typer.Option(help="Quality windows of 1024 tokens.")] = 8,
    contexts: Annotated[str, typer.Option(help="Decode context lengths.")] = "256,1024,4096",
    batches: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,8",
    workdir: Annotated[Path, typer.Option(help="Where the speed artifacts are built.")] = Path(
        "out/bench"
    ),
    quality_json: Annotated[
        list[Path] | None,
        typer.Option(
            help="Reuse `bench quality MODEL --json` outputs (repeatable) instead of rerunning."
        ),
    ] = None,
):
    """Quality + speed side by side: report.md, PNG plots and results.json in OUT.

    Quality: every kv dtype (TurboQuant with and without boundary protection) against
    llama.cpp, then the TurboQuant presets with recent windows 32 and 128. Speed: auto, fp8
    and turboquant_4bit_nc, the last also with a 32-token recent window."""
    from tqexport.bench import report
    from tqexport.kvquant.modes import parse_kv_cache_dtype

    validate.integer(chunks, "--chunks", 1, MAX_BENCH_CHUNKS)
    _speed_args(contexts, batches, 4, "0,32")
    if quality_json:
        parts = []
        for path in quality_json:
            try:
                parts.append(json.loads(path.read_text()))
                parts[-1]["quality"]["model"]
            except (OSError, ValueError, KeyError, TypeError):
                raise TQExportError(
                    f"--quality-json {path} is not the output of `bench quality --json`"
                ) from None
    else:
        tq = [n for n in BENCH_DTYPES if parse_kv_cache_dtype(n).is_turboquant]
        parts = []
        for configs, peer in (
            (_bench_configs(None, "both", None), True),
            (_bench_configs(tq, "both", None, "32,128"), False),
        ):
            ours, peer_result, note = _quality(model, configs, None, 1024, chunks, peer)
            parts.append({"quality": ours, "peer": peer_result, "peer_note": note})
    ours, peer_result, note = report.merge_quality(parts, model)
    speed = _speed(model, None, contexts, batches, 4, "512MiB", workdir, "0,32")
    rows = report.with_deltas(ours, peer_result)
    results = {
        "model": model,
        "command": "tqexport bench report " + " ".join(sys.argv[3:]),
        "machine": report.machine(),
        "quality": ours,
        "peer": peer_result,
        "peer_note": note,
        "rows": rows,
        "speed": speed,
        "goals": report.goals(rows, speed),
    }
    files = report.write(out, results)
    _print_quality(ours, rows, note)
    _print_speed(speed)
    for g in results["goals"]:
        verdict = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[g["met"]]
        console.print(printable(f"{g['goal']}: {verdict} ({g['detail']})"))
    console.print(printable("wrote " + ", ".join(str(f) for f in files)))


@app.command()
def engine(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    max_batch: Annotated[int, typer.Option(help="Most sequences per step.")] = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Most tokens per step.")] = 512,
    max_blocks: Annotated[int, typer.Option(help="Most cache blocks per layer.")] = 4096,
):
    """Build a TensorRT engine (engine.plan) into ARTIFACT: needs tensorrt>=10.9 and a GPU."""
    from tqexport.export.trt import build_engine

    validate.integer(max_batch, "--max-batch", 1, validate.MAX_NUM_SEQS)
    validate.integer(
        max_num_batched_tokens, "--max-num-batched-tokens", 1, validate.MAX_NUM_BATCHED_TOKENS
    )
    validate.integer(max_blocks, "--max-blocks", 2, validate.MAX_NUM_BLOCKS)
    out = build_engine(artifact, max_batch, max_num_batched_tokens, max_blocks)
    console.print(printable(f"wrote {out} ({_fmt_bytes(out.stat().st_size)})"))


def _ok(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="red")


def _error(message: str, code: int = 2):
    """The one line every user error prints: ``error: <problem and fix>``."""
    text = printable(message).strip() or "unknown error"
    err.print(Text.assemble(("error:", "red"), " ", text), soft_wrap=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors, usage errors included, become one line on stderr and
    exit code 2; ``--help`` exits 0; parity's mismatch exits 1."""
    try:
        rv = app(args=argv, prog_name="tqexport", standalone_mode=False)
    except TQExportError as e:
        _error(str(e))
    except click_exceptions.ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # typer printed the help already
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        path = ctx.command_path if ctx is not None else "tqexport"
        _error(f"{e.format_message()} (see {path} --help)", 2 if e.exit_code == 2 else 1)
    except _ABORTS:
        _error("aborted", 1)
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


if __name__ == "__main__":
    main()
