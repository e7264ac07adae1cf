"""The peer: llama.cpp (through llama-cpp-python, the optional ``peers`` extra) on the same GGUF.

It is fed the SAME token ids as our runs (tokenized once by the model's HF tokenizer; llama.cpp's
own tokenizer splits the text slightly differently), scores each chunk from an empty cache with
every position's logits, flash attention on (llama.cpp needs it for a quantized V cache), and is
compared with its own f16-cache baseline: the two tools' baselines differ in arithmetic (llama.cpp
runs the Q4_1 weights with quantized activations, we run them dequantized to fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tqexport.errors import TQExportError
from tqexport.metrics import Totals

#: llama.cpp KV cache types and their bits per element (block of 32: fp16 scale + data).
KV_TYPES = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}
BASELINE = "f16"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind MODEL (a built-in with real weights, a .gguf path), or None."""
    from tqexport.models.builtins import GGUF_BUILTINS, builtin_gguf

    if model in GGUF_BUILTINS:
        return builtin_gguf(model)
    path = Path(model)
    return path if path.suffix == ".gguf" and path.is_file() else None


#: tokens per llama.cpp decode call: its own micro-batch (n_ubatch) is 512 already, and its
#: logits buffer holds this many rows beside llama-cpp-python's n_ctx rows of scores
BATCH_TOKENS = 512


def _llama(path: Path, kv_type: str, chunk: int, threads: int):
    import llama_cpp

    ggml = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}")
    return llama_cpp.Llama(
        str(path),
        n_ctx=chunk,
        n_batch=min(chunk, BATCH_TOKENS),
        logits_all=True,
        flash_attn=True,
        type_k=ggml,
        type_v=ggml,
        n_threads=threads,
        verbose=False,
    )


def _logits(llm, ids: list[int]) -> np.ndarray:
    """Every position's logits of IDS scored from an empty cache (a view of llm's scores)."""
    llm.reset()
    llm.eval(ids)
    return llm.scores[: len(ids)]


def evaluate(
    path: Path,
    chunks: list[list[int]],
    kv_types=tuple(KV_TYPES),
    threads: int | None = None,
    held_share: float = 1.0,
) -> dict:
    """Perplexity per llama.cpp KV type; KL and top-1 against llama.cpp's own f16 run. Bits per
    element are the type's, times ``held_share`` (llama.cpp's sliding layers keep only their
    window, as ours: :func:`tqexport.kvplan.storage_bits.held_share`)."""
    if not available():
        raise TQExportError(
            "the llama.cpp peer needs llama-cpp-python: pip install -e '.[peers]' "
            "(compiles llama.cpp, about 9 minutes on 2 cores)"
        )
    import llama_cpp

    threads = threads or os.cpu_count() or 1
    chunk = len(chunks[0])
    types = tuple(dict.fromkeys((BASELINE, *kv_types)))
    totals = {t: Totals() for t in types}
    # One context at a time, each dropped once scored: a context holds n_ctx x vocab scores
    # (1 GiB for Gemma 3 at 1024 tokens); the baseline's logits are copied out first.
    for ids in chunks:
        ref = None
        for t in types:
            llm = _llama(path, t, chunk, threads)
            logits = _logits(llm, ids)
            ref = logits.copy() if ref is None else ref
            totals[t].add(logits, ids, ref)
            llm.close()
    return {
        "tool": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "gguf": path.name,
        "runs": [
            {
                "label": t,
                "kv_type": t,
                "bits_per_element": KV_TYPES[t] * held_share,
                **totals[t].summary(),
            }
            for t in types
        ],  # fmt: skip
    }
