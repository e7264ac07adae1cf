"""``tqexport run``: generate from an artifact, streamed or as one batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tqexport import validate
from tqexport.cli.common import ENGINE, given_names
from tqexport.console import console, err, fmt_bytes, warn
from tqexport.options import EngineOptions, KernelsOption, MemoryOptions
from tqexport.runtime.engine_config import EngineConfig
from tqexport.validate import printable


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
    backend: EngineOptions[0] = ENGINE.backend,
    num_blocks: MemoryOptions[0] = ENGINE.num_blocks,
    kv_cache_memory: MemoryOptions[1] = ENGINE.kv_cache_memory,
    max_model_len: MemoryOptions[2] = ENGINE.max_model_len,
    max_num_batched_tokens: EngineOptions[1] = ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = ENGINE.max_num_seqs,
    threads: EngineOptions[3] = ENGINE.threads,
    chat_template: EngineOptions[4] = ENGINE.chat_template,
    long_prefill_token_threshold: EngineOptions[5] = ENGINE.long_prefill_token_threshold,
    kernels: KernelsOption = ENGINE.kernels,
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

    validate.prompt_source(prompt, prompts_file)
    validate.sampling(
        max_tokens, temperature, top_k, top_p, seed, cli=True, seed_max=validate.SEED_MAX
    )
    validate.greedy(temperature, given_names(ctx))
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template, kernels, max_model_len, long_prefill_token_threshold,
    )  # fmt: skip
    texts = [prompt] if prompt is not None else validate.prompts_file(prompts_file)
    engine = Engine.from_artifact(artifact, config)
    if engine.limit_note:
        warn(engine.limit_note)
    engine.require_tokenizer()
    stream = prompt is not None and not as_json

    def on_output(out):
        if stream and out.text:
            print(printable(out.text, keep_newlines=True), end="", flush=True)

    params = SamplingParams(max_tokens, temperature, top_k, top_p, seed)
    batch = run_batch(engine, texts, params, on_output, warn=warn)
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
        warn(f"request {i}: {rejected[i]}")
    for i in sorted(batch.failed):
        warn(f"request {i}: {batch.failed[i]}")
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
