"""How one layer's paged cache is stored (vLLM's ``KVCacheSpec``): full or sliding attention,
the dtype, heads and block size, and everything derived from them (codec, bytes, tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tqexport.kvquant.codecs import MAX_HEAD_SIZE, Codec, TensorFormat, codec_for
from tqexport.kvquant.modes import KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.turboquant import SlotLayout
from tqexport.spec.limits import MAX_KV_HEADS, MAX_WINDOW, MODEL_DTYPE_NAMES, SpecError
from tqexport.spec.reading import positive, show
from tqexport.validate import MAX_BLOCK_SIZE, MAX_RECENT_WINDOW


class AttentionType(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """How one layer's paged cache is stored. The quant mode is derived from the dtype name,
    so a TurboQuant spec cannot exist without its mode (vLLM's first seed bug)."""

    kv_cache_dtype: str
    num_kv_heads: int
    head_size: int
    block_size: int
    model_dtype: str
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        check_size("num_kv_heads", self.num_kv_heads, MAX_KV_HEADS)
        check_size("head_size", self.head_size, MAX_HEAD_SIZE)
        check_size("block_size", self.block_size, MAX_BLOCK_SIZE)
        if self.model_dtype not in MODEL_DTYPE_NAMES:
            raise SpecError(
                f"model_dtype must be one of {', '.join(MODEL_DTYPE_NAMES)}, "
                f"got {show(self.model_dtype)}"
            )
        for name in ("k_scale", "v_scale"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not positive(x):
                raise SpecError(f"{name} must be a finite positive number, got {show(x)}")
        _ = self.codec  # validates the dtype name and head size now, not at first use
        if not self.mode.uses_layer_scales and (self.k_scale, self.v_scale) != (1.0, 1.0):
            raise SpecError(f"{self.kv_cache_dtype} caches take no per-layer k/v scales")

    attention_type = AttentionType.FULL

    @property
    def window(self) -> int | None:
        return None

    @cached_property
    def codec(self) -> Codec:
        return codec_for(
            self.kv_cache_dtype, self.head_size, self.model_dtype, self.k_scale, self.v_scale
        )

    @property
    def mode(self) -> KVQuantMode:
        return parse_kv_cache_dtype(self.kv_cache_dtype).mode

    @property
    def storage_dtype(self) -> str:
        """dtype of the K/V data tensors (uint8 bytes for every quantized mode)."""
        return self.tensors[0].dtype

    @property
    def tensors(self) -> tuple[TensorFormat, ...]:
        return self.codec.tensors

    @property
    def turboquant(self) -> SlotLayout | None:
        return getattr(self.codec, "layout", None)

    @property
    def bytes_per_token_head(self) -> int:
        return self.codec.bytes_per_token_head

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_head * self.num_kv_heads

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer, all its cache tensors together."""
        return self.bytes_per_token * self.block_size

    def tensor_shapes(self, num_blocks: int) -> dict[str, tuple[int, ...]]:
        """Shape of every cache tensor: ``[num_blocks, block_size, num_kv_heads(, X)]``."""
        lead = (num_blocks, self.block_size, self.num_kv_heads)
        return {t.role: t.shape(*lead) for t in self.tensors}

    @property
    def constants(self) -> dict[str, Any]:
        """Constants a consumer needs besides the bytes: scales, TurboQuant layout."""
        mode = self.mode
        if mode.uses_layer_scales:
            return {"k_scale": self.k_scale, "v_scale": self.v_scale}
        if mode.is_turboquant:
            return self.turboquant.describe()
        if mode.is_per_token_head:
            return {"min_scale": 1e-6}
        return {}


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(KVCacheSpec):
    """Cache of a layer whose queries see every earlier token."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(KVCacheSpec):
    """Cache of a layer whose queries see the last ``sliding_window`` tokens (self included)."""

    sliding_window: int
    attention_type = AttentionType.SLIDING_WINDOW

    def __post_init__(self):
        check_size("sliding_window", self.sliding_window, MAX_WINDOW)
        super().__post_init__()

    @property
    def window(self) -> int | None:
        return self.sliding_window


def check_size(name: str, value: Any, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise SpecError(f"{name} must be an integer in 1..{hi}, got {show(value)}")


def cache_spec(window: int | None, **kw) -> KVCacheSpec:
    """FullAttentionSpec for ``window=None``, else SlidingWindowSpec."""
    if window is None:
        return FullAttentionSpec(**kw)
    return SlidingWindowSpec(sliding_window=window, **kw)


RECENT_PREFIX = "recent_"


def recent_spec(cache: KVCacheSpec, window: int) -> SlidingWindowSpec:
    """The full-precision (model dtype) sliding cache that holds a layer's recent window."""
    check_size("recent window", window, MAX_RECENT_WINDOW)
    return SlidingWindowSpec(
        kv_cache_dtype="auto",
        sliding_window=window,
        num_kv_heads=cache.num_kv_heads,
        head_size=cache.head_size,
        block_size=cache.block_size,
        model_dtype=cache.model_dtype,
    )


def recent_label(window: int, sink_tokens: int, group: int | None) -> str:
    """How tables show a layer's recent cache: ``-``, ``32 (group 2)``, ``32 + first 4 (group
    2)`` (the recent window, then the sink tokens it also holds)."""
    if not window:
        return "-"
    sinks = f" + first {sink_tokens}" if sink_tokens else ""
    return f"{window}{sinks} (group {group})"
