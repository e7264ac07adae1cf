"""The ``vllm serve`` flags that give a spec's per-layer caches, or why no flags can.

vLLM (checked against 0.33.0's ``CacheConfig`` and ``Attention``) has one global
``--kv-cache-dtype`` and ``--kv-cache-dtype-skip-layers`` (layer indices, or ``sliding_window``
for every sliding-window layer), which keeps the listed layers at ``auto``; for ``turboquant_*``
it always adds the first and last ``min(2, L // 2)`` layers of a dense model to that list. Its
slot bytes are tqexport's (``make vllm-parity``), so equal flags mean equal caches.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import TURBOQUANT_BOUNDARY_LAYERS, turboquant_boundary
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.spec import AttentionType, ModelSpec

#: what vLLM calls every sliding-window layer in ``--kv-cache-dtype-skip-layers``
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class VllmArgs:
    """The flags (``args``), or the reasons vLLM cannot express the spec (``unsupported``)."""

    args: tuple[str, ...]
    unsupported: tuple[str, ...]

    def command(self, model: str) -> str:
        return shlex.join(["vllm", "serve", model, *self.args])


def vllm_args(spec: ModelSpec) -> VllmArgs:
    """The ``vllm serve`` cache flags giving every layer of ``spec`` the same cache."""
    layers = spec.layers
    why: list[str] = []
    if any(la.recent is not None for la in layers):
        why.append("a recent window (--kv-recent-window): vLLM keeps no full-precision window")
    quantized = sorted({la.kv_cache_dtype for la in layers if la.kv_cache_dtype != "auto"})
    for name in quantized:
        if parse_kv_cache_dtype(name).native:
            why.append(f"{name} is a tqexport-native preset; vLLM has no such --kv-cache-dtype")
    if len(quantized) > 1:
        why.append(f"layers use {', '.join(quantized)}; vLLM has one --kv-cache-dtype")
    if any((la.cache.k_scale, la.cache.v_scale) != (1.0, 1.0) for la in layers):
        why.append(
            "calibrated k/v scales: vLLM reads them from the checkpoint (or computes them with "
            "--calculate-kv-scales), not from flags"
        )
    dtype = quantized[0] if len(quantized) == 1 else "auto"
    args = ["--dtype", spec.dtype, "--kv-cache-dtype", dtype, "--block-size", str(spec.block_size)]
    kept = {la.index for la in layers if la.kv_cache_dtype == "auto"}
    entry = parse_kv_cache_dtype(dtype)
    if entry.is_turboquant and not entry.native:
        forced = turboquant_boundary(len(layers), TURBOQUANT_BOUNDARY_LAYERS, vllm=True)
        if forced - kept:
            hit = sorted(forced - kept)
            shown = ", ".join(map(str, hit))
            shown = f"layers {shown} are" if len(hit) > 1 else f"layer {shown} is"
            why.append(
                f"{shown} quantized, but vLLM always keeps {dtype}'s boundary "
                f"layers (the first and last {len(forced) // 2}) at auto"
            )
    if dtype != "auto" and kept:
        sliding = {la.index for la in layers if la.attention_type is AttentionType.SLIDING_WINDOW}
        skip = sorted(kept)
        if sliding and sliding <= kept:
            skip = [SLIDING_WINDOW, *sorted(kept - sliding)]
        args += ["--kv-cache-dtype-skip-layers", *map(str, skip)]
    return VllmArgs(tuple(args), tuple(why))


def check_no_sizing(given: list[str]) -> None:
    """``inspect --vllm-args`` prints only vLLM's cache flags: an option sizing the cache
    (``given``: field names of the options given) would have no effect."""
    sizing = [n for n in ("num_blocks", "kv_cache_memory", "max_model_len", "max_num_seqs",
                          "max_num_batched_tokens") if n in given]  # fmt: skip
    if sizing:
        flag = "--" + sizing[0].replace("_", "-")
        raise TQExportError(f"{flag} sizes the cache inspect shows; --vllm-args prints only "
                            "the vLLM cache flags: drop one of them")  # fmt: skip
