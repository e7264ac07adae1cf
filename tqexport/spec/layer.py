"""One attention layer's spec: its cache, recent-window cache, group and key transform, and the
cache bindings every consumer iterates."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tqexport.kvquant.codecs import TensorFormat
from tqexport.kvquant.modes import KVQuantMode
from tqexport.kvquant.transforms import KeyTransform
from tqexport.spec.cache import RECENT_PREFIX, AttentionType, KVCacheSpec
from tqexport.spec.graph_io import symbolic_shape

#: why resolve leaves a layer unquantized (``skipped_by``): boundary protection or a pattern
SKIP_BOUNDARY = "turboquant boundary"
SKIP_PATTERN_PREFIX = "--skip-layers "


@dataclass(frozen=True)
class CacheBinding:
    """One paged cache a layer writes and attends over: the prefix of its tensors' graph roles,
    the cache group whose block table pages it, and the spec of what it stores (a group spec
    carries what it pages, as vLLM's ``KVCacheGroupSpec`` does)."""

    prefix: str
    group: int
    cache: KVCacheSpec

    @property
    def tensors(self) -> tuple[tuple[str, TensorFormat], ...]:
        """(graph role, format) of each cache tensor, in graph order."""
        return tuple((self.prefix + t.role, t) for t in self.cache.tensors)

    @property
    def blocks_dim(self) -> str:
        """The graph's symbolic name for this cache's block count."""
        return f"num_{self.prefix}blocks"

    def tensor_shapes(self, num_blocks: int) -> dict[str, tuple[int, ...]]:
        """Shape of every cache tensor by graph role."""
        shapes = self.cache.tensor_shapes(num_blocks)
        return {self.prefix + role: shape for role, shape in shapes.items()}


@dataclass(frozen=True)
class LayerSpec:
    """Everything about one attention layer that a consumer may need."""

    index: int
    module: str
    cache: KVCacheSpec
    scale: float
    softcap: float | None = None
    group: int = 0
    skipped_by: str | None = None
    #: full-precision cache of the last ``recent.window`` tokens (the recent window), or None
    recent: KVCacheSpec | None = None
    recent_group: int | None = None
    #: exact transform of every key this layer stores (and of its queries), or None
    key_transform: KeyTransform | None = None
    #: the first ``sink_tokens`` tokens of a sequence, also kept in the recent cache (whose
    #: group never frees their blocks) and read from there: the keys most heads lean on
    sink_tokens: int = 0

    @property
    def recent_window(self) -> int:
        """Tokens each query reads from the full-precision recent cache (0 = none)."""
        return self.recent.window if self.recent is not None else 0

    @cached_property
    def bindings(self) -> tuple[CacheBinding, ...]:
        """The layer's caches in graph order: its own, then its recent window's (tensors
        ``recent_<role>``, paged by the recent group). Every consumer iterates these."""
        own = CacheBinding("", self.group, self.cache)
        if self.recent is None:
            return (own,)
        return own, CacheBinding(RECENT_PREFIX, self.recent_group, self.recent)

    @property
    def cache_tensors(self) -> list[tuple[str, TensorFormat, CacheBinding]]:
        """(graph role, format, binding) of every cache tensor of this layer, in graph order."""
        return [(role, t, b) for b in self.bindings for role, t in b.tensors]

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id costs in this layer, over all its cache tensors."""
        return sum(b.cache.page_size_bytes for b in self.bindings)

    @property
    def attention_type(self) -> AttentionType:
        return self.cache.attention_type

    @property
    def window(self) -> int | None:
        return self.cache.window

    @property
    def kv_cache_dtype(self) -> str:
        return self.cache.kv_cache_dtype

    @property
    def mode(self) -> KVQuantMode:
        return self.cache.mode

    def onnx_input(self, role: str) -> str:
        return f"cache.{self.index}.{role}"

    def onnx_output(self, role: str) -> str:
        return f"cache_out.{self.index}.{role}"

    def to_dict(self) -> dict[str, Any]:
        c = self.cache
        return (
            {
                "index": self.index,
                "module": self.module,
                "attention_type": self.attention_type.value,
                "window": self.window,
                "scale": self.scale,
                "softcap": self.softcap,
                "kv_cache_dtype": c.kv_cache_dtype,
                "quant_mode": c.mode.name,
                "storage_dtype": c.storage_dtype,
                "model_dtype": c.model_dtype,
                "num_kv_heads": c.num_kv_heads,
                "head_size": c.head_size,
                "block_size": c.block_size,
                "bytes_per_token_head": c.bytes_per_token_head,
                "page_size_bytes": c.page_size_bytes,
                "group": self.group,
                "skipped_by": self.skipped_by,
                "tensors": [self._tensor_dict(role, t, b) for role, t, b in self.cache_tensors],
                "constants": c.constants,
            }
            | ({} if self.recent is None else {"recent": self._recent_dict()})
            | (
                {}
                if self.key_transform is None
                else {"key_transform": self.key_transform.to_dict()}
            )
        )

    def _tensor_dict(self, role: str, t: TensorFormat, b: CacheBinding) -> dict[str, Any]:
        return {
            "role": role,
            "dtype": t.dtype,
            "shape": symbolic_shape(b, t),
            "input": self.onnx_input(role),
            "output": self.onnx_output(role),
        }

    def _recent_dict(self) -> dict[str, Any]:
        r = self.recent
        return {
            "window": r.window,
            "kv_cache_dtype": r.kv_cache_dtype,
            "storage_dtype": r.storage_dtype,
            "group": self.recent_group,
            "bytes_per_token_head": r.bytes_per_token_head,
            "page_size_bytes": r.page_size_bytes,
        } | ({"sink_tokens": self.sink_tokens} if self.sink_tokens else {})
