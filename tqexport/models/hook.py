"""The attention hook: transformers' attention registry routes every layer's attention here.

The hook writes the step's K/V into the layer's own paged cache, then attends by reading it.
It is strict: window, scale and softcap come from the layer's spec and must agree with what
the model passes; an unknown non-empty argument (e.g. attention sinks) is an error; every
planned layer must be hit exactly once per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import transformers

from tqexport.errors import TQExportError
from tqexport.ops import reference
from tqexport.ops.attributes import CACHE_WRITE, DOMAIN, PAGED_ATTENTION, node_attrs
from tqexport.ops.library import codec_for
from tqexport.spec import LayerSpec, ModelSpec

ATTENTION_NAME = "tqexport"
# Arguments transformers passes that carry no attention semantics (or that we check).
_IGNORED = {
    "position_ids",
    "cache_position",
    "use_cache",
    "past_key_values",
    "past_key_value",
    "output_attentions",
    "tq_step",
    "is_causal",
}


class UnsupportedModelError(TQExportError):
    """The model asks attention for something tqexport does not implement."""


@dataclass
class StepInputs:
    """One step's tensors (as :func:`tqexport.contract.steps.build_step` makes them); per-group
    tensors are indexed by group id."""

    positions: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mappings: list[torch.Tensor]
    block_tables: list[torch.Tensor]


@dataclass
class StepContext:
    """What the hook needs for one forward: spec, step inputs, each layer's cache tensors.

    ``mode``: "inplace" (torch custom ops mutate ``caches``), "functional" (reference ops,
    new caches collected in ``new_caches``) or "export" (custom ONNX nodes).
    """

    spec: ModelSpec
    num_heads: int
    step: StepInputs
    caches: dict[int, list[torch.Tensor]]
    mode: str = "inplace"
    observer: object | None = None  # called as observer(layer, k, v) before each write
    new_caches: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    hits: dict[int, int] = field(default_factory=dict)

    def layer(self, index: int) -> LayerSpec:
        try:
            return self.spec.layer(index)
        except KeyError:
            raise UnsupportedModelError(f"attention layer {index} is not in the plan") from None

    def check_all_hit(self) -> None:
        planned = {la.index for la in self.spec.layers}
        wrong = {i: self.hits.get(i, 0) for i in planned if self.hits.get(i, 0) != 1}
        extra = set(self.hits) - planned
        if wrong or extra:
            raise UnsupportedModelError(
                f"attention hook hits per layer were {wrong or extra} instead of once each; "
                "the model's attention does not go through the planned layers"
            )


def _check_arguments(layer: LayerSpec, module, kwargs) -> None:
    where = f"layer {layer.index}"
    scaling = kwargs.get("scaling")
    if scaling is not None and not math.isclose(scaling, layer.scale, rel_tol=1e-6):
        raise UnsupportedModelError(f"{where}: model scale {scaling} != planned {layer.scale}")
    window = kwargs.get("sliding_window")
    if window is not None and window != layer.window:
        raise UnsupportedModelError(f"{where}: model window {window} != planned {layer.window}")
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap != layer.softcap:
        raise UnsupportedModelError(f"{where}: model softcap {softcap} != planned {layer.softcap}")
    if kwargs.get("dropout", 0.0):
        raise UnsupportedModelError(f"{where}: attention dropout is on; call model.eval()")
    for name, value in kwargs.items():
        if name in _IGNORED or name in ("scaling", "sliding_window", "softcap", "dropout"):
            continue
        if value is None or value is False:
            continue
        raise UnsupportedModelError(
            f"{where}: the model passes attention argument {name!r}, which tqexport does not "
            "implement (e.g. attention sinks); this model is not supported"
        )


def tqexport_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: [1, H, T, D] query, [1, KVH, T, D] key/value."""
    ctx: StepContext | None = kwargs.get("tq_step")
    if ctx is None:
        raise UnsupportedModelError("the tqexport attention needs a step context (tq_step=...)")
    layer = ctx.layer(module.layer_idx)
    _check_arguments(layer, module, kwargs)
    ctx.hits[layer.index] = ctx.hits.get(layer.index, 0) + 1
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    step = ctx.step
    slot_mapping = step.slot_mappings[layer.group]
    block_tables = step.block_tables[layer.group]
    n_own = len(layer.cache.tensors)
    cache, recent = ctx.caches[layer.index][:n_own], ctx.caches[layer.index][n_own:]
    r = layer.recent
    recent_slots = step.slot_mappings[layer.recent_group] if r else None
    recent_tables = step.block_tables[layer.recent_group] if r else None
    c = layer.cache
    if ctx.observer is not None:
        ctx.observer(layer, k, v)
    if ctx.mode == "export":
        out, new_cache = _emit_nodes(
            ctx, layer, q, k, v, cache, slot_mapping, block_tables, recent, recent_slots,
            recent_tables,
        )  # fmt: skip
        ctx.new_caches[layer.index] = new_cache
    elif ctx.mode == "inplace":
        scales = (c.kv_cache_dtype, c.model_dtype, c.k_scale, c.v_scale)
        torch.ops.tqexport.cache_write(cache, k, v, slot_mapping, *scales)
        if r:
            torch.ops.tqexport.cache_write(
                recent, k, v, recent_slots, "auto", r.model_dtype, 1.0, 1.0
            )
        out = torch.ops.tqexport.paged_attention(
            q, cache, block_tables, step.seq_lens, step.query_start_loc, step.positions,
            *scales, layer.scale, layer.softcap or 0.0, layer.window or 0,
            recent, recent_tables, layer.recent_window,
        )  # fmt: skip
    else:
        codec = codec_for(c.kv_cache_dtype, c.head_size, c.model_dtype, c.k_scale, c.v_scale)
        new_cache = reference.write_cache(codec, cache, k, v, slot_mapping)
        if r:
            plain = codec_for("auto", r.head_size, r.model_dtype, 1.0, 1.0)
            recent = reference.write_cache(plain, recent, k, v, recent_slots)
        ctx.new_caches[layer.index] = new_cache + recent
        out = reference.paged_attention(
            codec,
            q,
            new_cache,
            block_tables,
            step.seq_lens,
            step.query_start_loc,
            step.positions,
            scale=layer.scale,
            softcap=layer.softcap,
            window=layer.window,
            recent_cache=recent or None,
            recent_block_tables=recent_tables,
            recent_window=layer.recent_window,
        )
    return out.unsqueeze(0), None


def _emit_nodes(
    ctx, layer, q, k, v, cache, slot_mapping, block_tables, recent, recent_slots, recent_tables
):
    """Export form: a CacheWrite node (cache in -> cache out) and a PagedAttention node that
    reads the written cache, both in domain ``tqexport`` with the layer's spec as attributes.
    A layer with a recent window gets a second CacheWrite (into its recent cache), and its
    PagedAttention also reads the written recent cache and the recent group's block table."""
    step = ctx.step

    def write(tensors, slots, is_recent):
        return list(
            torch.onnx.ops.symbolic_multi_out(
                f"{DOMAIN}::{CACHE_WRITE}",
                [*tensors, k, v, slots],
                node_attrs(CACHE_WRITE, layer, ctx.num_heads, recent=is_recent),
                dtypes=[t.dtype for t in tensors],
                shapes=[t.shape for t in tensors],
            )
        )

    new_cache = write(cache, slot_mapping, False)
    new_recent = write(recent, recent_slots, True) if recent else []
    inputs = [q, *new_cache, block_tables, step.seq_lens, step.query_start_loc, step.positions]
    out = torch.onnx.ops.symbolic(
        f"{DOMAIN}::{PAGED_ATTENTION}",
        inputs + ([*new_recent, recent_tables] if recent else []),
        node_attrs(PAGED_ATTENTION, layer, ctx.num_heads),
        dtype=q.dtype,
        shape=q.shape,
    )
    return out, new_cache + new_recent


transformers.AttentionInterface.register(ATTENTION_NAME, tqexport_attention)
