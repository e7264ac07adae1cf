"""``tqexport inspect``: an artifact's cache allocation, kernels and weights, as tables or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport.cli.common import ENGINE, VllmArgsOption, given_names, one_output, print_vllm_command
from tqexport.console import console, fmt_bytes, warn
from tqexport.options import MemoryOptions, given
from tqexport.runtime.engine_config import EngineConfig
from tqexport.validate import printable


def inspect(
    ctx: typer.Context,
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    num_blocks: MemoryOptions[0] = None,
    kv_cache_memory: MemoryOptions[1] = None,
    max_model_len: MemoryOptions[2] = None,
    max_num_seqs: Annotated[
        int,
        typer.Option(help="Sequences per step (sizes the windowed caches, bounds the batch)."),
    ] = ENGINE.max_num_seqs,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget per step (sizes the recent-window caches).")
    ] = ENGINE.max_num_batched_tokens,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    vllm_args: VllmArgsOption = False,
):
    """Per-layer and per-group cache allocation of an artifact, totals vs an all-bf16 cache, and
    how many sequences of the longest length served fit at once."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.native.kernel_choice import choose as choose_kernels
    from tqexport.runtime.context import served_context
    from tqexport.runtime.memory import allocation, check_batched_tokens
    from tqexport.spec import recent_label
    from tqexport.vllm_bridge import check_no_sizing
    from tqexport.weights.graph import weights_summary

    config = EngineConfig(
        num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
    )  # fmt: skip
    one_output(as_json, vllm_args)
    art = open_artifact(artifact)
    spec = art.spec
    if vllm_args:
        check_no_sizing(given_names(ctx))
        print_vllm_command(spec, spec.model.get("path", spec.model["name"]))
        return
    check_batched_tokens(spec, artifact, given(ctx, "max_num_batched_tokens"))
    context, note = served_context(art, max_model_len)
    if note:
        warn(note)
    plan = allocation(spec, config.group_blocks(art, context=context), context, max_num_seqs,
                      max_num_batched_tokens)  # fmt: skip
    rows, groups, summary = plan["layers"], plan["groups"], plan["summary"]
    kernels = choose_kernels(spec)  # what ONNX Runtime's CPU provider runs each layer on
    plan["kernels"] = {"ort_cpu": kernels.kernels, "why": kernels.reason}
    plan["weights"] = weights_summary(art.model_file, spec.weights)
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
