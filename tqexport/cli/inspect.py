"""``tqexport inspect``: an artifact's cache allocation, kernels and weights, as tables or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tqexport.cli.common import ENGINE, VllmArgsOption, print_vllm_command
from tqexport.console import console, fmt_bytes, warn
from tqexport.errors import TQExportError
from tqexport.options import (
    MemoryOptions,
    given,
)
from tqexport.runtime.config import EngineConfig
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
        print_vllm_command(spec, spec.model.get("path", spec.model["name"]))
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
        warn(note)
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
