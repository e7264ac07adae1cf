"""The ``tqexport`` command line (typer). Bad input: one line on stderr, exit code 2.

Every argument is checked (:mod:`tqexport.validate`) before any expensive work, usage errors
(a bad type, a missing or unknown option) are one line too, and every user string (paths,
prompts, model names, messages quoting them) is printed literally: the consoles parse no
markup and no emoji codes, and control characters are shown escaped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from tqexport import validate
from tqexport.bench.commands import bench_app
from tqexport.calibration import DEFAULT_CANDIDATES, DEFAULT_TOKENS
from tqexport.console import console, err, error_exit, fmt_bytes, ok_text, progress, run_in_stages
from tqexport.console import warn as _warn
from tqexport.errors import TQExportError
from tqexport.native import KERNEL_CHOICES
from tqexport.options import (
    BlockSizeOption,
    BoundaryOption,
    CalibrationOption,
    Command,
    EngineOptions,
    KernelsOption,
    KeyTransformOption,
    KvBitsOption,
    KvDtypeOption,
    KvLayersOption,
    MemoryOptions,
    RecentWindowOption,
    SinkTokensOption,
    SkipOption,
    WeightsOption,
    given,
)
from tqexport.runtime.config import EngineConfig
from tqexport.safe_files import check_output_file
from tqexport.spec import BuildRequest
from tqexport.spec.request import (
    DEFAULT_KV_SCALES,
    DEFAULT_OPSET,
    DEFAULT_WEIGHTS,
    MAX_BUILD_OPSET,
)
from tqexport.validate import DEFAULT_BLOCK_SIZE, printable

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
#: every serving option's default (run, inspect, serve): defined once, in EngineConfig
_ENGINE = EngineConfig()


@app.command(cls=Command)
def dtypes(
    head_size: Annotated[int, typer.Option(help="Head size D for the byte columns.")] = 128,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """List every kv-cache dtype: mode, bits per element, bytes per token-head (K+V, all in)."""
    from tqexport.kvquant.catalog import dtype_rows
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


#: plan's and build's options whose explicit use BuildRequest.check_given judges
_GIVEN_RULES = ("boundary", "kv_scales")


def _build_request(ctx: typer.Context, model: str, **fields) -> BuildRequest:
    """plan's and build's options as one checked request (``--kv-bits`` chooses its
    ``--kv-layers``, after the cheap checks); options given to no effect are refused."""
    p = ctx.params
    request = BuildRequest(
        kv_cache_dtype=p["kv_cache_dtype"],
        skip_layers=tuple(p["skip_layers"] or ()),
        boundary=p["boundary"],
        block_size=p["block_size"],
        recent_window=p["recent_window"],
        sink_tokens=p["sink_tokens"],
        key_transform=p["key_transform"],
        kv_layers=p["kv_layers"],
        **fields,
    )
    rules = [name for name in _GIVEN_RULES if name in p and given(ctx, name)]
    budget = p["kv_bits"] is not None
    request.check_given([r for r in rules if not (budget and r == "kv_scales")])
    kv_layers = _budget_layers(ctx, model, request.dtype)
    if budget:
        request = dataclasses.replace(request, kv_layers=kv_layers)
        request.check_given(rules)
    return request


def _budget_layers(ctx: typer.Context, model: str, dtype: str | None) -> str | None:
    """``--kv-layers`` as given, or as ``--kv-bits`` chooses it (the plan and its predicted
    cost printed to stderr); options ``--kv-bits`` would override are refused first."""
    from tqexport import kv_budget

    p = ctx.params
    if p["kv_bits"] is None:
        if p["calibration"] is not None:
            raise TQExportError("--calibration is read only by --kv-bits; add --kv-bits or drop it")
        return p["kv_layers"]
    kv_bits = kv_budget.check_budget(p["kv_bits"])
    names = ("kv_layers", "kv_cache_dtype", "skip_layers", "recent_window", "sink_tokens")
    kv_budget.conflicts(f"{kv_bits:g}", {
        "--kv-layers": p["kv_layers"] is not None, "--kv-cache-dtype": given(ctx, names[1]),
        "--skip-layers": bool(p["skip_layers"]), "--kv-recent-window": given(ctx, names[3]),
        "--kv-sink-tokens": given(ctx, names[4]),
    })  # fmt: skip
    from tqexport.kvquant.transforms import parse_key_transform
    from tqexport.models.config import describe_model

    desc = describe_model(model, dtype)
    kinds = parse_key_transform(p["key_transform"])
    choice, _ = kv_budget.budget_plan(model, desc, kv_bits, p["calibration"], _say, kinds)
    _say(
        f"--kv-bits {kv_bits:g} chose --kv-layers {choice.kv_layers}: "
        f"{float(choice.bits_per_element):.4f} bits per element all in, predicted KL "
        f"{choice.predicted_cost:.5f} (the sum of its layers' calibrated costs)"
    )
    return choice.kv_layers


def _say(text: str) -> None:
    err.print(printable(text))


VllmArgsOption = Annotated[
    bool,
    typer.Option(
        "--vllm-args",
        help="Print the `vllm serve` command giving the same per-layer caches (exit 1 and say "
        "why when vLLM cannot express them).",
    ),
]


def _print_vllm_command(spec, model: str) -> None:
    """The ``vllm serve`` command for ``spec``'s caches, or exit 1 naming what vLLM lacks."""
    from tqexport.vllm_bridge import vllm_args

    flags = vllm_args(spec)
    if flags.unsupported:
        error_exit("vLLM cannot serve this plan: " + "; ".join(flags.unsupported), 1)
    print(flags.command(model))


@app.command(cls=Command)
def plan(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF dir, config.json, .gguf, or built-in name.")],
    kv_cache_dtype: KvDtypeOption = "auto",
    kv_layers: KvLayersOption = None,
    kv_bits: KvBitsOption = None,
    calibration: CalibrationOption = None,
    skip_layers: SkipOption = None,
    boundary: BoundaryOption = True,
    block_size: BlockSizeOption = DEFAULT_BLOCK_SIZE,
    recent_window: RecentWindowOption = 0,
    sink_tokens: SinkTokensOption = 0,
    key_transform: KeyTransformOption = "none",
    dtype: Annotated[
        str | None, typer.Option(help="Model dtype (default: the config's, else float32).")
    ] = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the per-layer spec as JSON.")
    ] = False,
    vllm_args: VllmArgsOption = False,
):
    """Print the per-layer cache plan of MODEL and what its weights would take, from its config
    (a GGUF: its tensor index) alone: no weights loaded."""
    from tqexport.kv_layers import covered, parse_kv_layers
    from tqexport.models.config import describe_model
    from tqexport.resolve import resolve
    from tqexport.spec import recent_label

    if as_json and vllm_args:
        raise TQExportError("--json and --vllm-args each choose what is printed; give one")
    request = _build_request(ctx, model, dtype=dtype, weights=weights)
    kv_layers, kinds = request.kv_layers, request.key_transform
    desc = describe_model(model, dtype)
    res = resolve(desc, request)
    for w in res.warnings:
        _warn(w)
    spec = res.spec
    own = covered(parse_kv_layers(kv_layers), len(spec.layers)) if kv_layers else {}
    planned = _planned_weights(model, request) if not vllm_args else None
    if as_json:
        print(json.dumps({**spec.plan_dict(), "weights_bytes": planned}, indent=2))
        return
    if vllm_args:
        _print_vllm_command(spec, model)
        return
    t = Table(
        title=printable(
            f"{desc.name} ({desc.architecture}, {desc.dtype}): --kv-cache-dtype {kv_cache_dtype}"
            + (f" --kv-layers {request.kv_layers}" if kv_layers else "")
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
        *(["key transform"] if kinds else []),
        "why unquantized",
    ):
        t.add_column(col)
    keys = request.key_transform_label
    for pos, la in enumerate(spec.layers):
        why = la.skipped_by or ""
        if pos in own and not la.mode.is_quantized:
            why = f"--kv-layers {own[pos].text}"
        t.add_row(
            str(la.index),
            la.attention_type.value,
            str(la.window) if la.window else "-",
            la.kv_cache_dtype,
            la.mode.name,
            la.cache.storage_dtype,
            str(la.cache.bytes_per_token),
            str(la.group),
            recent_label(la.recent_window, la.sink_tokens, la.recent_group),
            *([f"{keys} (fitted at build)" if la.mode.is_quantized else "-"] if kinds else []),
            printable(why),
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
        f"KV bytes per token, all layers: {fmt_bytes(spec.bytes_per_token)}; "
        f"an all-bf16 cache: {fmt_bytes(spec.bf16_bytes_per_token)} ({ratio:.2f}x this plan)",
    )
    if any(la.skipped_by == "turboquant boundary" for la in spec.layers):
        console.print("TurboQuant boundary layers stay unquantized; --no-boundary quantizes them.")
    parts = ", ".join(f"{p} {fmt_bytes(n)}" for p, n in planned.items())
    console.print(f"weights (--weights {weights}): {parts}")


def _planned_weights(model: str, request: BuildRequest) -> dict[str, int]:
    """What the build's weights would take by precision, largest first."""
    from tqexport.export.source import BuildSource

    sizes = BuildSource(model, request).planned_weight_bytes()
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1]))


@app.command(cls=Command)
def build(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF dir, .gguf, or built-in name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Artifact directory to create.")],
    kv_cache_dtype: KvDtypeOption = "auto",
    kv_layers: KvLayersOption = None,
    kv_bits: KvBitsOption = None,
    calibration: CalibrationOption = None,
    skip_layers: SkipOption = None,
    boundary: BoundaryOption = True,
    block_size: BlockSizeOption = DEFAULT_BLOCK_SIZE,
    recent_window: RecentWindowOption = 0,
    sink_tokens: SinkTokensOption = 0,
    key_transform: KeyTransformOption = "none",
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 | float16 | bfloat16 (bf16 is a GPU target). Default: float32."),
    ] = None,
    opset: Annotated[
        int, typer.Option(help=f"ONNX opset ({DEFAULT_OPSET}..{MAX_BUILD_OPSET}).")
    ] = DEFAULT_OPSET,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    force: Annotated[bool, typer.Option(help="Replace an existing artifact directory.")] = False,
    kv_scales: Annotated[
        str,
        typer.Option(
            help="fp8/nvfp4 per-layer scales: a number (1.0, vLLM's default) or calibrate."
        ),
    ] = DEFAULT_KV_SCALES,
    calibration_text: Annotated[
        Path | None,
        typer.Option(
            help="Text file for --kv-scales calibrate and --kv-key-transform (default: pydoc "
            "topics)."
        ),
    ] = None,
):
    """Export MODEL with per-layer KV caches: model.onnx + tqexport.json + tokenizer."""
    from tqexport.export.artifact import build_artifact
    from tqexport.export.outdir import check_target

    check_target(out, force)  # before --kv-bits measures a table
    request = _build_request(ctx, model, dtype=dtype or "float32", opset=opset, weights=weights,
                             kv_scales=kv_scales, calibration_text=calibration_text)  # fmt: skip
    labels = {
        "load": "loading weights",
        "calibrate": "calibrating",
        "export": "exporting ONNX",
        "save": "saving",
    }
    result = run_in_stages(labels, lambda stage: build_artifact(model, out, request, stage, force))
    for w in result.warnings:
        _warn(w)
    if result.replaced:
        console.print(printable(f"replaced {result.replaced}"), soft_wrap=True)
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
        f"artifact size: {fmt_bytes(result.size_bytes)}",
    )
    if spec.weights is not None:
        console.print(
            printable(f"weights: {spec.weights.summary()}; other tensors in {spec.dtype}"),
            soft_wrap=True,
        )
    if spec.recent_window:
        console.print(
            f"recent window: the last {spec.recent_window} tokens of each sequence also kept in "
            f"{spec.dtype}, {spec.recent_bytes_per_token} bytes per token of the window",
        )
    if spec.sink_tokens:
        console.print(
            f"sink tokens: the first {spec.sink_tokens} tokens of each sequence also kept there",
        )


@app.command(cls=Command)
def calibrate(
    model: Annotated[str, typer.Argument(help="HF dir, .gguf, or built-in name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="The table file (JSON) to write.")],
    candidates: Annotated[
        str | None,
        typer.Option(
            help="Caches to measure, DTYPE[:wN][:sN] joined by commas (auto is always one). "
            f"Default: {','.join(DEFAULT_CANDIDATES)}."
        ),
    ] = None,
    tokens: Annotated[int, typer.Option(help="Calibration tokens scored per measurement.")] = (
        DEFAULT_TOKENS
    ),
    calibration_text: Annotated[
        Path | None,
        typer.Option(help="Calibration text (default: the held-out pydoc topics)."),
    ] = None,
    key_transform: Annotated[
        str,
        typer.Option(
            "--kv-key-transform",
            help="Measure under this key transform (fitted on the calibration text), for "
            "--kv-bits builds with the same one: the tqx_* candidates take it, the others "
            "(fp8) keep plain keys.",
        ),
    ] = "none",
    force: Annotated[bool, typer.Option(help="Replace an existing table file.")] = False,
):
    """Measure what each candidate cache costs in each layer (KL of the next-token distribution
    with only that layer changed) and write the table `--kv-bits` reads."""
    from tqexport import calibration as cal
    from tqexport.kvquant.transforms import parse_key_transform

    kinds = parse_key_transform(key_transform)
    cands = cal.parse_candidates(candidates) if candidates is not None else cal.DEFAULT_CANDIDATES
    validate.integer(tokens, "--tokens", 2, cal.MAX_TOKENS)
    if calibration_text is not None:
        validate.text_file(calibration_text, "--calibration-text")
    check_output_file(out, force)
    from tqexport.models.config import describe_model

    desc = describe_model(model)
    cal.check_transform(desc, cands, kinds)
    with progress() as bar:
        task = bar.add_task("calibrating", total=len(desc.layers) * len(cands))
        table = cal.measure(model, cands, calibration_text, tokens,
                            lambda done, total: bar.update(task, completed=done),
                            kinds)  # fmt: skip
    table.write(out, force)
    t = Table(title=printable(f"{desc.name}: mean KL per prediction, only that layer changed"))
    t.add_column("layer")
    for c in cands:
        t.add_column(c, justify="right")
    for pos, row in enumerate(table.cost):
        t.add_row(str(pos), *(f"{x:.2e}" for x in row))
    console.print(t)
    console.print(
        printable(
            f"{len(table.cost)} layers x {len(cands)} candidates"
            + (f" (keys {table.key_transform})" if kinds else "")
            + f" on {table.text['tokens']} tokens "
            f"of {table.text['name']} in {table.elapsed_seconds:.0f} s; wrote {out}"
        )
    )


@app.command(cls=Command)
def parity(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    steps: Annotated[int, typer.Option(help="Decode steps after the prefill.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Longest prompt; others are shorter.")] = 24,
    batch: Annotated[int, typer.Option(help="Number of sequences.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed for the random prompts.")] = 0,
    kernels: KernelsOption = _ENGINE.kernels,
):
    """Run the artifact on ONNX Runtime and the torch reference side by side; exit 1 on mismatch."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.runtime.engine import position_limit
    from tqexport.verify.parity import run_parity

    validate.integer(steps, "--steps", 0, MAX_PARITY_STEPS)
    validate.integer(prompt_len, "--prompt-len", 1, MAX_PARITY_PROMPT_LEN)
    validate.integer(batch, "--batch", 1, MAX_PARITY_BATCH)
    validate.seed(seed)
    validate.choice(kernels, "--kernels", KERNEL_CHOICES)
    art = open_artifact(artifact)
    limit = position_limit(art)
    if limit is not None and prompt_len + steps > limit:
        raise TQExportError(
            f"--prompt-len {prompt_len} + --steps {steps} is more than the model's position "
            f"limit of {limit} tokens; lower them"
        )
    report = run_parity(art, steps, prompt_len, batch, seed, kernels=kernels)
    console.print(f"ONNX Runtime runs the layers on {report.kernels}")
    judged = "judged" if report.logits_judged else "not judged: quantized layers, see per-layer"
    t = Table(title=f"end-to-end logits, ONNX Runtime vs torch reference ({judged})")
    for col in ("step", "max abs err", "detail", f"within {report.logits_tolerance:g}"):
        t.add_column(col)
    for c in report.logits:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, ok_text(c.ok))
    console.print(t)
    bad = [c for c in report.layers if not c.ok]
    t = Table(title="per layer: reference ops on ORT's own q/k/v (cache bytes, attention)")
    for col in ("check", "max abs err", "detail", "ok"):
        t.add_column(col)
    last_step = [c for c in report.layers if c.what.startswith(report.logits[-1].what + " ")]
    for c in bad or last_step:
        t.add_row(c.what, f"{c.max_abs:.2e}", c.detail, ok_text(c.ok))
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


@app.command(cls=Command)
def inspect(
    ctx: typer.Context,
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    num_blocks: MemoryOptions[0] = None,
    kv_cache_memory: MemoryOptions[1] = None,
    max_model_len: MemoryOptions[2] = None,
    max_num_seqs: Annotated[
        int,
        typer.Option(help="Sequences per step (sizes the windowed caches, bounds the batch)."),
    ] = _ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget per step (sizes the recent-window caches).")
    ] = _ENGINE.max_num_batched_tokens,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    vllm_args: VllmArgsOption = False,
):
    """Per-layer and per-group cache allocation of an artifact, totals vs an all-bf16 cache, and
    how many sequences of the longest length served fit at once."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.native.library import choose as choose_kernels
    from tqexport.runtime.engine import context_limit, limit_fallback_note
    from tqexport.runtime.memory import allocation
    from tqexport.runtime.text import has_tokenizer, load_tokenizer
    from tqexport.spec import recent_label

    config = EngineConfig(
        num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
    )  # fmt: skip
    if as_json and vllm_args:
        raise TQExportError("--json and --vllm-args each choose what is printed; give one")
    art = open_artifact(artifact)
    spec = art.spec
    if vllm_args:
        sizing = [n for n in ("num_blocks", "kv_cache_memory", "max_model_len", "max_num_seqs",
                              "max_num_batched_tokens") if given(ctx, n)]  # fmt: skip
        if sizing:
            flag = "--" + sizing[0].replace("_", "-")
            raise TQExportError(f"{flag} sizes the cache inspect shows; --vllm-args prints only "
                                "the vLLM cache flags: drop one of them")  # fmt: skip
        _print_vllm_command(spec, spec.model.get("path", spec.model["name"]))
        return
    if not any(g.window for g in spec.groups) and given(ctx, "max_num_batched_tokens"):
        raise TQExportError(
            f"--max-num-batched-tokens has no effect: {artifact} has no windowed caches for it "
            "to size; drop it"
        )
    # the tokenizer is read only where it is the one source of the position limit
    context, _ = context_limit(art, max_model_len)
    tokenizer = None
    if context is None and has_tokenizer(art.path):
        tokenizer = load_tokenizer(art.path)
        context, _ = context_limit(art, max_model_len, tokenizer)
    note = limit_fallback_note(art, max_model_len, tokenizer)
    if note:
        _warn(note)
    plan = allocation(spec, config.group_blocks(art, context=context), context, max_num_seqs,
                      max_num_batched_tokens)  # fmt: skip
    rows, groups, summary = plan["layers"], plan["groups"], plan["summary"]
    kernels = choose_kernels(spec)  # what ONNX Runtime's CPU provider runs each layer on
    plan["kernels"] = {"ort_cpu": kernels.kernels, "why": kernels.reason}
    plan["weights"] = _weights_summary(art)
    for r in rows:
        r["kernels"] = kernels.kernels
    blocks, total, bf16 = summary["num_blocks"], summary["total_bytes"], summary["bf16_total_bytes"]
    if as_json:
        print(json.dumps(plan, indent=2))
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
        "key transform",
        "kernels",
        "blocks",
        "bytes",
    ):
        t.add_column(col)
    for r in rows:
        recent = recent_label(r["recent_window"], r["sink_tokens"], r["recent_group"])
        t.add_row(
            str(r["index"]), r["attention_type"], str(r["window"] or "-"), r["kv_cache_dtype"],
            r["quant_mode"], str(r["group"]), str(r["bytes_per_token"]), recent,
            r["key_transform"] or "-", r["kernels"], str(r["blocks"]), fmt_bytes(r["bytes"]),
        )  # fmt: skip
    console.print(t)
    for g in groups:
        what = "full attention" if g["window"] is None else f"window {g['window']}"
        what = f"recent-window caches, {what}" if g["recent"] else what
        what += f", and the first {g['sink_tokens']} tokens" if g["sink_tokens"] else ""
        per_seq = g["max_blocks_per_seq"]
        holds = f"at most {per_seq} blocks" if per_seq else "all its blocks"
        console.print(
            f"group {g['id']} ({what}): layers {g['layers']}, {g['blocks']} usable blocks, "
            f"{fmt_bytes(g['bytes'])}; a sequence holds {holds}"
        )
    tokens = summary["full_attention_tokens"]
    console.print(
        f"total {fmt_bytes(total)}"
        + (f", {tokens} tokens in the full-attention caches" if tokens is not None else "")
        + f"; an all-bf16 cache of the same blocks: {fmt_bytes(bf16)} ({bf16 / total:.2f}x)"
    )
    if context is not None:
        bound = summary["bound_by"].replace("max_num_seqs", "--max-num-seqs")
        console.print(
            f"at {context} tokens per sequence: {summary['max_seqs_at_context']} sequences at "
            f"once ({bound} bounds them)"
        )
    console.print(printable(f"ONNX Runtime (CPU) runs the layers on {kernels.reason}"))
    w = plan["weights"]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in w["bytes"].items())
    where = "" if w["accuracy_level"] is None else (
        f"; ONNX Runtime runs the block-quantized ones at accuracy level {w['accuracy_level']}"
    )  # fmt: skip
    console.print(f"weights by precision: {parts}{where}")


def _weights_summary(art) -> dict:
    """The artifact's weight bytes by precision (read from its graph) and how ORT runs them."""
    import onnx

    from tqexport.weights.graph import weight_bytes

    graph = onnx.load(str(art.model_file), load_external_data=False)
    sizes = dict(sorted(weight_bytes(graph).items(), key=lambda kv: -kv[1]))
    w = art.spec.weights
    return {
        "bytes": sizes,
        "accuracy_level": None if w is None else w.accuracy_level,
        "default": None if w is None or w.default is None else w.default.to_dict(),
    }


@app.command(cls=Command)
def run(
    ctx: typer.Context,
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
    max_model_len: MemoryOptions[2] = _ENGINE.max_model_len,
    max_num_batched_tokens: EngineOptions[1] = _ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = _ENGINE.max_num_seqs,
    threads: EngineOptions[3] = _ENGINE.threads,
    chat_template: EngineOptions[4] = _ENGINE.chat_template,
    kernels: KernelsOption = _ENGINE.kernels,
    as_json: Annotated[bool, typer.Option("--json", help="Print results as JSON.")] = False,
):
    """Generate from an artifact: per-layer paged caches allocated from its spec.

    A prompt that cannot run (longer than the model's position limit, or than the whole
    cache) is rejected with a warning while the others complete; when every prompt is
    rejected, or any request fails while running (it alone; the others complete), the exit
    code is 1. Arguments and input files are checked before anything runs."""
    from tqexport.runtime.batch import run_batch
    from tqexport.runtime.engine import Engine
    from tqexport.runtime.sequence import SamplingParams

    if (prompt is None) == (prompts_file is None):
        raise TQExportError("give exactly one of --prompt and --prompts-file")
    if prompt is not None and not prompt.strip():
        raise TQExportError("--prompt is empty")
    validate.sampling(
        max_tokens, temperature, top_k, top_p, seed, cli=True, seed_max=validate.SEED_MAX
    )
    if temperature == 0:
        for name in ("top_k", "top_p", "seed"):
            if given(ctx, name):
                raise TQExportError(
                    f"--{name.replace('_', '-')} has no effect with --temperature 0 (greedy): "
                    "give a temperature > 0 to sample, or drop it"
                )
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template, kernels, max_model_len,
    )  # fmt: skip
    texts = [prompt] if prompt is not None else validate.prompts_file(prompts_file)
    engine = Engine.from_artifact(artifact, config)
    if engine.limit_note:
        _warn(engine.limit_note)
    engine.require_tokenizer()
    stream = prompt is not None and not as_json

    def on_output(out):
        if stream and out.text:
            print(printable(out.text, keep_newlines=True), end="", flush=True)

    params = SamplingParams(max_tokens, temperature, top_k, top_p, seed)
    batch = run_batch(engine, texts, params, on_output, warn=_warn)
    if stream:
        print(flush=True)
    results, rejected, summary = batch.results, batch.rejected, batch.summary
    if as_json:
        print(json.dumps({"results": results, "summary": summary}, indent=2))
    elif not stream:
        for i, r in enumerate(results):
            console.rule(f"request {i} ({r['finish_reason']})")
            console.print(printable(r["prompt"]), style="bold")
            console.print(printable(r["text"], keep_newlines=True))
    for i in sorted(rejected):
        _warn(f"request {i}: {rejected[i]}")
    for i in sorted(batch.failed):
        _warn(f"request {i}: {batch.failed[i]}")
    if not as_json:
        err.print(
            f"{summary['requests']} requests, {summary['generated_tokens']} tokens in "
            f"{summary['seconds']:.2f} s "
            f"({summary['tokens_per_second']} tokens/s, {backend}: {engine.executor.kernels}); "
            f"peak KV "
            f"{fmt_bytes(summary['peak_kv_bytes'])} (bf16: "
            f"{fmt_bytes(summary['peak_kv_bytes_bf16_equivalent'])})",
        )
    if batch.failed or (rejected and len(rejected) == len(results)):
        raise typer.Exit(1)


@app.command(cls=Command)
def serve(
    ctx: typer.Context,
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
            help="Require 'Authorization: Bearer KEY' on every route but /health (or set "
            "TQEXPORT_API_KEY).",
        ),
    ] = None,
    metrics_public: Annotated[
        bool,
        typer.Option(
            "--metrics-public",
            help="With --api-key: leave /metrics open (a Prometheus scraper without the key).",
        ),
    ] = False,
    backend: EngineOptions[0] = _ENGINE.backend,
    num_blocks: MemoryOptions[0] = _ENGINE.num_blocks,
    kv_cache_memory: MemoryOptions[1] = _ENGINE.kv_cache_memory,
    max_model_len: MemoryOptions[2] = _ENGINE.max_model_len,
    max_num_batched_tokens: EngineOptions[1] = _ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = _ENGINE.max_num_seqs,
    threads: EngineOptions[3] = _ENGINE.threads,
    chat_template: EngineOptions[4] = _ENGINE.chat_template,
    kernels: KernelsOption = _ENGINE.kernels,
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
    max_replicas_per_node: Annotated[
        int | None,
        typer.Option(help="With --ray: most replicas Ray places on one node (default: no limit)."),
    ] = None,
):
    """Serve an artifact over OpenAI's HTTP API: /v1/completions, /v1/chat/completions
    (streamed or whole), /v1/models, /health, /metrics; SIGTERM drains and exits 0."""
    import os

    if api_key is None and os.environ.get("TQEXPORT_API_KEY") == "":
        raise TQExportError("TQEXPORT_API_KEY is set but empty; give a key or unset it")
    validate.api_key(api_key)
    if metrics_public and api_key is None:
        raise TQExportError(
            "--metrics-public needs --api-key (or TQEXPORT_API_KEY): without a key every route "
            "is open already"
        )
    validate.integer(port, "--port", 0, 65535)
    validate.number(grace_seconds, "--grace-seconds", 0.0)
    validate.integer(replicas, "--replicas", 1, 1024)
    validate.number(replica_cpus, "--replica-cpus", 0.0)
    if max_replicas_per_node is not None:
        validate.integer(max_replicas_per_node, "--max-replicas-per-node", 1, 100)  # Ray's range
    for name in ("replicas", "ray_address", "replica_cpus", "max_replicas_per_node"):
        if given(ctx, name) and not ray:
            flag = "--" + name.replace("_", "-")
            raise TQExportError(
                f"{flag} needs --ray (it sets up Ray Serve); add --ray or drop {flag}"
            )
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template, kernels, max_model_len,
    )  # fmt: skip
    if ray:
        from tqexport.contract.artifact import open_artifact
        from tqexport.runtime.engine import limit_fallback_note
        from tqexport.serve.ray_serve import serve_on_ray

        note = limit_fallback_note(open_artifact(artifact), max_model_len)  # a bad artifact
        if note:  # fails here, not in every replica
            _warn(note)
        name = served_model_name or str(artifact)
        serve_on_ray(artifact, config, host, port, name, api_key, replicas, ray_address,
                     replica_cpus, grace_seconds, metrics_public,
                     max_replicas_per_node)  # fmt: skip
        return
    from tqexport.serve.runner import serve as run_server

    run_server(artifact, config, host, port, served_model_name, api_key, grace_seconds,
               metrics_public=metrics_public)  # fmt: skip


app.add_typer(bench_app, name="bench")


@app.command(cls=Command)
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
    console.print(printable(f"wrote {out} ({fmt_bytes(out.stat().st_size)})"))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors, usage errors included, become one line on stderr and
    exit code 2; ``--help`` and no arguments at all (the help) exit 0; parity's mismatch exits 1."""
    try:
        rv = app(args=argv, prog_name="tqexport", standalone_mode=False)
    except TQExportError as e:
        error_exit(str(e))
    except click_exceptions.ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # typer printed the help: as --help does
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        path = ctx.command_path if ctx is not None else "tqexport"
        error_exit(f"{e.format_message()} (see {path} --help)", 2 if e.exit_code == 2 else 1)
    except _ABORTS:
        error_exit("aborted", 1)
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


if __name__ == "__main__":
    main()
