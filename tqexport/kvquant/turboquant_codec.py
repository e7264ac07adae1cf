"""The TurboQuant codec: vLLM-compatible slots (keys by Lloyd-Max codebooks in a rotated
basis, or fp8; values uniform or by codebook) and their codebooks."""

from __future__ import annotations

import torch

from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codec_base import (
    _EVERY_BYTE,
    _FP8_E4M3_TABLE,
    AttentionOperands,
    Codec,
    TensorFormat,
    fp16_field_weights,
    fp16_fields,
    nibbles,
    triplet_codes,
)
from tqexport.kvquant.float_bytes import (
    E4M3,
    fp8_decode,
    fp16_from_bytes,
    lookup,
)
from tqexport.kvquant.packing import pack_codes, unpack_codes

NORM_EPS = 1e-8
NC_EPS = 1e-16


class TurboQuantCodec(Codec):
    """TurboQuant slots, byte-compatible with vLLM (layout: :class:`tq.SlotLayout`)."""

    def __init__(self, name: str, head_size: int):
        self.preset = tq.preset(name)
        tq.check_head_size(self.preset, head_size)
        self.head_size = head_size
        self.layout = tq.SlotLayout(self.preset, head_size)
        # Constants are built here, eagerly: built lazily inside an export trace they would be
        # captured as trace-time tensors.
        if not self.preset.key_fp8 or self.preset.value_mse:
            self.rotation = tq.hadamard(head_size)
        if not self.preset.key_fp8:
            self.key_book = _Codebook(head_size, self.preset.key_bits)
        if self.preset.value_mse:
            self.value_book = _Codebook(head_size, self.preset.value_bits)
        # where the fp16 fields lie: a norm (key, MSE value) in its 2 bytes; uniform values'
        # scales and zeros in their parameters (group g's pair at 4g)
        lay = self.layout
        self.norm_weights = fp16_field_weights(2, [0])
        if not self.preset.value_mse:
            params = lay.slot_size - lay.value_params_offset
            self.scale_weights = fp16_field_weights(params, range(0, params, 4))
            self.zero_weights = fp16_field_weights(params, range(2, params, 4))

    @staticmethod
    def slot_tensors(layout: tq.SlotLayout) -> tuple[TensorFormat, ...]:
        """The one uint8 tensor of slots, known from the layout alone."""
        return (TensorFormat("kv", "uint8", layout.slot_size_aligned),)

    @property
    def tensors(self):
        return self.slot_tensors(self.layout)

    # -- MSE vectors (keys; values of the _mse presets) ---------------------------------------
    def _mse_codes(self, x: torch.Tensor, book: _Codebook):
        """(centroid indices [..., D], fp32 norms [...]) of vectors x: the unit vector rotated,
        then its coordinates against the codebook's thresholds."""
        x = x.float()
        norm = torch.linalg.vector_norm(x, dim=-1)
        y = (x / (norm.unsqueeze(-1) + NORM_EPS)) @ self.rotation
        return tq.centroid_index(y, book.thresholds), norm

    def _mse_fields(self, x: torch.Tensor, book: _Codebook):
        """(packed code bytes, fp32 norm ``[..., 1]`` stored as an fp16 field)."""
        idx, norm = self._mse_codes(x, book)
        return pack_codes(idx, book.bits), norm.unsqueeze(-1)

    def _mse_parts(self, code_bytes: torch.Tensor, norm_bytes: torch.Tensor, book: _Codebook):
        """Decode-side (centroid parts, scale) of packed MSE codes: part i holds elements
        ``i::n`` in the rotated basis; scale = norm, divided by ``|c|`` (from the codes) when
        the preset corrects norms."""
        if book.byte_parts is not None:
            index = code_bytes.to(torch.int64)
            parts = tuple(lookup(t, index) for t in book.byte_parts)
        else:
            parts = tuple(lookup(book.centroids, c) for c in triplet_codes(code_bytes))
        scale = fp16_fields(norm_bytes, self.norm_weights).squeeze(-1)
        if self.preset.norm_correction:
            if book.byte_norm2 is not None:  # <c, c> summed over bytes
                sumsq = lookup(book.byte_norm2, index).sum(-1)
            else:
                sumsq = sum((c * c).sum(-1) for c in parts)
            scale = scale / torch.sqrt(sumsq + NC_EPS)
        return parts, scale

    def _mse_decode(self, code_bytes: torch.Tensor, norm_bytes: torch.Tensor, book: _Codebook):
        """(unit centroid vectors in the rotated basis, fp16 norms) (norm-corrected if the
        preset says so)."""
        idx = unpack_codes(code_bytes, book.bits, self.head_size)
        c = book.centroids[idx.to(torch.int64)]
        if self.preset.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS)
        return c, fp16_from_bytes(norm_bytes)

    # -- keys ------------------------------------------------------------------------------
    def key_codes(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MSE keys: (centroid indices [..., D], fp32 norms [...]) before packing."""
        return self._mse_codes(k, self.key_book)

    def _key_fields(self, k):
        """(key code bytes, what follows them as fp16 fields ``[..., 0 or 1]``: the norm)."""
        if self.preset.key_fp8:
            return tq.fp8_key_bytes(k), k.new_zeros((*k.shape[:-1], 0), dtype=torch.float32)
        return self._mse_fields(k, self.key_book)

    def _norm_bytes(self, slots: torch.Tensor, at: int) -> torch.Tensor:
        return slots[..., at : at + 2]

    def key_parts(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode-side key state: (unit centroid vectors in the rotated basis, fp16 norms) for
        MSE keys (norm-corrected if the preset says so), or (fp8 keys, None)."""
        lay = self.layout
        if self.preset.key_fp8:
            return fp8_decode(slots[..., : lay.key_code_bytes], E4M3), None
        norm = self._norm_bytes(slots, lay.key_norm_offset)
        return self._mse_decode(slots[..., : lay.key_code_bytes], norm, self.key_book)

    def decode_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Reconstructed keys, k = norm * c @ H (MSE) or the fp8 key."""
        c, norm = self.key_parts(slots)
        if norm is None:
            return c
        return norm.unsqueeze(-1) * (c @ self.rotation)

    def scores(self, q: torch.Tensor, slots: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """Decode-time scores of queries ``[..., Tq, D]`` against cached slots ``[..., Tk, S]``.

        MSE keys: rotated query against centroids, ``norm * <q @ H, c> * scale``; fp8 keys:
        ``<q, fp8(k)> * scale``. Returns ``[..., Tq, Tk]`` in float32.
        """
        c, norm = self.key_parts(slots)
        q = q.float()
        if norm is None:
            return (q @ c.transpose(-1, -2)) * softmax_scale
        q_rot = q @ self.rotation
        return (q_rot @ c.transpose(-1, -2)) * norm.unsqueeze(-2) * softmax_scale

    # -- values ----------------------------------------------------------------------------
    def _value_fields(self, v):
        """(value code bytes, what follows them as fp16 fields: the norm of MSE values, else
        each group's (scale, zero) in slot order ``[..., 2 * groups]``)."""
        if self.preset.value_mse:
            return self._mse_fields(v, self.value_book)
        groups = self.layout.value_groups
        v = v.float().unflatten(-1, (groups, self.head_size // groups))
        codes, scale, lo = tq.quantize_values(v, self.preset.value_bits)  # NaN/inf as vLLM
        packed = pack_codes(codes.flatten(-2), self.preset.value_bits)
        return packed, torch.stack([scale, lo], dim=-1).flatten(-2)

    def decode_values(self, slots: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        code_bytes = slots[..., lay.value_offset : lay.value_params_offset]
        if self.preset.value_mse:
            norm = self._norm_bytes(slots, lay.value_norm_offset)
            c, norm = self._mse_decode(code_bytes, norm, self.value_book)
            return norm.unsqueeze(-1) * (c @ self.rotation)
        codes = unpack_codes(code_bytes, self.preset.value_bits, self.head_size)
        params = slots[..., lay.value_params_offset : lay.slot_size].unflatten(-1, (-1, 4))
        scale, zero = fp16_from_bytes(params[..., 0:2]), fp16_from_bytes(params[..., 2:4])
        codes = codes.float().unflatten(-1, (lay.value_groups, -1))
        return (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)

    # -- slots -----------------------------------------------------------------------------
    def encode(self, k, v, out: torch.Tensor | None = None):
        """Slots ``[..., heads, slot_size_aligned]``. With ``out``, write bytes
        ``[0, slot_size)`` into it and leave the padding bytes as they were."""
        key_codes, key_halves = self._key_fields(k)
        value_codes, value_halves = self._value_fields(v)
        # every fp16 field of the slot in one conversion (a graph's CacheWrite is small tensors
        # through many nodes: one conversion instead of three is a third of its nodes)
        halves = tq.fp16_field(torch.cat([key_halves, value_halves], dim=-1))  # [..., n, 2]
        split = key_halves.shape[-1]
        body = torch.cat(
            [key_codes, halves[..., :split, :].flatten(-2),
             value_codes, halves[..., split:, :].flatten(-2)], dim=-1,
        )  # fmt: skip
        size = self.layout.slot_size
        if out is None:
            out = torch.zeros(*body.shape[:-1], self.layout.slot_size_aligned, dtype=torch.uint8)
        out[..., :size] = body
        return {"kv": out}

    def decode(self, cache):
        slots = cache["kv"]
        return self.decode_keys(slots), self.decode_values(slots)

    def attention_operands(self, cache):
        """MSE keys stay in the rotated basis: the centroid vectors ``c`` (not normalized) with
        ``key_scale = norm / sqrt(<c, c> + eps)`` (norm correction, from the codes) or
        ``norm``, scored against ``q @ H``: ``<q, norm * c_nc @ H> = (q @ H) . c * key_scale``
        (H is orthogonal and symmetric). fp8 keys are decoded. Uniform values stay codes, with
        their per-group fp16 scale and zero; MSE values stay centroids in the rotated basis
        with their scale, the weighted sum rotated back once. Packed codes unpack into parts
        (4 for 2-bit, 2 for 4-bit: the codes of each byte position; 8 for 3-bit), never
        interleaved."""
        slots, lay = cache["kv"], self.layout
        code_bytes = slots[..., : lay.key_code_bytes]
        rotation = key_scale = None
        if self.preset.key_fp8:
            keys = (lookup(_FP8_E4M3_TABLE, code_bytes),)
        else:
            norm_bytes = self._norm_bytes(slots, lay.key_norm_offset)
            keys, key_scale = self._mse_parts(code_bytes, norm_bytes, self.key_book)
            rotation = self.rotation
        value_bytes = slots[..., lay.value_offset : lay.value_params_offset]
        if self.preset.value_mse:
            norm_bytes = self._norm_bytes(slots, lay.value_norm_offset)
            values, value_scale = self._mse_parts(value_bytes, norm_bytes, self.value_book)
            return AttentionOperands(
                keys,
                values,
                key_scale=key_scale,
                query_rotation=rotation,
                value_scale=value_scale.unsqueeze(-1),
                values_finite=True,
                value_rotation=self.rotation,
            )
        if self.preset.value_bits == 4:
            values = nibbles(value_bytes)
        else:
            values = tuple(triplet_codes(value_bytes))
        params = slots[..., lay.value_params_offset : lay.slot_size]
        return AttentionOperands(
            keys,
            values,
            key_scale=key_scale,
            query_rotation=rotation,
            value_scale=fp16_fields(params, self.scale_weights),
            value_zero=fp16_fields(params, self.zero_weights),
            values_finite=True,
        )


class _Codebook:
    """One Lloyd-Max codebook of a TurboQuant codec (keys, or the values of ``_mse`` presets):
    centroids, store thresholds, and for 2- and 4-bit codes the decode-side byte tables (byte
    -> the centroid of each code it packs, bit for bit, and -> their sum of squares)."""

    def __init__(self, head_size: int, bits: int):
        self.bits = bits
        self.centroids = tq.centroids(head_size, bits)
        self.thresholds = tq.thresholds(self.centroids)
        self.byte_parts = self.byte_norm2 = None
        if bits in (2, 4):
            per = 8 // bits
            values = self.centroids[unpack_codes(_EVERY_BYTE[:, None], bits, per).long()]
            self.byte_parts = tuple(values[:, i] for i in range(per))
            self.byte_norm2 = (values * values).sum(-1)
