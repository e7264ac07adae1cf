"""``tqexport bench speed``: decode speed on ONNX Runtime CPU per kv dtype, and KV memory.

Per configuration, B sequences with C tokens already cached (contiguous block tables; the cache
bytes are zeros, decode cost does not depend on their values) take N single-token decode steps;
the fastest step after a warm-up one counts. The kv dtypes of one (context, batch) point run
interleaved, step by step, in one process, so a loaded machine slows them alike and the ratios
hold. Reported: ms per step, tokens/s and the ratio to ``auto`` measured in the same run, KV
bytes per token, and the tokens a fixed KV budget holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tqexport.contract.artifact import Artifact, open_artifact
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.runtime.backends.ort import OrtBackend
from tqexport.runtime.config import DEFAULT_KV_CACHE_MEMORY
from tqexport.runtime.memory import parse_memory, resolve_num_blocks


def artifact_for(model: str, kv_cache_dtype: str, workdir: Path, recent_window: int = 0):
    """The artifact of MODEL at this kv dtype (and recent window), built into ``workdir`` once
    and then reused."""
    from tqexport.export.artifact import BuildOptions, build_artifact

    suffix = f"-recent{recent_window}" if recent_window else ""
    out = workdir / f"{Path(model).name}-{kv_cache_dtype}{suffix}"
    if not (out / "tqexport.json").is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        opts = BuildOptions(kv_cache_dtype=kv_cache_dtype, recent_window=recent_window)
        build_artifact(model, out, opts)
    return open_artifact(out)


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
    ms = decode_ms_interleaved({"x": art}, context, batch, steps, threads, extra_blocks, options)
    return ms["x"]


def decode_ms_interleaved(
    arts: dict[str, Artifact],
    context: int,
    batch: int | dict[str, int],
    steps: int,
    threads=None,
    extra_blocks: int = 0,
    options: dict | None = None,
    step_options: dict | None = None,
) -> dict[str, float]:
    """:func:`decode_ms` of several artifacts (or one artifact under several ``step_options``
    labels: label -> session option overrides; ``batch`` may be label -> batch) with their
    steps interleaved: a warm-up step each, then step s of every artifact before step s + 1 of
    any."""
    backends, tables = {}, {}
    for label, art in arts.items():
        b = batch[label] if isinstance(batch, dict) else batch
        spec = art.spec
        per_seq = -(-(context + steps) // spec.block_size)
        opts = {**(options or {}), **((step_options or {}).get(label) or {})}
        backends[label] = OrtBackend(art, 1 + b * per_seq + extra_blocks, threads,
                                     options=opts)  # fmt: skip
        tables[label] = [
            [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))] * len(spec.groups)
            for i in range(b)
        ]
    times = {label: [] for label in arts}
    for s in range(steps + 1):
        for label, backend in backends.items():
            spec = arts[label].spec
            step = build_step(spec, [SeqChunk([7], context + s, t) for t in tables[label]])
            t0 = time.perf_counter()
            backend.run(step)
            times[label].append(time.perf_counter() - t0)
    return {label: 1000 * min(t[1:]) for label, t in times.items()}


def measure(
    arts: dict[str, Artifact],
    contexts: list[int],
    batches: list[int],
    steps: int = 4,
    budget: str = DEFAULT_KV_CACHE_MEMORY,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda what: None,
) -> dict:
    """Decode timings per (context, batch) for every artifact (``auto`` first), and memory."""
    rows = []
    for c in contexts:
        for b in batches:
            progress(f"context {c} batch {b}: {', '.join(arts)}")
            ms = decode_ms_interleaved(arts, c, b, steps, threads)
            rows.append({
                "context": c, "batch": b,
                "ms_per_step": ms,
                "tokens_per_second": {n: 1000 * b / v for n, v in ms.items()},
                "speed_vs_auto": {n: ms["auto"] / v for n, v in ms.items()},
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
    return {"threads": threads, "steps": steps, "budget": budget, "decode": rows,
            "memory": memory}  # fmt: skip
