"""Reference CacheWrite and PagedAttention: pure torch, vectorized, exportable.

These functions are the semantics of the two per-layer ops. The torch backend runs them, and
the ONNX function bodies are these same functions exported to standard ops, so the graph and
the reference cannot drift apart. Written for export: no bitcasts, no data-dependent Python
control flow (sizes that depend on the step, like the longest chunk, are read from step tensors
and export as computed shapes), masks applied with ``where`` or by zeroing (never by adding
-inf: 0 x NaN from a recycled block is NaN).

Step contract (flattened tokens, vLLM style), for one layer of one cache group:
``slot_mapping [T]`` int64 (block * block_size + offset; < 0 = padding, written to the null
block 0), ``block_tables [S, max_blocks]`` int32 (0 = null block), ``seq_lens [S]`` int32 (tokens
cached after this step's write), ``query_start_loc [S+1]`` int32, ``positions [T]`` int64.
Block 0's rows other than row 0 are never written: caches are allocated zeroed, and keys that
are not real (past ``seq_len``, table padding) are read from its last row, so garbage bytes in
recycled blocks never meet a probability of 0 (0 x NaN) and nothing gathered needs zeroing.
"""

from __future__ import annotations

import torch

from tqexport.kvquant.codecs import MODEL_DTYPES, AttentionOperands, Codec, make_codec


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


def _size(x: torch.Tensor) -> int:
    """A step-dependent size (>= 1) from a scalar tensor: an int when run eagerly, a symbolic
    size when traced (exported as a shape computed from the step inputs)."""
    n = x.item()
    torch._check(n >= 1)
    return n


class _Queries:
    """Where the step's queries sit per sequence (step inputs only, no layer data: ONNX Runtime
    computes this once per step for all layers, its common-subexpression pass merging the
    layers' identical nodes). Rows ``[S, Q]``, Q = the longest chunk of the step."""

    def __init__(self, query_start_loc: torch.Tensor, positions: torch.Tensor):
        tokens = positions.shape[0]
        dev = positions.device
        starts = query_start_loc[:-1].to(torch.int64)
        ends = query_start_loc[1:].to(torch.int64)
        lens = ends - starts
        self.width = _size(lens.max().clamp(min=1))
        r = torch.arange(self.width, device=dev)
        self.ok = r < lens.unsqueeze(1)  # [S, Q]: a real query
        # padded rows read row `tokens`, an appended zero query (no query is ever read twice)
        self.row = torch.where(self.ok, starts.unsqueeze(1) + r, tokens)
        pos = torch.cat([positions.to(torch.int64), positions.new_zeros(1, dtype=torch.int64)])
        self.pos = pos[self.row]  # [S, Q]
        big = torch.iinfo(torch.int64).max // 4
        self.first = torch.where(self.ok, self.pos, big).amin(1)  # [S]
        self.last = torch.where(self.ok, self.pos, -big).amax(1)
        # back to tokens: token t is row (its sequence, t - its start); tokens of no sequence
        # (padding) read row 0 and are zeroed
        token = torch.arange(tokens, device=dev).unsqueeze(1)
        in_seq = (token >= starts) & (token < ends)  # [T, S]
        seq = torch.argmax(in_seq.to(torch.int32), dim=1)
        self.belongs = in_seq.any(dim=1)  # [T]
        self.token_row = torch.where(self.belongs, seq * self.width + token[:, 0] - starts[seq], 0)


class _Segment:
    """The keys one segment of the cache offers the step's queries (step inputs only): each
    sequence's blocks from the first one its first query may see, as wide as the widest
    sequence needs, gathered straight into the head-major layout ``[S, KVH, C]``. Only keys at
    positions ``keys_from <= p < keys_below`` belong to the segment (the sink tokens' split)."""

    def __init__(self, qs: _Queries, tables, seq_lens, block_size, kv_heads, lookback=None,
                 gap=0, window=None, lo=None, hi=None, keys_from=0,
                 keys_below=None):  # fmt: skip
        dev = tables.device
        width = tables.shape[1]
        # keys p with first - lookback < p <= last - gap and p < seq_len
        lo_pos = seq_lens * 0 if lookback is None else (qs.first - lookback + 1).clamp(min=0)
        lo_pos = lo_pos.clamp(min=keys_from)
        hi_pos = torch.minimum(seq_lens - 1, qs.last - gap)
        if keys_below is not None:
            hi_pos = hi_pos.clamp(max=keys_below - 1)
        first = torch.div(lo_pos, block_size, rounding_mode="floor")
        count = torch.div(hi_pos, block_size, rounding_mode="floor") - first + 1
        num = _size(count.max().clamp(min=1, max=width))
        col = first.unsqueeze(1) + torch.arange(num, device=dev)  # [S, nb] table column
        block = tables.to(torch.int64).gather(1, torch.clamp(col, max=width - 1))
        block = torch.where(col < width, block, 0)
        offset = torch.arange(block_size, device=dev)
        key_pos = (col.unsqueeze(2) * block_size + offset).flatten(1)  # [S, C]
        rows = (block.unsqueeze(2) * block_size + offset).flatten(1)  # [S, C] cache row
        real = (block != 0).unsqueeze(2).expand(-1, -1, block_size).flatten(1)
        self.valid = real & (key_pos < seq_lens.unsqueeze(1))  # [S, C]: a real cached key
        heads = torch.arange(kv_heads, device=dev)
        self.invalid = None
        if block_size > 1:
            # keys that are not real read the null block's last row, which no write touches
            # (padding goes to row 0): zeros as allocated, so 0 x NaN never occurs and no
            # gathered value needs zeroing
            rows = torch.where(self.valid, rows, block_size - 1)
        else:  # no such row: [S, KVH, C] positions of keys that are not real, zeroed later
            self.invalid = torch.nonzero(~self.valid.unsqueeze(1).expand(-1, kv_heads, -1))
        self.index = rows.unsqueeze(1) * kv_heads + heads.unsqueeze(1)  # [S, KVH, C]
        kp, qp = key_pos.unsqueeze(1), qs.pos.unsqueeze(2)  # [S, 1, C], [S, Q, 1]
        seen = kp <= (qp if hi is None else torch.minimum(qp, hi))
        if window is not None:
            seen = seen & (kp > qp - window)
        if lo is not None:
            seen = seen & (kp >= lo)
        if keys_from:
            seen = seen & (kp >= keys_from)
        if keys_below is not None:
            seen = seen & (kp < keys_below)
        self.seen = seen & self.valid.unsqueeze(1) & qs.ok.unsqueeze(2)  # [S, Q, C]

    def gather(self, codec: Codec, cache: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """This segment's rows of every cache tensor: ``[S, KVH, C(, X)]`` (a row gather,
        ONNX Gather, which ONNX Runtime runs faster than the GatherND of an indexing)."""
        flat = self.index.flatten()
        return {
            fmt.role: t.flatten(0, 2).index_select(0, flat).unflatten(0, self.index.shape)
            for fmt, t in zip(codec.tensors, cache, strict=True)
        }

    def zero_invalid(self, x: torch.Tensor) -> torch.Tensor:
        """``x [S, KVH, C, ...]`` with the rows of keys that are not real set to 0 (only
        needed for block size 1: larger blocks read those keys from a zero row)."""
        i = self.invalid
        if i is None:
            return x
        zeros = x.new_zeros((i.shape[0], *x.shape[3:]))
        return x.index_put((i[:, 0], i[:, 1], i[:, 2]), zeros)


def _scores(ops: AttentionOperands, qs: torch.Tensor, scale: float) -> torch.Tensor:
    """``[S, KVH, Q, C]`` scores of queries ``[S, KVH, Q, D]`` against one segment's keys."""
    if ops.query_rotation is not None:
        qs = qs @ ops.query_rotation
    n = len(ops.keys)
    scores = None
    for i, keys in enumerate(ops.keys):
        part = torch.matmul(qs if n == 1 else qs[..., i::n], keys.transpose(-1, -2))
        scores = part if scores is None else scores + part
    if ops.key_scale is not None:
        scores = scores * ops.key_scale.unsqueeze(-2)
    return scores * scale


def _apply_values(ops: AttentionOperands, probs: torch.Tensor, seg: _Segment) -> torch.Tensor:
    """``probs [S, KVH, Q, C] @ V [S, KVH, C, D]``, V in factored form (rotated back once when
    the values are in a rotated basis). Keys that are not real have probability 0; with
    blocks of one token their bytes may decode to NaN and are zeroed here (their scale and
    zero when the values are finite codes, else the values) so 0 x NaN never occurs."""
    values = ops.values
    if not ops.values_finite:
        values = tuple(seg.zero_invalid(v) for v in values)
    v_scale, v_zero = ops.value_scale, ops.value_zero
    if v_scale is not None:
        v_scale = seg.zero_invalid(v_scale)
    if v_zero is not None:
        v_zero = seg.zero_invalid(v_zero)
    groups = 1 if v_scale is None else v_scale.shape[-1]
    if v_scale is None or groups == 1:  # sum_t p_t (s_t c_t + z_t) = (p * s) @ c + p @ z
        weights = probs if v_scale is None else probs * v_scale.transpose(-1, -2)
        parts = [torch.matmul(weights, v) for v in values]
    else:  # a scale and zero per group of each part's elements
        parts = []
        for v in values:
            v = v.unflatten(-1, (groups, -1)) * v_scale.unsqueeze(-1)
            if v_zero is not None:
                v = v + v_zero.unsqueeze(-1)
            parts.append(torch.matmul(probs, v.flatten(-2)))
        v_zero = None
    out = parts[0] if len(parts) == 1 else torch.stack(parts, dim=-1).flatten(-2)
    if v_zero is not None:
        out = out + torch.matmul(probs, v_zero)
    if ops.value_rotation is not None:  # values in the rotated basis: rotate the sum back once
        out = out @ ops.value_rotation
    return out


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
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Attention of queries ``[T, heads, D]`` over the keys each may see, read from the cache.

    Each query attends over its own sequence's cached keys at positions ``<= its position``
    and, with a window W, ``> position - W``. With a recent window N (``recent_cache``: K and V
    in the model dtype, paged by ``recent_block_tables``), keys at positions ``> position - N``
    are read from the recent cache instead of the quantized one, and with ``sink_tokens`` S so
    are keys at positions ``< S`` (the recent group keeps their blocks). Queries that see nothing
    (padding) return zeros. Output is ``[T, heads, D]`` in q's dtype.

    Per sequence, not per step: queries are gathered into ``[S, Q]`` rows (Q = the step's
    longest chunk; decode steps: 1) and each sequence's blocks into ``[S, KVH, C]`` (C = the
    blocks the step's widest sequence may read: a window or the recent split starts at the
    block the sequence's first query can see), so a step costs the sum over sequences of
    queries x context, never all queries x all contexts. Keys and values are read in the
    codec's factored form (:meth:`Codec.attention_operands`; TurboQuant: scored in the rotated
    basis, values applied as codes).
    """
    if sink_tokens and not recent_window:
        raise ValueError("sink tokens are read from the recent cache: give a recent_window")
    heads, head_size = q.shape[1], q.shape[2]
    block_size, kv_heads = cache[0].shape[1], cache[0].shape[2]
    groups = heads // kv_heads
    seq_lens = seq_lens.to(torch.int64)
    qs = _Queries(query_start_loc, positions)
    if recent_window:
        plain = make_codec("auto", head_size, model_dtype=_DTYPE_NAMES[recent_cache[0].dtype])
        first_recent = qs.pos.unsqueeze(2) - recent_window + 1  # [S, Q, 1]
        lookback = recent_window if window is None else min(window, recent_window)
        segments = [
            (codec, cache, _Segment(qs, block_tables, seq_lens, block_size, kv_heads, window,
                                    recent_window, window, hi=first_recent - 1,
                                    keys_from=sink_tokens)),
            (plain, recent_cache, _Segment(qs, recent_block_tables, seq_lens, block_size,
                                           kv_heads, lookback, 0, window, lo=first_recent,
                                           keys_from=sink_tokens)),
        ]  # fmt: skip
        if sink_tokens:
            segments.append((plain, recent_cache, _Segment(
                qs, recent_block_tables, seq_lens, block_size, kv_heads, window=window,
                keys_below=sink_tokens)))  # fmt: skip
    else:
        segments = [
            (codec, cache, _Segment(qs, block_tables, seq_lens, block_size, kv_heads, window,
                                    0, window)),
        ]  # fmt: skip
    seen = torch.cat([seg.seen for _, _, seg in segments], dim=-1)  # [S, Q, C_all]
    seqs, width = seen.shape[0], qs.width
    mask = seen.unsqueeze(1).unsqueeze(3)  # [S, 1, Q, 1, C_all]
    # a query that sees keys gives the others -inf; one that sees none gets uniform weights
    # (its output is zeroed below), never NaN
    fill = torch.where(seen.any(dim=-1), float("-inf"), 0.0)[:, None, :, None, None]

    # this layer's data: queries per sequence, keys, values
    qf = torch.cat([q.float(), q.new_zeros((1, heads, head_size), dtype=torch.float32)])
    qg = qf[qs.row].unflatten(2, (kv_heads, groups)).permute(0, 2, 1, 3, 4)  # [S,KVH,Q,G,D]
    qg = qg.reshape(seqs, kv_heads, width * groups, head_size)
    operands = [c.attention_operands(seg.gather(c, t)) for c, t, seg in segments]
    scores = torch.cat([_scores(ops, qg, scale) for ops in operands], dim=-1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = torch.where(mask, scores.reshape(seqs, kv_heads, width, groups, -1), fill)
    probs = torch.softmax(scores, dim=-1).reshape(seqs, kv_heads, width * groups, -1)
    out, at = None, 0
    for ops, (_, _, seg) in zip(operands, segments, strict=True):
        n = seg.seen.shape[-1]
        part = _apply_values(ops, probs[..., at : at + n], seg)
        out, at = part if out is None else out + part, at + n
    out = out.reshape(seqs, kv_heads, width, groups, head_size).permute(0, 2, 1, 3, 4)
    out = out.reshape(seqs * width, heads, head_size)[qs.token_row]
    sees = seen.any(dim=-1).flatten()[qs.token_row] & qs.belongs  # [T]
    return torch.where(sees[:, None, None], out, 0.0).to(q.dtype)


_DTYPE_NAMES = {dt: name for name, dt in MODEL_DTYPES.items()}
