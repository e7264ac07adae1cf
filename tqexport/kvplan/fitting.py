"""What a build fits on calibration text with the float model, before export: fp8/nvfp4
per-layer scales (vLLM's rule) and the exact key transforms of tqx_* caches; and the default
text, held out from what ``bench quality`` scores."""

from __future__ import annotations

import hashlib
import weakref

import torch

from tqexport.kvplan.resolve import resolve
from tqexport.kvquant import transforms
from tqexport.models.loader import LoadedModel
from tqexport.spec import BuildRequest, ModelSpec

#: vLLM's calculate_kv_scales: k_scale = max|k| / 200, v_scale = max|v| / 100.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


def held_out_calibration_text(min_chars: int = 24000) -> str:
    """The default calibration text (scales, key transforms, ``calibrate``): pydoc topics from
    the END of the sorted keys (at least ``min_chars``), so it shares nothing with the start of
    the evaluation text that ``bench quality`` scores."""
    from pydoc_data.topics import topics

    picked: list[str] = []
    for key in reversed(sorted(topics)):
        picked.insert(0, topics[key])
        if sum(map(len, picked)) >= min_chars:
            break
    return "\n\n".join(picked)


def calibration_tokens(lm: LoadedModel, spec: ModelSpec, text: str, max_tokens: int) -> list[int]:
    """``text``'s first ``max_tokens`` token ids (bytes for a tiny model without a tokenizer)."""
    if lm.tokenizer is not None:
        return lm.tokenizer(text)["input_ids"][:max_tokens]
    vocab = int(spec.model.get("vocab_size") or 256)
    return [b % vocab for b in text.encode()[:max_tokens]]


def prefill_observed(lm: LoadedModel, spec: ModelSpec, tokens: list[int], **observers) -> None:
    """One functional prefill of ``tokens`` from an empty cache, for the observers' sake."""
    from tqexport.contract.caches import allocate_caches
    from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
    from tqexport.models.paged import PagedCausalLM

    blocks = -(-len(tokens) // spec.block_size)
    caches = allocate_caches(spec, blocks + 1)
    tables = [list(range(1, blocks + 1)) for _ in spec.groups]
    step = build_step(spec, [SeqChunk(tokens, 0, tables, "last")])
    module = PagedCausalLM(lm.model, spec, mode="functional", **observers)
    with torch.no_grad():
        module(*ordered_inputs(spec, step, caches))


#: per model (weakly held: a freed model's id may be reused), per (text, tokens, window)
_KEY_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def key_statistics(
    lm: LoadedModel, text: str, max_tokens: int = 4096, window: int = 2048
) -> dict[int, transforms.KeyStats]:
    """Per-layer key/query statistics of the UNQUANTIZED model over ``text`` (prefills of
    ``window`` tokens from an empty cache), so they depend on the model and text alone; kept
    for the process (a bench scores several transforms of one model)."""
    key = (hashlib.sha256(text.encode()).hexdigest(), max_tokens, window)
    cached = _KEY_STATS.setdefault(lm.model, {})
    if key not in cached:
        plain = resolve(lm.description, BuildRequest()).spec
        tokens = calibration_tokens(lm, plain, text, max_tokens)
        stats: dict[int, transforms.KeyStats] = {}

        def observe(layer, q, k, positions):
            stats.setdefault(layer.index, transforms.KeyStats()).add(q, k, positions)

        for at in range(0, len(tokens), window):
            prefill_observed(lm, plain, tokens[at : at + window], key_observer=observe)
        cached[key] = stats
    return cached[key]


def calibrate_key_transforms(
    lm: LoadedModel, text: str, kinds: tuple[str, ...]
) -> dict[int, transforms.KeyTransform]:
    """Every layer's fitted key transform (``signs`` alone needs no text); resolve attaches
    them to the layers it quantizes."""
    stats = key_statistics(lm, text) if transforms.needs_text(kinds) else {}
    return {
        la.index: transforms.fit(
            kinds,
            stats.get(la.index),
            la.index,
            num_kv_heads=la.num_kv_heads,
            head_size=la.head_size,
        )
        for la in lm.description.layers
    }


def calibrate_scales(lm: LoadedModel, spec: ModelSpec, text: str, max_tokens: int = 512):
    """Per-layer (k_scale, v_scale) from one prefill of ``text``, vLLM's rule (max|x| / range),
    each rounded to a float32: the value a node attribute (and so a plugin) carries exactly."""
    amax: dict[int, list[float]] = {}

    def observe(layer, k, v):
        amax[layer.index] = [float(k.abs().max()), float(v.abs().max())]

    prefill_observed(lm, spec, calibration_tokens(lm, spec, text, max_tokens), observer=observe)

    def f32(x: float) -> float:
        return float(torch.tensor(max(x, 1e-8), dtype=torch.float32))

    return {i: (f32(k / K_SCALE_RANGE), f32(v / V_SCALE_RANGE)) for i, (k, v) in amax.items()}
