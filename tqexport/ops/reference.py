"""Reference CacheWrite and PagedAttention: pure torch, vectorized, exportable.

These functions are the semantics of the two per-layer ops. The torch backend runs them, and
the ONNX function bodies are these same functions exported to standard ops, so the graph and
the reference cannot drift apart. Written for export: no bitcasts, no data-dependent shapes,
masks applied with ``where`` (never by adding -inf: 0 x NaN from a recycled block is NaN).

Step contract (flattened tokens, vLLM style), for one layer of one cache group:
``slot_mapping [T]`` int64 (block * block_size + offset; < 0 = padding, written to the null
block 0), ``block_tables [S, max_blocks]`` int32 (0 = null block), ``seq_lens [S]`` int32 (tokens
cached after this step's write), ``query_start_loc [S+1]`` int32, ``positions [T]`` int64.
"""

from __future__ import annotations

import torch

from tqexport.kvquant.codecs import MODEL_DTYPES, Codec, make_codec


def write_cache(
    codec: Codec,
    cache: list[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[torch.Tensor]:
    """Encode this step's K/V ``[T, kv_heads, D]`` and scatter them into a copy of the cache.

    Cache tensors are ``[num_blocks, block_size, kv_heads(, X)]`` in ``codec.tensors`` order.
    Padding tokens (slot < 0) land in the null block. TurboQuant padding bytes keep their value.
    """
    block_size = cache[0].shape[1]
    slots = torch.where(slot_mapping < 0, torch.zeros_like(slot_mapping), slot_mapping)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    encoded = codec.encode(k, v)
    out = []
    for fmt, tensor in zip(codec.tensors, cache, strict=True):
        new = encoded[fmt.role].to(tensor.dtype)
        if fmt.width is not None and new.shape[-1] < tensor.shape[-1]:
            new = torch.cat([new, tensor[blocks, offsets, :, new.shape[-1] :]], dim=-1)
        out.append(tensor.index_put((blocks, offsets), new))
    return out


def write_cache_(codec, cache, k, v, slot_mapping) -> None:
    """In-place :func:`write_cache` (the torch backend's form; export uses the functional one)."""
    for tensor, new in zip(cache, write_cache(codec, cache, k, v, slot_mapping), strict=True):
        tensor.copy_(new)


def _gather(codec: Codec, cache, block_tables, seq_lens):
    """Keys and values ``[S, C, KVH, D]`` of every sequence's blocks, their positions ``[C]``
    and which are real cached keys ``[S, C]`` (below seq_len, not in the null block)."""
    block_size = cache[0].shape[1]
    tables = block_tables.to(torch.int64)
    gathered = {
        fmt.role: t[tables].flatten(1, 2) for fmt, t in zip(codec.tensors, cache, strict=True)
    }
    keys, values = codec.decode(gathered)  # float32
    key_pos = torch.arange(tables.shape[1] * block_size, device=keys.device)
    key_block = torch.repeat_interleave(tables, block_size, dim=1)  # [S, C]
    valid = (key_pos.unsqueeze(0) < seq_lens.unsqueeze(1).to(torch.int64)) & (key_block != 0)
    keys = torch.where(valid[..., None, None], keys, torch.zeros_like(keys))
    values = torch.where(valid[..., None, None], values, torch.zeros_like(values))
    return keys, values, key_pos, valid


def paged_attention(
    codec: Codec,
    q: torch.Tensor,
    cache: list[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    recent_cache: list[torch.Tensor] | None = None,
    recent_block_tables: torch.Tensor | None = None,
    recent_window: int = 0,
) -> torch.Tensor:
    """Attention of queries ``[T, heads, D]`` over the keys each may see, read from the cache.

    Every sequence's blocks are gathered and decoded; each query attends over the
    concatenation of all sequences' keys with a mask that admits only its own sequence, keys
    at positions ``<= its position`` and, with a window W, ``> position - W``. With a recent
    window N (``recent_cache``: K and V in the model dtype, paged by ``recent_block_tables``),
    keys at positions ``> position - N`` are read from the recent cache instead of the
    quantized one. Queries that see nothing (padding) return zeros. Output is
    ``[T, heads, D]`` in q's dtype.
    """
    tokens = q.shape[0]
    token_idx = torch.arange(tokens, device=q.device)
    ends = query_start_loc[1:].to(torch.int64)
    starts = query_start_loc[:-1].to(torch.int64)
    in_seq = (token_idx.unsqueeze(1) >= starts) & (token_idx.unsqueeze(1) < ends)  # [T, S]
    qpos = positions.to(torch.int64).unsqueeze(1)  # [T, 1]

    def visible(key_pos, valid, lo=None, hi=None):
        """[T, S*C]: own sequence, causal, in window (and in [lo, hi]), a real cached key."""
        pos = key_pos.unsqueeze(0)
        seen = pos <= (qpos if hi is None else torch.minimum(qpos, hi))
        if window is not None:
            seen = seen & (pos > qpos - window)
        if lo is not None:
            seen = seen & (pos >= lo)
        return (in_seq.unsqueeze(2) & seen.unsqueeze(1) & valid.unsqueeze(0)).flatten(1, 2)

    keys, values, key_pos, valid = _gather(codec, cache, block_tables, seq_lens)
    if recent_window:
        plain = make_codec("auto", q.shape[-1], model_dtype=_DTYPE_NAMES[recent_cache[0].dtype])
        r_keys, r_values, r_pos, r_valid = _gather(
            plain, recent_cache, recent_block_tables, seq_lens
        )
        first_recent = qpos - recent_window + 1
        segments = [
            (keys, values, visible(key_pos, valid, hi=first_recent - 1)),
            (r_keys, r_values, visible(r_pos, r_valid, lo=first_recent)),
        ]
    else:
        segments = [(keys, values, visible(key_pos, valid))]
    kv_heads, head_size = keys.shape[-2], keys.shape[-1]
    k_all = torch.cat([k.reshape(-1, kv_heads, head_size) for k, _, _ in segments])
    v_all = torch.cat([v.reshape(-1, kv_heads, head_size) for _, v, _ in segments])
    seen = torch.cat([m for _, _, m in segments], dim=1)  # [T, J]

    groups = q.shape[1] // kv_heads
    qg = q.float().reshape(tokens, kv_heads, groups, head_size).permute(1, 0, 2, 3)
    qg = qg.reshape(kv_heads, tokens * groups, head_size)  # [KVH, T*G, D]
    scores = torch.matmul(qg, k_all.permute(1, 2, 0)) * scale  # [KVH, T*G, J]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(kv_heads, tokens, groups, -1)
    mask = seen.unsqueeze(0).unsqueeze(2)  # [1, T, 1, J]
    scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    any_visible = seen.any(dim=1)  # [T]
    scores = torch.where(any_visible[None, :, None, None], scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(mask, probs, torch.zeros_like(probs))
    out = torch.matmul(probs.reshape(kv_heads, tokens * groups, -1), v_all.permute(1, 0, 2))
    out = out.reshape(kv_heads, tokens, groups, head_size).permute(1, 0, 2, 3)
    return out.reshape(tokens, kv_heads * groups, head_size).to(q.dtype)


_DTYPE_NAMES = {dt: name for name, dt in MODEL_DTYPES.items()}
