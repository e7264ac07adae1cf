"""Prefill through the paged caches, as the engine serves it: a prompt's time to first token in
chunks of ``max_num_batched_tokens`` (chunked prefill, the cache writes and attention kernels of
the layer's own format), and how much a long prompt being admitted delays the tokens of the
sequences already decoding (each of their tokens waits for one whole step, chunk included)."""

from __future__ import annotations

import time

import numpy as np
import torch

from tqexport import validate
from tqexport.contract.artifact import Artifact
from tqexport.errors import TQExportError
from tqexport.runtime.executor import Executor
from tqexport.runtime.sequence import SamplingParams

#: the decoding streams, their prompt length, and the decode steps timed before the long prompt
#: (and again after its first token)
STREAMS, STREAM_PROMPT, QUIET_STEPS = 4, 16, 24
PROMPT_SEED = 0


def prompt_ids(spec, tokens: int) -> list[int]:
    """``tokens`` token ids drawn from the model's vocabulary (seeded: every format alike; what
    they say does not change a step's cost)."""
    vocab = int(spec.model.get("vocab_size") or 256)
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab, (tokens,), generator=g).tolist()


def _stream_tokens(tokens: int, chunk: int, threshold: int = 0) -> int:
    """Tokens a stream holds by the long prompt's first token: its prompt, one more each step
    while the streams' prompts are prefilled, the quiet steps before and after the long prompt,
    one more each step the long prompt takes (a chunk less the streams' own tokens, or the
    prefill threshold), and a margin."""
    room = max(1, chunk - STREAMS)
    warm = -(-(STREAMS * STREAM_PROMPT) // room) + STREAMS
    room = min(room, threshold or room)
    return STREAM_PROMPT + warm + 2 * QUIET_STEPS + -(-tokens // room) + 4


def _executor(art: Artifact, tokens: int, chunk: int, threads: int | None,
              threshold: int = 0) -> Executor:  # fmt: skip
    """An executor whose caches hold the long prompt and the decoding streams at once (so no
    sequence is ever preempted while timed); ``threshold``: its long-prefill token threshold."""
    bs = art.spec.block_size
    streams = STREAMS * -(-_stream_tokens(tokens, chunk, threshold) // bs)
    return Executor(art, "ort", num_blocks=1 + -(-(tokens + 1) // bs) + streams + STREAMS,
                    max_num_batched_tokens=chunk, max_num_seqs=STREAMS + 1,
                    long_prefill_token_threshold=threshold, threads=threads)  # fmt: skip


def time_to_first_token(art: Artifact, tokens: int, chunk: int, threads=None) -> float:
    """Seconds from admitting a ``tokens``-token prompt to its first token, alone in the engine."""
    ex = _executor(art, tokens, chunk, threads)
    ex.add_request(prompt_ids(art.spec, tokens), SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    while not ex.scheduler.idle:
        ex.step()
    return time.perf_counter() - t0


def decode_stall(art: Artifact, tokens: int, chunk: int, threads=None, threshold: int = 0) -> dict:
    """Step times (ms) of :data:`STREAMS` decoding sequences: ``quiet``, decoding alone; then
    ``admitting``, every step while a ``tokens``-token prompt is prefilled beside them, until its
    first token; then ``after``, alone again, at the longer contexts the streams reached
    meanwhile (a step's own cost grows with them). Each step time is the delay between two
    tokens of every stream; ``threshold``: the scheduler's long-prefill token threshold (0:
    whole chunks)."""
    ex = _executor(art, tokens, chunk, threads, threshold)
    max_tokens = _stream_tokens(tokens, chunk, threshold) - STREAM_PROMPT
    for i in range(STREAMS):
        ids = prompt_ids(art.spec, STREAM_PROMPT + i)[-STREAM_PROMPT:]
        ex.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_stop=True))
    streams = [*ex.scheduler.waiting]
    while any(s.num_cached < s.num_tokens - 1 for s in streams):
        ex.step()  # the streams' prompts, untimed

    def timed_step(into: list[float]):
        t0 = time.perf_counter()
        ex.step()
        into.append(1000 * (time.perf_counter() - t0))

    quiet, admitting, after = [], [], []
    for _ in range(QUIET_STEPS):
        timed_step(quiet)
    long = ex.add_request(prompt_ids(art.spec, tokens), SamplingParams(max_tokens=1))
    while not long.output:
        timed_step(admitting)
    for _ in range(QUIET_STEPS):
        timed_step(after)
    if ex.scheduler.num_preemptions or any(s.finish_reason for s in streams):
        raise TQExportError("a decoding stream was preempted or ended while timed")
    return {"quiet_ms": quiet, "admitting_ms": admitting, "after_ms": after}


def p99(values: list[float]) -> float:
    """The 99th percentile (linear interpolation; with few values, close to the largest)."""
    return float(np.percentile(values, 99))


def measure_prefill(
    arts: dict[str, Artifact],
    contexts: list[int],
    stall_tokens: int,
    chunk: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
    threads=None,
    progress=lambda what: None,
    threshold: int = validate.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
) -> dict:
    """Per context, every format's time to first token and prefill tokens/s; per format, the
    streams' inter-token p99 with and without a ``stall_tokens`` prompt being admitted (under
    the long-prefill token ``threshold``), and that prompt's time to its first token there.
    ``ratio`` compares the admitting steps with the quiet ones after them, at the contexts the
    streams ended at (the slowest admitting steps are the last); ``ratio_to_start`` with those
    before, at the contexts they started from."""
    from tqexport.bench.speed import load_average

    rows = []
    for c in contexts:
        progress(f"prefill {c} tokens")
        before = load_average()
        secs = {n: time_to_first_token(a, c, chunk, threads) for n, a in arts.items()}
        rows.append({"context": c, "seconds": secs,
                     "tokens_per_second": {n: c / s for n, s in secs.items()},
                     "loadavg": {"before": before, "after": load_average()}})  # fmt: skip
    stall = {}
    for n, a in arts.items():
        progress(f"decode beside a {stall_tokens}-token prompt: {n}")
        steps = decode_stall(a, stall_tokens, chunk, threads, threshold)
        quiet, admitting, after = (p99(steps[f"{k}_ms"]) for k in ("quiet", "admitting", "after"))
        stall[n] = {
            **steps,
            "quiet_p99_ms": quiet,
            "admitting_p99_ms": admitting,
            "after_p99_ms": after,
            "ratio": admitting / after,
            "ratio_to_start": admitting / quiet,
            "long_prompt_seconds": sum(steps["admitting_ms"]) / 1000,
        }
    return {"chunk": chunk, "streams": STREAMS, "stall_tokens": stall_tokens,
            "long_prefill_token_threshold": threshold, "prefill": rows,
            "stall": stall}  # fmt: skip
