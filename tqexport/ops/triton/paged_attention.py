"""PagedAttention kernels: split-KV attention that reads only the (quantized) cache, plus a
separate log-sum-exp merge kernel over an explicit partial-results tensor.

Grid ``(tokens, kv_heads, splits)``: one program reads one kv head's pages once for all the
query heads that share it (GQA), dequantizing TurboQuant slots (MSE keys against the rotated
query, fp8 keys, uniform values or MSE values summed in the rotated basis), fp8 bytes or
unquantized values in registers, and keeps an online softmax. Every query attends to the keys
it may see (causal, window) from the cache, prefill and decode alike. Partial results
``[T, H, splits, D + 2]`` (acc, max, sum) are merged by :func:`merge_kernel`. fp8 bytes are
decoded through a 256-entry table (exact everywhere). TensorRT's entry points over the same
``_attend`` are in :mod:`~tqexport.ops.triton.trt_attention`.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from tqexport.kvquant.codecs import Codec, Fp8PerTensorCodec, TurboQuantCodec, UnquantizedCodec
from tqexport.kvquant.float_bytes import FP8_FORMATS, fp8_decode
from tqexport.ops.triton.common import (
    hadamard_tile,
    layout_constants,
    turboquant_tables,
)


@triton.jit
def _fp16_at(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _unpack(ptr, rows_off, mask, BITS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Codes [BS, D] from packed bytes starting at ptr + rows_off[:, None]."""
    if BITS == 4:
        b = tl.load(
            ptr + rows_off[:, None] + tl.arange(0, D // 2)[None, :], mask=mask[:, None], other=0
        )
        b = b.to(tl.int32)
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BS, D))
    elif BITS == 2:
        b = tl.load(
            ptr + rows_off[:, None] + tl.arange(0, D // 4)[None, :], mask=mask[:, None], other=0
        )
        shifts = tl.arange(0, 4) * 2
        codes = tl.reshape((b.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & 3, (BS, D))
    else:
        g = tl.arange(0, D // 8) * 3
        base = ptr + rows_off[:, None] + g[None, :]
        b0 = tl.load(base, mask=mask[:, None], other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=mask[:, None], other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=mask[:, None], other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        shifts = tl.arange(0, 8) * 3
        codes = tl.reshape((word[:, :, None] >> shifts[None, None, :]) & 7, (BS, D))
    return codes


@triton.jit
def _fp8_values(b, fp8_ptr, INLINE: tl.constexpr, E5M2: tl.constexpr):
    """fp8 bytes -> fp32: through the 256-entry table, or (INLINE) by exact bit arithmetic."""
    if INLINE:
        u = b.to(tl.int32)
        sign = (u >> 7) & 1
        MB: tl.constexpr = 2 if E5M2 else 3
        BIAS: tl.constexpr = 15 if E5M2 else 7
        EMAX: tl.constexpr = 31 if E5M2 else 15
        e = (u >> MB) & EMAX
        m = u & ((1 << MB) - 1)
        normal = ((sign << 31) | ((e + (127 - BIAS)) << 23) | (m << (23 - MB))).to(
            tl.float32, bitcast=True
        )
        sub = m.to(tl.float32) * (2.0 ** (1 - BIAS - MB))
        val = tl.where(e == 0, tl.where(sign == 1, -sub, sub), normal)
        if E5M2:
            special = (sign << 31) | (255 << 23) | (m << 21)  # inf (m = 0) or NaN
            val = tl.where(e == EMAX, special.to(tl.float32, bitcast=True), val)
        else:
            val = tl.where((e == EMAX) & (m == 7), float("nan"), val)  # e4m3fn: S.1111.111
    else:
        val = tl.load(fp8_ptr + b.to(tl.int32))
    return val


@triton.jit
def _centroid_values(codes, cent_ptr, KEY_BITS: tl.constexpr, INLINE: tl.constexpr,
                     CENT: tl.constexpr):  # fmt: skip
    """Centroid per code: gathered from ``cent_ptr``, or (INLINE) a select chain over CENT."""
    if INLINE:
        c = tl.zeros(codes.shape, tl.float32) + CENT[0]
        for j in tl.static_range(1, 2**KEY_BITS):
            c = tl.where(codes == j, CENT[j], c)
    else:
        c = tl.load(cent_ptr + codes)
    return c


@triton.jit
def _attend(
    t, kvh, split, q_ptr, k_ptr, v_ptr, block_tables_ptr, qsl_ptr, pos_ptr,
    rot_ptr, cent_ptr, fp8_ptr,
    num_seqs, max_blocks, k_scale, v_scale, sm_scale, softcap, window,
    H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr, NSPLIT: tl.constexpr,
    SLOT: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NC: tl.constexpr, NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
    INLINE: tl.constexpr, E5M2: tl.constexpr, INV_SQRT: tl.constexpr, CENT: tl.constexpr,
    recent_window, sink_tokens, PART: tl.constexpr, NG: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VCENT: tl.constexpr,
):  # fmt: skip
    """One (token, kv head, split): online-softmax (acc [G, D], max [G], sum [G]) over its pages.
    MSE values (VAL_MSE) are summed in the rotated basis and the sum rotated back at the end.

    PART 0: every visible key; 1: only keys older than the recent window (positions
    <= p - recent_window) and not sink tokens (>= sink_tokens); 2: only keys inside it and
    not sink tokens (read from the recent cache); 3: only the sink tokens (< sink_tokens, read
    from the recent cache)."""
    # which sequence this token belongs to: how many sequences end at or before it
    seq = 0
    for i in range(0, num_seqs):
        seq += (tl.load(qsl_ptr + i + 1) <= t).to(tl.int32)
    real = seq < num_seqs
    p = tl.load(pos_ptr + t).to(tl.int32)
    hi = tl.where(real, p + 1, 0)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    if PART == 1:
        hi = tl.minimum(hi, tl.maximum(p - recent_window + 1, 0))
        lo = tl.maximum(lo, sink_tokens)
    if PART == 2:
        lo = tl.maximum(tl.maximum(lo, p - recent_window + 1), sink_tokens)
    if PART == 3:
        hi = tl.minimum(hi, sink_tokens)
    lo = tl.minimum(lo, hi)
    first = lo // BS
    n_pages = tl.where(hi > lo, (hi - 1) // BS - first + 1, 0)
    per = (n_pages + NSPLIT - 1) // NSPLIT
    start = first + split * per
    end = tl.minimum(start + per, first + n_pages)

    gi = tl.arange(0, G)
    d = tl.arange(0, D)
    gmask = gi < GROUPS
    heads = kvh * GROUPS + gi
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32)
    if MODE == 2:
        if not KEY_FP8:
            rot = hadamard_tile(rot_ptr, D, INLINE, INV_SQRT)
            q = tl.sum(q[:, :, None] * rot[None, :, :], axis=1)  # rotated query

    m = tl.full([G], float("-inf"), tl.float32)
    l_sum = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    seq_row = tl.minimum(seq, num_seqs - 1)
    for page in range(start, end):
        phys = tl.load(block_tables_ptr + seq_row * max_blocks + page).to(tl.int64)
        kpos = page * BS + tl.arange(0, BS)
        kmask = (kpos >= lo) & (kpos < hi)
        rows = phys * BS + tl.arange(0, BS)
        if MODE == 2:
            slot_off = (rows * KVH + kvh) * SLOT
            if KEY_FP8:
                kb = tl.load(k_ptr + slot_off[:, None] + d[None, :], mask=kmask[:, None], other=0)
                keys = _fp8_values(kb, fp8_ptr, INLINE, False)
                s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)
            else:
                codes = _unpack(k_ptr, slot_off, kmask, KEY_BITS, D, BS)
                c = _centroid_values(codes, cent_ptr, KEY_BITS, INLINE, CENT)
                if NC:
                    c = c / tl.sqrt(tl.sum(c * c, axis=1) + 1e-16)[:, None]
                norm = _fp16_at(k_ptr + slot_off + NORM_OFF, kmask)
                s = tl.sum(q[:, None, :] * c[None, :, :], axis=2) * norm[None, :]
            if VAL_MSE:  # centroids in the rotated basis, norm-corrected like keys
                vcodes = _unpack(k_ptr + VAL_OFF, slot_off, kmask, VAL_BITS, D, BS)
                vals = _centroid_values(vcodes, cent_ptr, VAL_BITS, True, VCENT)
                if NC:
                    vals = vals / tl.sqrt(tl.sum(vals * vals, axis=1) + 1e-16)[:, None]
                vals = vals * _fp16_at(k_ptr + slot_off + VNORM_OFF, kmask)[:, None]
            else:
                vcodes = _unpack(k_ptr + VAL_OFF, slot_off, kmask, VAL_BITS, D, BS)
                vcodes = vcodes.to(tl.float32)
                pair = tl.arange(0, NG) * 4  # (scale, zero) of value group g at +4g
                pmask = kmask[:, None] & (pair[None, :] >= 0)
                vscale = _fp16_at(k_ptr + slot_off[:, None] + SCALE_OFF + pair[None, :], pmask)
                vzero = _fp16_at(k_ptr + slot_off[:, None] + ZERO_OFF + pair[None, :], pmask)
                GS: tl.constexpr = D // NG
                vals = tl.reshape(vcodes, (BS, NG, GS)) * vscale[:, :, None] + vzero[:, :, None]
                vals = tl.reshape(vals, (BS, D))
        else:
            off = (rows * KVH + kvh)[:, None] * D + d[None, :]
            kraw = tl.load(k_ptr + off, mask=kmask[:, None], other=0)
            vraw = tl.load(v_ptr + off, mask=kmask[:, None], other=0)
            if MODE == 1:
                keys = _fp8_values(kraw, fp8_ptr, INLINE, E5M2) * k_scale
                vals = _fp8_values(vraw, fp8_ptr, INLINE, E5M2) * v_scale
            else:
                keys = kraw.to(tl.float32)
                vals = vraw.to(tl.float32)
            s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)
        s = s * sm_scale
        if softcap > 0:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s/cap)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        pr = tl.where(kmask[None, :], pr, 0.0)
        vals = tl.where(kmask[:, None], vals, 0.0)
        l_sum = l_sum * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vals[None, :, :], axis=1)
        m = m_new
    if MODE == 2:
        if VAL_MSE:  # (sum_t p_t s_t c_t) @ H: the values' rotation, once
            acc = tl.sum(acc[:, :, None] * rot[None, :, :], axis=1)
    return acc, m, l_sum


@triton.jit
def _merge_states(acc, m, l_sum, acc2, m2, l2):
    """Two online-softmax states (acc [G, D], max [G], sum [G]) over disjoint keys, as one."""
    big = tl.maximum(m, m2)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    a1 = tl.where(m == float("-inf"), 0.0, tl.exp(m - big_safe))
    a2 = tl.where(m2 == float("-inf"), 0.0, tl.exp(m2 - big_safe))
    return acc * a1[:, None] + acc2 * a2[:, None], big, l_sum * a1 + l2 * a2


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, pos_ptr,
    rot_ptr, cent_ptr, fp8_ptr, rk_ptr, rv_ptr, recent_tables_ptr, partial_ptr,
    num_seqs, max_blocks, max_recent_blocks, k_scale, v_scale, sm_scale, softcap, window,
    recent_window, sink_tokens,
    H: tl.constexpr, KVH: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr, NSPLIT: tl.constexpr,
    SLOT: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, KEY_FP8: tl.constexpr,
    NC: tl.constexpr, NORM_OFF: tl.constexpr, VAL_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, RECENT: tl.constexpr, NG: tl.constexpr,
    VAL_MSE: tl.constexpr, VNORM_OFF: tl.constexpr, VCENT: tl.constexpr, VTH: tl.constexpr,
):  # fmt: skip
    """Split ``split`` of one (token, kv head); with RECENT, keys inside the recent window and
    the first ``sink_tokens`` come from the model-dtype recent cache (``rk_ptr``/``rv_ptr``
    paged by ``recent_tables_ptr``)."""
    t = tl.program_id(0)
    split = tl.program_id(2)
    acc, m, l_sum = _attend(
        t=t, kvh=tl.program_id(1), split=split, q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr,
        block_tables_ptr=block_tables_ptr, qsl_ptr=qsl_ptr, pos_ptr=pos_ptr, rot_ptr=rot_ptr,
        cent_ptr=cent_ptr, fp8_ptr=fp8_ptr, num_seqs=num_seqs, max_blocks=max_blocks,
        k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, softcap=softcap, window=window, H=H,
        KVH=KVH, GROUPS=GROUPS, G=G, D=D, BS=BS, MODE=MODE, NSPLIT=NSPLIT, SLOT=SLOT,
        KEY_BITS=KEY_BITS, VAL_BITS=VAL_BITS, KEY_FP8=KEY_FP8, NC=NC, NORM_OFF=NORM_OFF,
        VAL_OFF=VAL_OFF, SCALE_OFF=SCALE_OFF, ZERO_OFF=ZERO_OFF, INLINE=False, E5M2=False,
        INV_SQRT=0.0, CENT=None, recent_window=recent_window, sink_tokens=sink_tokens,
        PART=1 if RECENT else 0, NG=NG, VAL_MSE=VAL_MSE, VNORM_OFF=VNORM_OFF, VCENT=VCENT,
    )  # fmt: skip
    if RECENT:  # the recent window's keys, then the sink tokens', from the model-dtype cache
        for part in tl.static_range(2, 4):
            acc2, m2, l2 = _attend(
                t=t, kvh=tl.program_id(1), split=split, q_ptr=q_ptr, k_ptr=rk_ptr, v_ptr=rv_ptr,
                block_tables_ptr=recent_tables_ptr, qsl_ptr=qsl_ptr, pos_ptr=pos_ptr,
                rot_ptr=rot_ptr, cent_ptr=cent_ptr, fp8_ptr=fp8_ptr, num_seqs=num_seqs,
                max_blocks=max_recent_blocks, k_scale=1.0, v_scale=1.0, sm_scale=sm_scale,
                softcap=softcap, window=window, H=H, KVH=KVH, GROUPS=GROUPS, G=G, D=D, BS=BS,
                MODE=0, NSPLIT=NSPLIT, SLOT=1, KEY_BITS=KEY_BITS, VAL_BITS=VAL_BITS,
                KEY_FP8=False, NC=False, NORM_OFF=0, VAL_OFF=0, SCALE_OFF=0, ZERO_OFF=0,
                INLINE=False, E5M2=False, INV_SQRT=0.0, CENT=None, recent_window=recent_window,
                sink_tokens=sink_tokens, PART=part, NG=1, VAL_MSE=False, VNORM_OFF=0, VCENT=(),
            )  # fmt: skip
            acc, m, l_sum = _merge_states(acc, m, l_sum, acc2, m2, l2)
    gi = tl.arange(0, G)
    d = tl.arange(0, D)
    gmask = gi < GROUPS
    heads = tl.program_id(1) * GROUPS + gi
    base = ((t * H + heads) * NSPLIT + split) * (D + 2)
    tl.store(partial_ptr + base[:, None] + d[None, :], acc, mask=gmask[:, None])
    tl.store(partial_ptr + base + D, m, mask=gmask)
    tl.store(partial_ptr + base + D + 1, l_sum, mask=gmask)


@triton.jit
def merge_kernel(partial_ptr, out_ptr, D: tl.constexpr, NSPLIT: tl.constexpr):
    """out[t, h] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M); zeros when nothing is seen."""
    th = tl.program_id(0)
    d = tl.arange(0, D)
    sp = tl.arange(0, NSPLIT)
    base = (th * NSPLIT + sp) * (D + 2)
    m = tl.load(partial_ptr + base + D)
    lsum = tl.load(partial_ptr + base + D + 1)
    acc = tl.load(partial_ptr + base[:, None] + d[None, :])
    big = tl.max(m, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
    total = tl.sum(lsum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + th * D + d, out)


_PTRS = ("q_ptr", "k_ptr", "v_ptr", "block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "pos_ptr",
         "rot_ptr", "cent_ptr", "fp8_ptr", "rk_ptr", "rv_ptr", "recent_tables_ptr",
         "partial_ptr")  # fmt: skip
_SCALARS = {"num_seqs": "i32", "max_blocks": "i32", "max_recent_blocks": "i32",
            "k_scale": "fp32", "v_scale": "fp32", "sm_scale": "fp32", "softcap": "fp32",
            "window": "i32", "recent_window": "i32", "sink_tokens": "i32"}  # fmt: skip


def kernel_variants(
    codec: Codec, heads: int, kv_heads: int, block_size: int, splits: int = 2, recent=False
):
    """(kernel, signature, constexprs) of both kernels for one layer: ahead-of-time checks."""
    cache_t = "*fp32" if isinstance(codec, UnquantizedCodec) else "*u8"
    types = ("*fp32", cache_t, cache_t, "*i32", "*i32", "*i32", "*i64",
             "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*i32", "*fp32")  # fmt: skip
    consts = dict(H=heads, KVH=kv_heads, GROUPS=heads // kv_heads,
                  G=triton.next_power_of_2(heads // kv_heads), D=codec.head_size, BS=block_size,
                  NSPLIT=splits, **layout_constants(codec), RECENT=recent)  # fmt: skip
    sig = {**dict(zip(_PTRS, types, strict=True)), **_SCALARS, **dict.fromkeys(consts, "constexpr")}
    merge_consts = dict(D=codec.head_size, NSPLIT=splits)
    merge_sig = {
        "partial_ptr": "*fp32",
        "out_ptr": "*fp32",
        **dict.fromkeys(merge_consts, "constexpr"),
    }
    return [(paged_attention_kernel, sig, consts), (merge_kernel, merge_sig, merge_consts)]


@lru_cache(maxsize=8)
def _fp8_table(fmt_name: str, device: str) -> torch.Tensor:
    """fp8 byte -> float32 value, built once per format and device."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return fp8_decode(codes, FP8_FORMATS[fmt_name]).to(device)


def paged_attention(
    codec: Codec, q, cache, block_tables, seq_lens, query_start_loc, positions,
    *, scale: float, softcap: float | None = None, window: int | None = None, splits: int = 2,
    recent_cache=None, recent_block_tables=None, recent_window: int = 0, sink_tokens: int = 0,
):  # fmt: skip
    """Same contract as :func:`tqexport.ops.reference.paged_attention`."""
    if sink_tokens and not recent_window:
        raise ValueError("sink tokens are read from the recent cache: give a recent_window")
    tokens, heads, d = q.shape
    splits = triton.next_power_of_2(max(1, splits))  # the merge kernel ranges over splits
    kvh, bs = cache[0].shape[2], cache[0].shape[1]
    groups = heads // kvh
    dev = q.device
    partial = torch.empty(tokens, heads, splits, d + 2, dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    kw = layout_constants(codec)
    rot = cent = fp8 = dummy
    k_scale = v_scale = 1.0
    if isinstance(codec, TurboQuantCodec):
        k_cache = v_cache = cache[0]
        fp8 = _fp8_table("float8_e4m3fn", str(dev))
        if not codec.preset.key_fp8:
            rot, cent, _ = turboquant_tables(d, codec.preset.key_bits, str(dev))
    elif isinstance(codec, Fp8PerTensorCodec):
        k_cache, v_cache = cache
        fp8 = _fp8_table(codec.fmt.name, str(dev))
        k_scale, v_scale = codec.k_scale, codec.v_scale
    else:
        k_cache, v_cache = cache
    if recent_window:
        rk, rv = recent_cache
        recent_tables = recent_block_tables.contiguous()
    else:
        rk = rv = dummy
        recent_tables = block_tables.contiguous()
    paged_attention_kernel[(tokens, kvh, splits)](
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens,
        query_start_loc, positions, rot, cent, fp8, rk, rv, recent_tables, partial,
        block_tables.shape[0], block_tables.shape[1], recent_tables.shape[1], k_scale, v_scale,
        scale, float(softcap or 0.0), int(window or 0), int(recent_window), int(sink_tokens),
        H=heads, KVH=kvh, GROUPS=groups, G=triton.next_power_of_2(groups), D=d, BS=bs,
        NSPLIT=splits, **kw, RECENT=bool(recent_window),
    )  # fmt: skip
    out = torch.empty(tokens, heads, d, dtype=torch.float32, device=dev)
    merge_kernel[(tokens * heads,)](partial, out, D=d, NSPLIT=splits)
    return out.to(q.dtype)
