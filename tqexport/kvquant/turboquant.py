"""TurboQuant presets, the vLLM-compatible slot byte layout, codebooks and the Hadamard rotation.

This module is the single home of the slot layout: the reference codec, kernels, ONNX bodies,
TensorRT plugins and cache sizing all derive offsets from :class:`SlotLayout`.

Layout of one (token, kv-head) slot, little-endian, D = head size:

- MSE keys: ``ceil(D*kbits/8)`` bytes of packed centroid indices, then ``||k||_2`` as fp16.
- FP8 keys (k8v4): ``D`` bytes, the key as fp8 e4m3, unscaled and unrotated.
- then ``ceil(D*vbits/8)`` bytes of packed value codes, fp16 scale, fp16 zero (= min).
- then padding up to an even size (never read, never written by a cache write).

tqexport-native presets (``tqx_*``, never vLLM names) use the same layout with one of two
changes to the values:

- ``_g32``: values are quantized in groups of ``value_group`` elements, each with its own fp16
  scale and fp16 zero, stored as (scale, zero) pairs in group order where vLLM's one pair sits.
- ``_mse``: values are quantized like MSE keys (the Hadamard-rotated unit vector as Lloyd-Max
  codes of ``value_bits``, then ``||v||_2`` as fp16 where vLLM's scale and zero sit; read back
  norm-corrected). Attention applies them in the rotated basis and rotates its output once.
  2-bit codes pack four to a byte, lowest bits first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from tqexport.errors import TQExportError
from tqexport.kvquant.float_bytes import E4M3, fp8_encode, fp16_bytes, lookup
from tqexport.kvquant.packing import packed_bytes

#: Bumped whenever the byte layout below changes; recorded in every spec.
LAYOUT_VERSION = 1
LAYOUT_DESCRIPTION = (
    "vLLM block-major [blocks, block_size, heads, slot], fp16 norm, pure Hadamard, "
    "fp32 midpoints of the fp32 centroid table"
)
#: Name of the codebook the presets use (vLLM's trapezoid Lloyd-Max solution for N(0, 1/D)).
VLLM_CODEBOOK = "lloyd-max-gaussian-trapezoid-v1"


@dataclass(frozen=True)
class TurboQuantPreset:
    """Bit split of one TurboQuant preset. ``key_bits == 8`` means fp8 e4m3 keys."""

    name: str
    key_bits: int
    value_bits: int
    norm_correction: bool
    #: values per (scale, zero) pair; 0 = the whole head (vLLM's presets)
    value_group: int = 0
    #: values quantized like MSE keys (rotated, Lloyd-Max codes, fp16 norm) instead of uniform
    value_mse: bool = False

    @property
    def native(self) -> bool:
        """A tqexport-native preset (not a vLLM layout)."""
        return not self.name.startswith("turboquant_")

    @property
    def vllm_twin(self) -> str | None:
        """The vLLM preset whose slot layout this native one shares byte for byte (None for
        vLLM presets and native layouts of their own). A twin exists so that keys may be
        transformed (:mod:`tqexport.kvquant.transforms`) without claiming to be vLLM's cache."""
        if not self.native or self.value_group or self.value_mse:
            return None
        bits = (self.key_bits, self.value_bits, self.norm_correction)
        return next(
            (p.name for p in PRESETS.values() if not p.native
             and (p.key_bits, p.value_bits, p.norm_correction) == bits),
            None,
        )  # fmt: skip

    @property
    def key_fp8(self) -> bool:
        return self.key_bits == 8

    @property
    def needs_power_of_two_head(self) -> bool:
        return not self.key_fp8 or self.value_mse


PRESETS: dict[str, TurboQuantPreset] = {
    p.name: p
    for p in (
        TurboQuantPreset("turboquant_k8v4", 8, 4, False),
        TurboQuantPreset("turboquant_4bit_nc", 4, 4, True),
        TurboQuantPreset("turboquant_k3v4_nc", 3, 4, True),
        TurboQuantPreset("turboquant_3bit_nc", 3, 3, True),
        # tqexport-native: finer value groups, and 4-bit keys with 3-bit grouped values
        TurboQuantPreset("tqx_k4v4_g32", 4, 4, True, value_group=32),
        TurboQuantPreset("tqx_k4v3_g32", 4, 3, True, value_group=32),
        # tqexport-native twins of vLLM layouts, for transformed keys
        TurboQuantPreset("tqx_k4v4", 4, 4, True),
        TurboQuantPreset("tqx_k3v3", 3, 3, True),
        # tqexport-native: values quantized like keys (rotated, Lloyd-Max, fp16 norm)
        TurboQuantPreset("tqx_k4v3_mse", 4, 3, True, value_mse=True),
        TurboQuantPreset("tqx_k4v2_mse", 4, 2, True, value_mse=True),
        TurboQuantPreset("tqx_k3v2_mse", 3, 2, True, value_mse=True),
    )
}


def preset(name: str) -> TurboQuantPreset:
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(PRESETS)
        raise TQExportError(f"unknown TurboQuant preset {name!r}; valid: {valid}") from None


def vllm_twin(kv_cache_dtype: str) -> str | None:
    """The vLLM dtype whose slot layout a native twin shares (None for any other name)."""
    p = PRESETS.get(kv_cache_dtype)
    return None if p is None else p.vllm_twin


def check_head_size(p: TurboQuantPreset, head_size: int) -> None:
    """Raise a clear error when a preset cannot store heads of this size."""
    if head_size < 8:
        raise TQExportError(f"{p.name} needs head_size >= 8, got {head_size}")
    if p.needs_power_of_two_head and head_size & (head_size - 1):
        raise TQExportError(
            f"{p.name} rotates keys with a Hadamard matrix and needs a power-of-two head size, "
            f"got {head_size}; use turboquant_k8v4 (fp8 keys, no rotation) or skip these layers"
        )
    if p.value_bits == 3 and head_size % 8:
        raise TQExportError(f"{p.name} packs 3-bit values and needs head_size % 8 == 0")
    if p.value_bits == 2 and head_size % 4:
        raise TQExportError(f"{p.name} packs 2-bit values and needs head_size % 4 == 0")
    if p.value_group and head_size % p.value_group:
        raise TQExportError(
            f"{p.name} quantizes values in groups of {p.value_group} and needs a head size "
            f"divisible by it, got {head_size}"
        )


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of one (token, kv-head) slot for a preset and head size."""

    preset: TurboQuantPreset
    head_size: int

    @property
    def key_code_bytes(self) -> int:
        if self.preset.key_fp8:
            return self.head_size
        return packed_bytes(self.head_size, self.preset.key_bits)

    @property
    def key_norm_offset(self) -> int | None:
        """Offset of the fp16 key norm (MSE keys only)."""
        return None if self.preset.key_fp8 else self.key_code_bytes

    @property
    def key_packed_bytes(self) -> int:
        return self.key_code_bytes + (0 if self.preset.key_fp8 else 2)

    @property
    def value_offset(self) -> int:
        return self.key_packed_bytes

    @property
    def value_code_bytes(self) -> int:
        return packed_bytes(self.head_size, self.preset.value_bits)

    @property
    def value_groups(self) -> int:
        """(scale, zero) pairs per slot: 1 for vLLM presets (and the one norm of MSE values)."""
        return self.head_size // self.preset.value_group if self.preset.value_group else 1

    @property
    def value_params_offset(self) -> int:
        """Where the value's fp16 fields start: its (scale, zero) pairs, or its norm."""
        return self.value_offset + self.value_code_bytes

    @property
    def value_scale_offset(self) -> int | None:
        """Offset of group 0's fp16 scale; group g's is at ``+ 4 * g`` (None: MSE values)."""
        return None if self.preset.value_mse else self.value_params_offset

    @property
    def value_zero_offset(self) -> int | None:
        """Offset of group 0's fp16 zero; group g's is at ``+ 4 * g`` (None: MSE values)."""
        return None if self.preset.value_mse else self.value_params_offset + 2

    @property
    def value_norm_offset(self) -> int | None:
        """Offset of the fp16 value norm (MSE values only)."""
        return self.value_params_offset if self.preset.value_mse else None

    @property
    def slot_size(self) -> int:
        """Bytes a cache write touches."""
        params = 2 if self.preset.value_mse else 4 * self.value_groups
        return self.value_params_offset + params

    @property
    def slot_size_aligned(self) -> int:
        """Bytes one slot occupies in the cache (rounded up to even, as vLLM)."""
        return self.slot_size + self.slot_size % 2

    def describe(self) -> dict:
        """The layout as recorded in the spec (every offset, so consumers need no code)."""
        return {
            "preset": self.preset.name,
            "layout_version": LAYOUT_VERSION,
            "layout": LAYOUT_DESCRIPTION,
            "codebook": VLLM_CODEBOOK,
            "key_bits": self.preset.key_bits,
            "value_bits": self.preset.value_bits,
            "norm_correction": self.preset.norm_correction,
            "key_fp8": self.preset.key_fp8,
            "key_code_bytes": self.key_code_bytes,
            "key_norm_offset": self.key_norm_offset,
            "value_offset": self.value_offset,
            "value_code_bytes": self.value_code_bytes,
            "value_scale_offset": self.value_scale_offset,
            "value_zero_offset": self.value_zero_offset,
            "slot_size": self.slot_size,
            "slot_size_aligned": self.slot_size_aligned,
        } | (
            {"value_group": self.preset.value_group, "value_groups": self.value_groups,
             "value_params": "(fp16 scale, fp16 zero) per group, group order"}
            if self.preset.value_group
            else {}
        ) | (
            {"value_quantizer": "mse", "value_norm_offset": self.value_norm_offset,
             "value_params": "fp16 ||v||_2 of the rotated unit vector's Lloyd-Max codes"}
            if self.preset.value_mse
            else {}
        )  # fmt: skip


def slot_layout(name: str, head_size: int) -> SlotLayout:
    return SlotLayout(preset(name), head_size)


@lru_cache(maxsize=16)
def _hadamard(head_size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(head_size)).to(torch.float32)


def hadamard(head_size: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard H_D / sqrt(D): symmetric, orthonormal, no random signs."""
    if head_size <= 0 or head_size & (head_size - 1):
        raise TQExportError(f"Hadamard rotation needs a power-of-two size, got {head_size}")
    return _hadamard(head_size).clone()


def _vllm_trapezoid(f, a: float, b: float, n: int = 200) -> float:
    # Sequential accumulation in float64, in the same order as vLLM's solver, so the fp32
    # centroid table comes out bit-identical.
    h = (b - a) / n
    total = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        total += f(a + i * h)
    return total * h


@lru_cache(maxsize=64)
def _gaussian_centroids(head_size: int, bits: int) -> tuple[float, ...]:
    levels = 2**bits
    var = 1.0 / head_size
    sigma = math.sqrt(var)
    norm_const = 1.0 / math.sqrt(2 * math.pi * var)

    def pdf(x: float) -> float:
        return norm_const * math.exp(-x * x / (2 * var))

    def xpdf(x: float) -> float:
        return x * pdf(x)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    cents = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        mids = [(cents[i] + cents[i + 1]) / 2.0 for i in range(levels - 1)]
        edges = [3 * lo, *mids, 3 * hi]
        new = []
        for i in range(levels):
            den = _vllm_trapezoid(pdf, edges[i], edges[i + 1])
            num = _vllm_trapezoid(xpdf, edges[i], edges[i + 1])
            new.append(num / den if den > 1e-15 else cents[i])
        if max(abs(n - c) for n, c in zip(new, cents, strict=True)) < 1e-10:
            break  # like vLLM: the final (sub-tolerance) update is not adopted
        cents = new
    return tuple(cents)


@lru_cache(maxsize=64)
def _beta_centroids(head_size: int, bits: int) -> tuple[float, ...]:
    """Lloyd-Max for the exact marginal of one coordinate of a random unit vector in R^D."""
    levels = 2**bits
    d = head_size
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    grid = np.linspace(-1.0, 1.0, 400_001)
    with np.errstate(divide="ignore"):  # the pdf is exactly 0 at +-1
        pdf = np.exp(log_c + (d - 3) / 2 * np.log1p(-(grid * grid)))
    cdf0 = np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) * 0.5 * np.diff(grid))])
    xpdf = grid * pdf
    cdf1 = np.concatenate([[0.0], np.cumsum((xpdf[1:] + xpdf[:-1]) * 0.5 * np.diff(grid))])
    sigma = 1.0 / math.sqrt(d)
    cents = np.linspace(-3.5 * sigma, 3.5 * sigma, levels + 1)
    cents = (cents[:-1] + cents[1:]) / 2
    for _ in range(2000):
        edges = np.concatenate([[-1.0], (cents[:-1] + cents[1:]) / 2, [1.0]])
        m0 = np.diff(np.interp(edges, grid, cdf0))
        m1 = np.diff(np.interp(edges, grid, cdf1))
        new = np.where(m0 > 1e-300, m1 / np.maximum(m0, 1e-300), cents)
        if np.max(np.abs(new - cents)) < 1e-13:
            cents = new
            break
        cents = new
    return tuple(float(c) for c in cents)


CODEBOOK_DISTRIBUTIONS = ("gaussian", "beta")


def centroids(head_size: int, bits: int, distribution: str = "gaussian") -> torch.Tensor:
    """Sorted fp32 Lloyd-Max centroids for rotated unit-vector coordinates.

    ``gaussian`` is vLLM's table (N(0, 1/D), trapezoid rule): the presets use it for byte
    parity. ``beta`` is the exact finite-D marginal, kept to measure what the approximation costs.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits must be 1..8, got {bits}")
    if distribution == "gaussian":
        table = _gaussian_centroids(head_size, bits)
    elif distribution == "beta":
        table = _beta_centroids(head_size, bits)
    else:
        raise ValueError(
            f"unknown codebook distribution {distribution!r}: {CODEBOOK_DISTRIBUTIONS}"
        )
    return torch.tensor(table, dtype=torch.float64).to(torch.float32)


def thresholds(cents: torch.Tensor) -> torch.Tensor:
    """Store-time decision thresholds: fp32 midpoints of the fp32 centroid table."""
    return (cents[:-1] + cents[1:]) / 2


def centroid_index(y: torch.Tensor, thresh: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the centroid for rotated coordinates: how many of the 2^bits - 1
    sorted thresholds are <= y (ties up), by binary search as vLLM's store kernel. A NaN
    coordinate compares false with every threshold: index 0. (Each step is a few ONNX nodes:
    a third of what ``torch.bucketize`` exports to, for the tiny tensors of a decode write.)"""
    idx = torch.zeros_like(y, dtype=torch.int64)
    step = (thresh.numel() + 1) // 2
    while step:
        idx = torch.where(y >= lookup(thresh, idx + (step - 1)), idx + step, idx)
        step //= 2
    return idx


# ---------------------------------------------------------------------------------------------
# Store rules for NaN and inf, those of vLLM's store kernel (checked by `make vllm-parity`).
# Finite inputs are unaffected. fp16 fields (norm, scale, zero) store a NaN as FP16_NAN and
# +-inf as +-inf; fp8 keys store NaN as E4M3_NAN and saturate +-inf to +-448.

#: fp16 bits of a NaN norm/scale/zero: the quiet NaN that fp32 NaN rounds to (sign dropped).
FP16_NAN = 0x7E00
#: e4m3 bits of a NaN key element: the canonical NaN of the GPU's saturating cast (sign dropped).
E4M3_NAN = 0x7F
#: smallest stored value scale; a NaN scale (an all-NaN head) is stored as this too.
VALUE_MIN_SCALE = 1e-8


def fp16_field(x: torch.Tensor) -> torch.Tensor:
    """[...] float -> [..., 2] little-endian fp16 bytes, NaN as :data:`FP16_NAN`."""
    b = fp16_bytes(x)
    nan = x.isnan()
    lo = torch.where(nan, FP16_NAN & 255, b[..., 0])
    return torch.stack([lo, torch.where(nan, FP16_NAN >> 8, b[..., 1])], dim=-1)


def fp8_key_bytes(k: torch.Tensor) -> torch.Tensor:
    """e4m3 key bytes (saturating, nearest even), NaN as :data:`E4M3_NAN`."""
    return torch.where(k.isnan(), E4M3_NAN, fp8_encode(k, E4M3))


def value_range(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over the last dim ignoring NaN elements; NaN for an all-NaN vector."""
    nan = v.isnan()
    inf = torch.full_like(v, float("inf"))
    lo = torch.where(nan, inf, v).amin(-1)
    hi = torch.where(nan, -inf, v).amax(-1)
    none = nan.all(-1)
    return torch.where(none, float("nan"), lo), torch.where(none, float("nan"), hi)


def quantize_values(v: torch.Tensor, bits: int):
    """Uniform codes ``[..., n]`` (float, 0..2^bits-1), scale and zero (= min) ``[...]``.

    ``code = clamp(floor((v - min) / scale + 1/2))``, ``scale = max((max - min) / levels, 1e-8)``
    where a NaN scale becomes 1e-8 and a NaN code 0 (vLLM's comparisons and int conversion).
    """
    levels = 2**bits - 1
    lo, hi = value_range(v)
    scale = (hi - lo) / levels
    scale = torch.where(scale > VALUE_MIN_SCALE, scale, VALUE_MIN_SCALE)
    codes = ((v - lo.unsqueeze(-1)) / scale.unsqueeze(-1) + 0.5).floor()
    codes = torch.where(codes.isnan(), 0.0, codes).clamp(0, levels)
    return codes, scale, lo
