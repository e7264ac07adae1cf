"""The TensorRT entry points of the paged attention kernel: one program per (token, kv head)
writing the output directly (no split-KV merge), parameters in the plugin's order; and the
(kernel, signature, constexprs) ``trt_plugins/`` compiles ahead of time for each layer."""

from __future__ import annotations

import triton
import triton.language as tl

from tqexport.kvquant.codecs import Codec, Fp8PerTensorCodec, TurboQuantCodec, UnquantizedCodec
from tqexport.kvquant.float_bytes import FP8_FORMATS
from tqexport.ops.triton.common import (
    TRITON_TYPES,
    as_fp32,
    layout_constants,
    turboquant_inline_tables,
)
from tqexport.ops.triton.paged_attention import _attend, _merge_states


@triton.jit
def _attend_to_output(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, qsl_ptr, pos_ptr, rk_ptr, rv_ptr, recent_tables_ptr,
    num_seqs, max_blocks, max_recent_blocks, out_ptr,
    H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr,
    SLOT: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NC: tl.constexpr, NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, E5M2: tl.constexpr,
    K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, INV_SQRT: tl.constexpr, CENT: tl.constexpr,
    NG: tl.constexpr, RECENT_WINDOW: tl.constexpr, SINK_TOKENS: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VCENT: tl.constexpr,
):  # fmt: skip
    """One split, tables in-kernel, acc / sum written to ``out`` in its dtype (no merge pass);
    with RECENT_WINDOW, keys inside the window (and the first SINK_TOKENS) come from the
    model-dtype recent cache."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    acc, m, l_sum = _attend(
        t=t, kvh=kvh, split=0, q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr,
        block_tables_ptr=block_tables_ptr, qsl_ptr=qsl_ptr, pos_ptr=pos_ptr, rot_ptr=q_ptr,
        cent_ptr=q_ptr, fp8_ptr=q_ptr, num_seqs=num_seqs, max_blocks=max_blocks, k_scale=K_SCALE,
        v_scale=V_SCALE, sm_scale=SM_SCALE, softcap=SOFTCAP, window=WINDOW, H=H, KVH=KVH,
        GROUPS=GROUPS, G=G, D=D, BS=BS, MODE=MODE, NSPLIT=1, SLOT=SLOT, KEY_BITS=KEY_BITS,
        VAL_BITS=VAL_BITS, KEY_FP8=KEY_FP8, NC=NC, NORM_OFF=NORM_OFF, VAL_OFF=VAL_OFF,
        SCALE_OFF=SCALE_OFF, ZERO_OFF=ZERO_OFF, INLINE=True, E5M2=E5M2, INV_SQRT=INV_SQRT,
        CENT=CENT, recent_window=RECENT_WINDOW, sink_tokens=SINK_TOKENS,
        PART=1 if RECENT_WINDOW > 0 else 0, NG=NG, VAL_MSE=VAL_MSE, VNORM_OFF=VNORM_OFF,
        VCENT=VCENT,
    )  # fmt: skip
    if RECENT_WINDOW > 0:  # the recent window's keys, then any sink tokens'
        for part in tl.static_range(2, 4 if SINK_TOKENS > 0 else 3):
            acc2, m2, l2 = _attend(
                t=t, kvh=kvh, split=0, q_ptr=q_ptr, k_ptr=rk_ptr, v_ptr=rv_ptr,
                block_tables_ptr=recent_tables_ptr, qsl_ptr=qsl_ptr, pos_ptr=pos_ptr,
                rot_ptr=q_ptr, cent_ptr=q_ptr, fp8_ptr=q_ptr, num_seqs=num_seqs,
                max_blocks=max_recent_blocks, k_scale=1.0, v_scale=1.0, sm_scale=SM_SCALE,
                softcap=SOFTCAP, window=WINDOW, H=H, KVH=KVH, GROUPS=GROUPS, G=G, D=D, BS=BS,
                MODE=0, NSPLIT=1, SLOT=1, KEY_BITS=KEY_BITS, VAL_BITS=VAL_BITS, KEY_FP8=False,
                NC=False, NORM_OFF=0, VAL_OFF=0, SCALE_OFF=0, ZERO_OFF=0, INLINE=True,
                E5M2=False, INV_SQRT=0.0, CENT=None, recent_window=RECENT_WINDOW,
                sink_tokens=SINK_TOKENS, PART=part, NG=1, VAL_MSE=False, VNORM_OFF=0, VCENT=(),
            )  # fmt: skip
            acc, m, l_sum = _merge_states(acc, m, l_sum, acc2, m2, l2)
    gi = tl.arange(0, G)
    d = tl.arange(0, D)
    gmask = gi < GROUPS
    heads = kvh * GROUPS + gi
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    dst = out_ptr + (t * H + heads)[:, None] * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


# The TensorRT entry points: parameters in the plugin's order (node inputs, int32 scalars,
# output). Without a recent window the four recent parameters are constexpr None, so they are
# absent from the compiled kernel's parameter list.
@triton.jit
def trt_paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, pos_ptr,
    recent_k_ptr, recent_v_ptr, recent_tables_ptr, num_seqs, max_blocks, max_recent_blocks,
    out_ptr,
    H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr,
    SLOT: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NC: tl.constexpr, NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, E5M2: tl.constexpr,
    K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, INV_SQRT: tl.constexpr, CENT: tl.constexpr,
    NG: tl.constexpr, RECENT_WINDOW: tl.constexpr, SINK_TOKENS: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VCENT: tl.constexpr, VTH: tl.constexpr,
):  # fmt: skip
    """TensorRT order for separate K and V caches (fp8 bytes or the model dtype)."""
    _attend_to_output(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, pos_ptr, recent_k_ptr,
        recent_v_ptr, recent_tables_ptr, num_seqs, max_blocks, max_recent_blocks, out_ptr, H,
        KVH, GROUPS, G, D, BS, MODE, SLOT, KEY_BITS, VAL_BITS, KEY_FP8, NC, NORM_OFF, VAL_OFF,
        SCALE_OFF, ZERO_OFF, E5M2, K_SCALE, V_SCALE, SM_SCALE, SOFTCAP, WINDOW, INV_SQRT, CENT,
        NG, RECENT_WINDOW, SINK_TOKENS, VAL_MSE, VNORM_OFF, VCENT,
    )  # fmt: skip


@triton.jit
def trt_paged_attention_tq_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, pos_ptr,
    recent_k_ptr, recent_v_ptr, recent_tables_ptr, num_seqs, max_blocks, max_recent_blocks,
    out_ptr,
    H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr,
    SLOT: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NC: tl.constexpr, NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, E5M2: tl.constexpr,
    K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, INV_SQRT: tl.constexpr, CENT: tl.constexpr,
    NG: tl.constexpr, RECENT_WINDOW: tl.constexpr, SINK_TOKENS: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VCENT: tl.constexpr, VTH: tl.constexpr,
):  # fmt: skip
    """TensorRT order for a TurboQuant layer: K and V packed in ONE slot tensor."""
    _attend_to_output(
        q_ptr, cache_ptr, cache_ptr, block_tables_ptr, qsl_ptr, pos_ptr, recent_k_ptr,
        recent_v_ptr, recent_tables_ptr, num_seqs, max_blocks, max_recent_blocks, out_ptr, H,
        KVH, GROUPS, G, D, BS, MODE, SLOT, KEY_BITS, VAL_BITS, KEY_FP8, NC, NORM_OFF, VAL_OFF,
        SCALE_OFF, ZERO_OFF, E5M2, K_SCALE, V_SCALE, SM_SCALE, SOFTCAP, WINDOW, INV_SQRT, CENT,
        NG, RECENT_WINDOW, SINK_TOKENS, VAL_MSE, VNORM_OFF, VCENT,
    )  # fmt: skip


def trt_kernel_variant(
    codec: Codec, heads: int, kv_heads: int, block_size: int, model_dtype: str,
    *, scale: float, softcap: float, window: int, recent_window: int = 0, sink_tokens: int = 0,
):  # fmt: skip
    """(kernel, signature, constexprs) of the TensorRT-order entry point for one layer."""
    x = "*" + TRITON_TYPES[model_dtype]
    groups = heads // kv_heads
    layout = layout_constants(codec)
    consts = dict(H=heads, KVH=kv_heads, GROUPS=groups, G=triton.next_power_of_2(groups),
                  D=codec.head_size, BS=block_size, **layout, E5M2=False, K_SCALE=1.0,
                  V_SCALE=1.0, SM_SCALE=as_fp32(scale), SOFTCAP=as_fp32(softcap or 0.0),
                  WINDOW=int(window or 0), INV_SQRT=0.0, CENT=None,
                  RECENT_WINDOW=int(recent_window),
                  SINK_TOKENS=int(sink_tokens))  # fmt: skip
    steps = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
             "pos_ptr": "*i64", "recent_k_ptr": x, "recent_v_ptr": x,
             "recent_tables_ptr": "*i32", "num_seqs": "i32", "max_blocks": "i32",
             "max_recent_blocks": "i32", "out_ptr": x}  # fmt: skip
    if not recent_window:  # constexpr None: absent from the compiled parameter list
        for name in ("recent_k_ptr", "recent_v_ptr", "recent_tables_ptr", "max_recent_blocks"):
            steps[name], consts[name] = "constexpr", None
    if isinstance(codec, TurboQuantCodec):
        inline = turboquant_inline_tables(codec)
        cents = () if codec.preset.key_fp8 else tq_centroids(codec)
        consts.update(INV_SQRT=inline["INV_SQRT"], CENT=cents)
        sig = {"q_ptr": x, "cache_ptr": "*u8", **steps}
        kernel = trt_paged_attention_tq_kernel
    else:
        cache_t = x if isinstance(codec, UnquantizedCodec) else "*u8"
        if isinstance(codec, Fp8PerTensorCodec):
            e5m2 = codec.fmt is FP8_FORMATS["float8_e5m2"]
            consts.update(E5M2=e5m2, K_SCALE=as_fp32(codec.k_scale), V_SCALE=as_fp32(codec.v_scale))
        sig = {"q_ptr": x, "k_cache_ptr": cache_t, "v_cache_ptr": cache_t, **steps}
        kernel = trt_paged_attention_kernel
    return kernel, {**sig, **{k: "constexpr" for k in consts if k not in sig}}, consts


def tq_centroids(codec: TurboQuantCodec) -> tuple[float, ...]:
    """The layer's fp32 centroid table as exact Python floats (constexpr for in-kernel lookup)."""
    return tuple(codec.key_book.centroids.tolist())
