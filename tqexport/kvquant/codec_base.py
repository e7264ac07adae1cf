"""What every codec is built from: the dtype tables, the tensor format a codec writes, the
byte helpers its decoders share, the attention operands it hands kernels, and the ``Codec``
interface itself (:mod:`~tqexport.kvquant.codecs` holds the codecs and their registry)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tqexport.errors import TQExportError
from tqexport.kvquant.float_bytes import (
    E4M3,
    fp8_decode,
    fp16_from_bytes,
    lookup,
)

MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: every element type a cache tensor or a model input has (quantized data is uint8 bytes)
TENSOR_DTYPES = {**MODEL_DTYPES, "uint8": torch.uint8}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name used in specs to torch (model dtypes, uint8, fp32)."""
    try:
        return TENSOR_DTYPES[name]
    except KeyError:
        raise TQExportError(f"unknown dtype {name!r}; valid: {', '.join(TENSOR_DTYPES)}") from None


@dataclass(frozen=True)
class TensorFormat:
    """One cache tensor a codec writes: ``width`` values per (token, head), or one if None."""

    role: str
    dtype: str
    width: int | None

    @property
    def bytes_per_token_head(self) -> int:
        return (self.width or 1) * torch_dtype(self.dtype).itemsize

    def shape(self, *leading: int) -> tuple[int, ...]:
        return (*leading,) if self.width is None else (*leading, self.width)


CacheTensors = dict[str, torch.Tensor]


def nibbles(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[..., B]`` -> (low, high) 4-bit codes as float32 ``[..., B]`` each: the even and
    the odd elements of :func:`~tqexport.kvquant.packing.unpack_codes` (exact arithmetic)."""
    x = data.to(torch.float32)
    high = torch.floor(x * 0.0625)
    return x - high * 16, high


def triplet_codes(data: torch.Tensor) -> list[torch.Tensor]:
    """uint8 ``[..., 3n]`` 3-bit stream -> 8 float32 ``[..., n]`` tensors, tensor k holding
    codes ``k, k + 8, k + 16, ...`` of :func:`~tqexport.kvquant.packing.unpack_codes` (each
    24-bit word is exact in float32, and so are the power-of-two divisions)."""
    t = data.to(torch.float32).unflatten(-1, (-1, 3))
    word = t[..., 0] + t[..., 1] * 256 + t[..., 2] * 65536
    out = []
    for k in range(8):
        shifted = torch.floor(word * 8.0**-k)
        out.append(shifted - torch.floor(shifted * 0.125) * 8)
    return out


#: the 256 byte values, in order (lookup tables are a function applied to it)
_EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_FP8_E4M3_TABLE = fp8_decode(_EVERY_BYTE, E4M3)
#: fp16_from_bytes of every 16-bit pattern, indexed by ``low byte + 256 * high byte``
_FP16_TABLE = fp16_from_bytes(
    torch.stack([torch.arange(65536) % 256, torch.arange(65536) // 256], dim=-1).to(torch.uint8)
)


def fp16_fields(b: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Little-endian fp16 fields of bytes ``[..., B]`` -> float32 ``[..., n]``, as
    :func:`fp16_from_bytes` gives them but with one table lookup (the table is that function of
    every pattern: identical values). ``weights`` ``[B, n]`` (:func:`fp16_field_weights`) say
    where field j lies (1 at its low byte, 256 at its high byte); default: B = 2n fields in
    order. The pattern is ``bytes @ weights``: exact, small integers in float32.
    """
    if weights is None:
        weights = fp16_field_weights(b.shape[-1], range(0, b.shape[-1], 2))
    pattern = b.to(torch.float32) @ weights
    return lookup(_FP16_TABLE, pattern)


def fp16_field_weights(width: int, offsets) -> torch.Tensor:
    """``[width, n]`` weights for :func:`fp16_fields`: field j's bytes at ``offsets[j]``."""
    offsets = list(offsets)
    w = torch.zeros(width, len(offsets))
    for j, at in enumerate(offsets):
        w[at, j], w[at + 1, j] = 1.0, 256.0
    return w


@dataclass
class AttentionOperands:
    """Cached keys and values in the factored form attention consumes (decode side only).

    Keys and values come as ``parts``: with n parts, part i holds the head's elements
    ``i, i + n, i + 2n, ...`` (packed codes unpack into parts without interleaving them).
    Scores are ``sum_i (q @ query_rotation)[..., i::n] @ keys[i]^T * key_scale`` (rotation and
    scale optional), and the value of a key is ``values * value_scale + value_zero`` per group
    of ``D / groups`` elements, so ``sum_t p_t v_t = (p * s) @ values + p @ z`` needs no
    dequantized V. With ``value_rotation`` the values are in a rotated basis and the weighted
    sum is rotated back once (``sum_t p_t v_t = ((p * s) @ values) @ value_rotation``). With
    ``values_finite`` the values are finite whatever the bytes (codes): a masked key then
    contributes nothing once its scale and zero are zeroed. Shapes: ``keys[i]``/``values[i]``
    ``[..., D / n]``, ``key_scale`` ``[...]``, ``value_scale``/``value_zero`` ``[..., groups]``.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_scale: torch.Tensor | None = None
    query_rotation: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    value_zero: torch.Tensor | None = None
    values_finite: bool = False
    value_rotation: torch.Tensor | None = None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) ``[..., D]`` these operands stand for (for tests; attention never builds
        them)."""
        keys = torch.stack(self.keys, dim=-1).flatten(-2)
        if self.query_rotation is not None:
            keys = keys @ self.query_rotation
        if self.key_scale is not None:
            keys = keys * self.key_scale.unsqueeze(-1)
        values = torch.stack(self.values, dim=-1).flatten(-2)
        if self.value_scale is not None:
            values = values.unflatten(-1, (self.value_scale.shape[-1], -1))
            values = values * self.value_scale.unsqueeze(-1)
            if self.value_zero is not None:
                values = values + self.value_zero.unsqueeze(-1)
            values = values.flatten(-2)
        if self.value_rotation is not None:
            values = values @ self.value_rotation
        return keys, values


class Codec(ABC):
    """Encode/decode of one kv-cache dtype for heads of size ``head_size``."""

    head_size: int

    @property
    @abstractmethod
    def tensors(self) -> tuple[TensorFormat, ...]: ...

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> CacheTensors:
        """K, V ``[..., heads, D]`` -> cache tensors keyed by role."""

    @abstractmethod
    def decode(self, cache: CacheTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache tensors -> (K, V) as float32 ``[..., heads, D]``."""

    def attention_operands(self, cache: CacheTensors) -> AttentionOperands:
        """Cache tensors -> the :class:`AttentionOperands` attention reads (default: the
        decoded K and V)."""
        keys, values = self.decode(cache)
        return AttentionOperands((keys,), (values,))

    @property
    def bytes_per_token_head(self) -> int:
        """K and V bytes, metadata included, for one token of one kv head."""
        return sum(t.bytes_per_token_head for t in self.tensors)
