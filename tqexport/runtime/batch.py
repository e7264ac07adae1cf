"""A batch of text prompts through the engine in one continuous batch (``tqexport run``):
each prompt's request, the ones that cannot run set aside with why, results and a summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tqexport.errors import TQExportError
from tqexport.runtime.engine import Engine, RequestOutput
from tqexport.runtime.executor import limit_words
from tqexport.runtime.sequence import SamplingParams


@dataclass
class BatchRun:
    results: list[dict]
    #: prompt index -> why it did not run
    rejected: dict[int, str]
    summary: dict
    #: prompt index -> why it failed while running (it alone; the others completed)
    failed: dict[int, str]


def run_batch(
    engine: Engine,
    texts: list[str],
    params: SamplingParams,
    on_output: Callable[[RequestOutput], None] | None = None,
    warn: Callable[[str], None] = lambda message: None,
) -> BatchRun:
    """Generate for every prompt (prompt ``i`` samples with ``params.seed + i``). A prompt
    whose ``max_tokens`` would overrun the position limit or the cache generates what fits
    (``warn`` says so); one that cannot run at all is rejected while the others complete, and
    one that fails while running ends alone."""
    ids = [engine.encode(t, label=f"prompt {i}") for i, t in enumerate(texts)]
    rids, rejected = {}, {}
    for i, x in enumerate(ids):
        n, limit = params.max_tokens, engine.max_seq_len
        room = engine.max_new_tokens(len(x))
        if room is not None and 0 < room < n:
            n = room
            what = (
                f"{limit_words(engine.limit_name)} is {limit} tokens"
                if limit == engine.max_model_len
                else f"the KV cache holds {limit} tokens"
            )
            warn(f"request {i}: at most {n} tokens generated, {what} and the prompt has {len(x)}")
        mine = SamplingParams(n, params.temperature, params.top_k, params.top_p, params.seed + i)
        try:
            rids[i] = engine.add_request(x, mine)
        except TQExportError as e:
            rejected[i] = f"rejected: {e}"
    start = time.perf_counter()
    done = engine.drain(on_output)
    wall = time.perf_counter() - start
    results, failed = [], {}
    for i, text in enumerate(texts):
        c = done.get(rids.get(i))
        if c is not None and c.error is not None:
            why = str(c.error).strip().splitlines()
            failed[i] = f"error: {why[0] if why else type(c.error).__name__}"
        results.append(
            {
                "prompt": text,
                "prompt_token_ids": ids[i],
                "token_ids": c.token_ids if c else [],
                "text": c.text if c else "",
                "finish_reason": failed.get(i) or (c.finish_reason if c else rejected[i]),
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
        "backend": engine.config.backend,
    }
    return BatchRun(results, rejected, summary, failed)
