"""``tqexport plan``: a model's per-layer cache plan and weight bytes, from its config alone."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from tqexport.cli.common import VllmArgsOption, build_request, one_output, print_vllm_command
from tqexport.console import console, fmt_bytes, warn
from tqexport.options import (
    BlockSizeOption,
    BoundaryOption,
    CalibrationOption,
    KeyTransformOption,
    KvBitsOption,
    KvDtypeOption,
    KvLayersOption,
    RecentWindowOption,
    SinkTokensOption,
    SkipOption,
    WeightsOption,
)
from tqexport.spec import BuildRequest
from tqexport.spec.request import DEFAULT_WEIGHTS
from tqexport.validate import DEFAULT_BLOCK_SIZE, printable


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
    from tqexport.kvplan.resolve import resolve
    from tqexport.models.config import describe_model
    from tqexport.spec import recent_label
    from tqexport.spec.kv_layers import covered, parse_kv_layers

    one_output(as_json, vllm_args)
    request = build_request(ctx, model, dtype=dtype, weights=weights)
    kv_layers, kinds = request.kv_layers, request.key_transform
    desc = describe_model(model, dtype)
    res = resolve(desc, request)
    for w in res.warnings:
        warn(w)
    spec = res.spec
    own = covered(parse_kv_layers(kv_layers), len(spec.layers)) if kv_layers else {}
    planned = _planned_weights(model, request) if not vllm_args else None
    if as_json:
        print(json.dumps({**spec.plan_dict(), "weights_bytes": planned}, indent=2))
        return
    if vllm_args:
        print_vllm_command(spec, model)
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
