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
from tqexport.ops import torch_ops as _torch_ops  # noqa: F401  registers torch.ops.tqexport.*
from tqexport.ops.attributes import (
    CACHE_WRITE,
    DOMAIN,
    PAGED_ATTENTION,
    attention_segments,
    node_attrs,
)
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
    #: called as key_observer(layer, q, k, positions) with the untransformed query and key
    key_observer: object | None = None
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
    caches = _split_bindings(layer, ctx.caches[layer.index])
    slots = [step.slot_mappings[b.group] for b in layer.bindings]
    tables = [step.block_tables[b.group] for b in layer.bindings]
    c = layer.cache
    if ctx.observer is not None:
        ctx.observer(layer, k, v)
    if ctx.key_observer is not None:
        ctx.key_observer(layer, q, k, step.positions)
    if layer.key_transform is not None:  # before every write: both segments shift alike
        q, k = layer.key_transform.apply(q, k)
    if ctx.mode == "export":
        out, written = _emit_nodes(ctx, layer, q, k, v, caches, slots, tables)
    elif ctx.mode == "inplace":
        for b, cache, slot_mapping in zip(layer.bindings, caches, slots, strict=True):
            torch.ops.tqexport.cache_write(cache, k, v, slot_mapping, *_op_cache_args(b.cache))
        seg = attention_segments(layer, caches, tables)
        out = torch.ops.tqexport.paged_attention(
            q, caches[0], tables[0], step.seq_lens, step.query_start_loc, step.positions,
            *_op_cache_args(c), layer.scale, layer.softcap or 0.0, layer.window or 0, **seg,
        )  # fmt: skip
    else:
        written = [
            reference.write_cache(b.cache.codec, cache, k, v, slot_mapping)
            for b, cache, slot_mapping in zip(layer.bindings, caches, slots, strict=True)
        ]
        out = reference.paged_attention(
            c.codec,
            q,
            written[0],
            tables[0],
            step.seq_lens,
            step.query_start_loc,
            step.positions,
            scale=layer.scale,
            softcap=layer.softcap,
            window=layer.window,
            **attention_segments(layer, written, tables),
        )
    if ctx.mode != "inplace":
        ctx.new_caches[layer.index] = [t for tensors in written for t in tensors]
    return out.unsqueeze(0), None


def _split_bindings(layer: LayerSpec, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A layer's cache tensors (graph order) grouped by binding."""
    out, at = [], 0
    for b in layer.bindings:
        out.append(list(tensors[at : at + len(b.cache.tensors)]))
        at += len(b.cache.tensors)
    return out


def _op_cache_args(c) -> tuple:
    """The torch ops' description of a cache: dtype name, model dtype, k and v scales."""
    return c.kv_cache_dtype, c.model_dtype, c.k_scale, c.v_scale


def _emit_nodes(ctx, layer, q, k, v, caches, slots, tables):
    """Export form: one CacheWrite node per cache binding (cache in -> cache out) and a
    PagedAttention node reading the written caches, all in domain ``tqexport`` with the
    layer's spec as attributes. PagedAttention's inputs are the first binding's cache and
    block table with the step tensors, then each further binding's cache and block table."""
    step = ctx.step

    def write(i, tensors, slot_mapping):
        return list(
            torch.onnx.ops.symbolic_multi_out(
                f"{DOMAIN}::{CACHE_WRITE}",
                [*tensors, k, v, slot_mapping],
                node_attrs(CACHE_WRITE, layer, ctx.num_heads, binding=i),
                dtypes=[t.dtype for t in tensors],
                shapes=[t.shape for t in tensors],
            )
        )

    written = [write(i, t, sl) for i, (t, sl) in enumerate(zip(caches, slots, strict=True))]
    inputs = [q, *written[0], tables[0], step.seq_lens, step.query_start_loc, step.positions]
    for tensors, table in zip(written[1:], tables[1:], strict=True):
        inputs += [*tensors, table]
    out = torch.onnx.ops.symbolic(
        f"{DOMAIN}::{PAGED_ATTENTION}",
        inputs,
        node_attrs(PAGED_ATTENTION, layer, ctx.num_heads),
        dtype=q.dtype,
        shape=q.shape,
    )
    return out, written


transformers.AttentionInterface.register(ATTENTION_NAME, tqexport_attention)
