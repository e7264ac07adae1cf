"""Exact key transforms: a layer stores ``k' = (k - center) * scale`` and scores ``q' = q / scale``.

``q' . k' = q . k - q . center`` for every key a query reads: one constant shift per query, which
softmax ignores, so attention is unchanged up to rounding while the cache holds keys that
quantize better. Three kinds, all folded into one center and one signed scale vector per
(kv head, channel):

- ``center``: the mean post-RoPE key, calibrated on text (each window's first
  :data:`SINK_POSITIONS` tokens left out: attention sinks carry extreme keys). It removes the
  offset every key shares, which inflates the norm the codec's error scales with. A score
  softcap (``tanh``) is not shift-invariant, so softcapped layers refuse it.
- ``smooth``: positive per-channel scales ``s = (E[q^2] / E[k'^2]) ** (1/4)`` (geometric mean 1
  per head). The codec's error is about isotropic after its Hadamard rotation with a variance
  proportional to ``||k'||^2``, so a score's error goes with ``E||q/s||^2 * E||k*s||^2``; this
  ``s`` minimises it (Cauchy-Schwarz) by giving each channel equal key and query energy.
- ``signs``: seeded random +-1 per channel ahead of the codec's Hadamard, a randomized rotation.

Every write of the layer (its own cache and its recent window) stores the transformed key, so
both segments are shifted alike. The transform runs in the graph ahead of the cache ops (two
elementwise nodes), so kernels, function bodies and plugins store the slot layout unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from tqexport.errors import TQExportError

KINDS = ("center", "smooth", "signs")
#: Bumped whenever the meaning of a stored transform changes; recorded in every spec.
VERSION = 1
#: calibration ignores each window's first tokens (attention sinks carry extreme keys)
SINK_POSITIONS = 4
#: the smoothing scales are clamped to [1/MAX_SMOOTH, MAX_SMOOTH]
MAX_SMOOTH = 16.0
DEFAULT_SEED = 0
NONE = "none"


def parse_key_transform(text: str) -> tuple[str, ...]:
    """``none`` or kinds joined by ``+`` (e.g. ``center+smooth``), in :data:`KINDS` order."""
    if text == NONE:
        return ()
    parts = text.split("+")
    bad = [p for p in parts if p not in KINDS]
    if bad or len(set(parts)) != len(parts):
        raise TQExportError(
            f"--kv-key-transform {text!r}: use none or kinds joined by '+' from "
            f"{', '.join(KINDS)} (each once), e.g. center+smooth"
        )
    return tuple(k for k in KINDS if k in parts)


def needs_text(kinds: tuple[str, ...]) -> bool:
    """Whether fitting ``kinds`` reads calibration text (``signs`` alone needs none)."""
    return "center" in kinds or "smooth" in kinds


def key_transform_label(kinds: tuple[str, ...]) -> str:
    return "+".join(kinds) or NONE


def refusal(kinds: tuple[str, ...], native_turboquant: bool, softcap: float | None) -> str | None:
    """Why a layer cannot take these kinds (None = it can). The one policy resolve and the
    spec loader share."""
    if not kinds:
        return None
    if not native_turboquant:
        return (
            "key transforms need a tqexport-native TurboQuant dtype (tqx_*); vLLM's caches "
            "store plain keys. Use e.g. tqx_k4v4, the layout of turboquant_4bit_nc"
        )
    if "center" in kinds and softcap:
        return (
            "centering is not exact under a score softcap (tanh is not shift-invariant); "
            "use smooth and/or signs on this model"
        )
    return None


@dataclass(frozen=True)
class KeyTransform:
    """One layer's transform: ``center`` and ``scale`` are [num_kv_heads * head_size] floats
    (each exactly a float32), ``None`` when the kinds need none."""

    kinds: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    center: tuple[float, ...] | None = None
    scale: tuple[float, ...] | None = None
    seed: int | None = None
    _arrays: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        n = self.num_kv_heads * self.head_size
        if not self.kinds or tuple(k for k in KINDS if k in self.kinds) != self.kinds:
            raise TQExportError(
                f"key transform kinds {self.kinds} are not an ordered set of {KINDS}"
            )
        if ("center" in self.kinds) != (self.center is not None):
            raise TQExportError("a key transform has a center exactly when 'center' is a kind")
        scaled = "smooth" in self.kinds or "signs" in self.kinds
        if scaled != (self.scale is not None):
            raise TQExportError(
                "a key transform has a scale exactly when smooth or signs is a kind"
            )
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise TQExportError(
                f"key transform seed must be a non-negative integer, got {self.seed!r}"
            )
        if ("signs" in self.kinds) != (self.seed is not None):
            raise TQExportError("a key transform has a seed exactly when 'signs' is a kind")
        for name, values in (("center", self.center), ("scale", self.scale)):
            if values is None:
                continue
            if len(values) != n:
                raise TQExportError(f"key transform {name} has {len(values)} values, not {n}")
            if not all(math.isfinite(x) for x in values):
                raise TQExportError(f"key transform {name} holds a non-finite value")
        if self.scale is not None and any(x == 0 for x in self.scale):
            raise TQExportError("key transform scale holds a zero")

    def arrays(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(center, scale) as [kvh, D] float32 arrays (None where absent); the inverse scale
        the query takes is computed once with them."""
        if not self._arrays:
            shape = (self.num_kv_heads, self.head_size)
            c = None if self.center is None else np.asarray(self.center, np.float32).reshape(shape)
            s = None if self.scale is None else np.asarray(self.scale, np.float32).reshape(shape)
            self._arrays.update(center=c, scale=s, inv=None if s is None else 1.0 / s)
        return self._arrays["center"], self._arrays["scale"]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H, D] query and [T, KVH, D] key -> the transformed pair."""
        center, scale = self.arrays()
        if center is not None:
            k = k - torch.tensor(center, dtype=k.dtype, device=k.device)
        if scale is not None:
            k = k * torch.tensor(scale, dtype=k.dtype, device=k.device)
            group = q.shape[1] // self.num_kv_heads
            inv = np.repeat(self._arrays["inv"], group, axis=0)
            q = q * torch.tensor(inv, dtype=q.dtype, device=q.device)
        return q, k

    def to_dict(self) -> dict:
        return {
            "version": VERSION,
            "kinds": list(self.kinds),
            "seed": self.seed,
            "center": None if self.center is None else list(self.center),
            "scale": None if self.scale is None else list(self.scale),
        }


class KeyStats:
    """Running per-(kv head, channel) sums of one layer's post-RoPE keys and of its queries'
    squares (averaged over each kv head's query heads), sink positions left out."""

    def __init__(self):
        self.count = 0
        self.k_sum = self.k_sq = self.q_sq = None

    def add(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        keep = positions >= SINK_POSITIONS
        if not bool(keep.any()):
            return
        k = k[keep].double()
        q = q[keep].double()
        kvh = k.shape[1]
        q2 = (q * q).reshape(q.shape[0], kvh, -1, q.shape[-1]).mean(2)
        sums = (k.sum(0), (k * k).sum(0), q2.sum(0))
        if self.k_sum is None:
            self.k_sum, self.k_sq, self.q_sq = sums
        else:
            self.k_sum, self.k_sq, self.q_sq = (
                a + b for a, b in zip((self.k_sum, self.k_sq, self.q_sq), sums, strict=True)
            )
        self.count += k.shape[0]


def fit(
    kinds: tuple[str, ...],
    stats: KeyStats | None,
    layer_index: int,
    seed: int = DEFAULT_SEED,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
) -> KeyTransform:
    """The layer's transform from its calibration statistics (``signs`` alone needs none)."""
    calibrated = "center" in kinds or "smooth" in kinds
    if calibrated and (stats is None or stats.count == 0):
        raise TQExportError(
            f"layer {layer_index}: no calibration tokens past the first {SINK_POSITIONS} "
            "positions; use a longer --calibration-text"
        )
    if stats is not None and stats.count:
        num_kv_heads, head_size = stats.k_sum.shape
    shape = (num_kv_heads, head_size)
    center = scale = None
    mean = np.zeros(shape)
    if stats is not None and stats.count:
        mean = (stats.k_sum / stats.count).numpy()
    if "center" in kinds:
        center = mean.astype(np.float32)
    s = np.ones(shape)
    if "smooth" in kinds:
        k2 = (stats.k_sq / stats.count).numpy()
        if center is not None:
            k2 = k2 - mean * mean
        q2 = (stats.q_sq / stats.count).numpy()
        tiny = 1e-12
        s = ((q2 + tiny) / (np.maximum(k2, 0) + tiny)) ** 0.25
        s = s / np.exp(np.log(s).mean(axis=1, keepdims=True))
        s = np.clip(s, 1 / MAX_SMOOTH, MAX_SMOOTH)
    if "signs" in kinds:
        rng = np.random.default_rng([seed, layer_index])
        s = s * rng.choice(np.array([-1.0, 1.0]), size=shape)
    if "smooth" in kinds or "signs" in kinds:
        scale = s.astype(np.float32)
    return KeyTransform(
        kinds,
        num_kv_heads,
        head_size,
        center=None if center is None else tuple(float(x) for x in center.ravel()),
        scale=None if scale is None else tuple(float(x) for x in scale.ravel()),
        seed=seed if "signs" in kinds else None,
    )


def from_dict(d: dict, num_kv_heads: int, head_size: int) -> KeyTransform:
    """A stored transform (type-checked by the caller's schema reader) for a layer's shape."""
    if d.get("version") != VERSION:
        raise TQExportError(
            f"key transform version {d.get('version')!r} is not {VERSION}, the one this "
            "tqexport reads"
        )
    kinds = parse_key_transform("+".join(d["kinds"]) if d["kinds"] else NONE)

    def floats(name):
        v = d.get(name)
        return None if v is None else tuple(float(x) for x in v)

    return KeyTransform(
        kinds, num_kv_heads, head_size, floats("center"), floats("scale"), d.get("seed")
    )
