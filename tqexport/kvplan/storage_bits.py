"""Bits per stored K or V element, all in, exactly: what ``bench quality`` reports and what
``--kv-bits`` budgets (one count for both, from the spec's own bytes per token)."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqexport.spec import ModelSpec

#: context over which a recent window's fixed per-sequence bytes are amortized
AMORTIZE_CONTEXT = 4096


def bits_per_element(spec: ModelSpec, model_bits: int | None = None) -> float:
    """KV bits per stored K or V element, all in: every layer's bytes (skipped ones included),
    plus the recent window's (and sink tokens') bytes, amortized over a 4096-token context; a
    sliding-window layer's bytes too (it holds only its window of each sequence).

    ``model_bits`` counts unquantized storage (``auto`` layers, recent windows) at that width
    instead of the spec's model dtype (the runs here are fp32; a deployment keeps them in 16).
    """
    bits = sum(layer_bits(spec, la, model_bits) for la in spec.layers)
    elems = sum(2 * la.cache.num_kv_heads * la.cache.head_size for la in spec.layers)
    return float(bits / elems)


def layer_bits(spec: ModelSpec, la, model_bits: int | None = None) -> Fraction:
    """Bits per token one layer stores, exactly, as :func:`bits_per_element` counts them."""
    n = 2 * la.cache.num_kv_heads * la.cache.head_size
    bits = Fraction(0)
    for b in la.bindings:
        plain = model_bits is not None and b.cache.kv_cache_dtype == "auto"
        per_token = Fraction(n * model_bits if plain else 8 * b.cache.bytes_per_token)
        group = spec.groups[b.group]
        if group.window is not None:
            # a recent window or a sliding layer: holds only its window (and sink tokens) of
            # each sequence
            held = min(group.window + group.sink_tokens, AMORTIZE_CONTEXT)
            per_token = per_token * held / AMORTIZE_CONTEXT
        bits += per_token
    return bits


def held_share(layers) -> Fraction:
    """The share of a full-length cache's K/V elements that ``layers`` (each with
    ``num_kv_heads``, ``head_size`` and ``window``) hold at a 4096-token context: sliding layers
    keep only their window. A peer's nominal bits per element scale by it, as ours do."""
    full = held = 0
    for la in layers:
        n = la.num_kv_heads * la.head_size
        full += n
        held += Fraction(n * min(la.window or AMORTIZE_CONTEXT, AMORTIZE_CONTEXT), AMORTIZE_CONTEXT)
    return held / full
