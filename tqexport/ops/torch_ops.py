"""torch.library registration of the two per-layer ops (eager torch backend).

``tqexport::cache_write`` mutates the layer's cache tensors in place; ``tqexport::paged_attention``
reads them. Both take the layer's own cache description (dtype name, model dtype, scales), never
a global one. The CPU implementation is :mod:`tqexport.ops.reference`; fake implementations let
torch.compile/export trace them. Export to ONNX does not go through these (see export/onnx.py).
"""

from __future__ import annotations

import torch

from tqexport.kvquant.codecs import codec_for
from tqexport.ops import reference


@torch.library.custom_op("tqexport::cache_write", mutates_args=("cache",))
def cache_write(
    cache: list[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    model_dtype: str,
    k_scale: float,
    v_scale: float,
) -> None:
    codec = codec_for(kv_cache_dtype, k.shape[-1], model_dtype, k_scale, v_scale)
    if k.is_cuda:
        from tqexport.ops.triton import cache_write as triton_write
        from tqexport.ops.triton.common import supports

        if supports(codec):
            triton_write.write_cache_(codec, cache, k, v, slot_mapping)
            return
    reference.write_cache_(codec, cache, k, v, slot_mapping)


@torch.library.custom_op("tqexport::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    cache: list[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    kv_cache_dtype: str,
    model_dtype: str,
    k_scale: float,
    v_scale: float,
    scale: float,
    softcap: float,
    window: int,
    recent_cache: list[torch.Tensor],
    recent_block_tables: torch.Tensor | None,
    recent_window: int,
    sink_tokens: int,
) -> torch.Tensor:
    """``softcap`` 0 = none, ``window`` 0 = full attention; ``recent_window`` 0 = none (then
    ``recent_cache`` is empty, ``recent_block_tables`` None and ``sink_tokens`` 0)."""
    codec = codec_for(kv_cache_dtype, q.shape[-1], model_dtype, k_scale, v_scale)
    if q.is_cuda:
        from tqexport.ops.triton import paged_attention as triton_attention
        from tqexport.ops.triton.common import supports

        if supports(codec):
            return triton_attention.paged_attention(
                codec, q, cache, block_tables, seq_lens, query_start_loc, positions,
                scale=scale, softcap=softcap or None, window=window or None,
                recent_cache=recent_cache or None, recent_block_tables=recent_block_tables,
                recent_window=recent_window, sink_tokens=sink_tokens,
            )  # fmt: skip
    return reference.paged_attention(
        codec,
        q,
        cache,
        block_tables,
        seq_lens,
        query_start_loc,
        positions,
        scale=scale,
        softcap=softcap or None,
        window=window or None,
        recent_cache=recent_cache or None,
        recent_block_tables=recent_block_tables,
        recent_window=recent_window,
        sink_tokens=sink_tokens,
    )


@paged_attention.register_fake
def _(q, cache, block_tables, seq_lens, query_start_loc, positions, *args):
    return torch.empty_like(q)
