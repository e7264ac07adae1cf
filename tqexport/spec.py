"""Per-layer KV-cache specs, cache groups and the versioned ``tqexport.json`` schema.

The spec is the single source of truth: every consumer (kernel, graph, plugin, executor) reads
a layer's own :class:`LayerSpec`. Sizes are derived properties, never stored twice; the JSON
carries them for readers without tqexport, and loading checks they still agree.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tqexport import __version__
from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import Codec, TensorFormat, make_codec
from tqexport.kvquant.modes import KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.turboquant import SlotLayout

SCHEMA_VERSION = 1


class SpecError(TQExportError):
    """A spec file that cannot be used as it is."""


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
        for name in ("num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise SpecError(f"{name} must be positive, got {getattr(self, name)}")
        _ = self.codec  # validates the dtype name and head size now, not at first use
        if not self.mode.uses_layer_scales and (self.k_scale, self.v_scale) != (1.0, 1.0):
            raise SpecError(f"{self.kv_cache_dtype} caches take no per-layer k/v scales")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise SpecError(f"k/v scales must be positive, got {self.k_scale}, {self.v_scale}")

    attention_type = AttentionType.FULL

    @property
    def window(self) -> int | None:
        return None

    @cached_property
    def codec(self) -> Codec:
        return make_codec(
            self.kv_cache_dtype,
            self.head_size,
            model_dtype=self.model_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
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
        if self.sliding_window <= 0:
            raise SpecError(f"sliding_window must be positive, got {self.sliding_window}")
        super().__post_init__()

    @property
    def window(self) -> int | None:
        return self.sliding_window


def cache_spec(window: int | None, **kw) -> KVCacheSpec:
    """FullAttentionSpec for ``window=None``, else SlidingWindowSpec."""
    if window is None:
        return FullAttentionSpec(**kw)
    return SlidingWindowSpec(sliding_window=window, **kw)


RECENT_PREFIX = "recent_"


def recent_spec(cache: KVCacheSpec, window: int) -> SlidingWindowSpec:
    """The full-precision (model dtype) sliding cache that holds a layer's recent window."""
    return SlidingWindowSpec(
        kv_cache_dtype="auto",
        sliding_window=window,
        num_kv_heads=cache.num_kv_heads,
        head_size=cache.head_size,
        block_size=cache.block_size,
        model_dtype=cache.model_dtype,
    )


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

    @property
    def recent_window(self) -> int:
        """Tokens each query reads from the full-precision recent cache (0 = none)."""
        return self.recent.window if self.recent is not None else 0

    @property
    def cache_tensors(self) -> list[tuple[str, TensorFormat, KVCacheSpec]]:
        """(graph role, format, owning cache) of every cache tensor of this layer, in graph
        order: the layer's own cache, then the recent cache's tensors as ``recent_<role>``."""
        own = [(t.role, t, self.cache) for t in self.cache.tensors]
        if self.recent is None:
            return own
        return own + [(RECENT_PREFIX + t.role, t, self.recent) for t in self.recent.tensors]

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id costs in this layer, over all its cache tensors."""
        return self.cache.page_size_bytes + (self.recent.page_size_bytes if self.recent else 0)

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
        return {
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
            "tensors": [self._tensor_dict(role, t, owner) for role, t, owner in self.cache_tensors],
            "constants": c.constants,
        } | ({} if self.recent is None else {"recent": self._recent_dict()})

    def _tensor_dict(self, role: str, t: TensorFormat, owner: KVCacheSpec) -> dict[str, Any]:
        blocks = "num_recent_blocks" if owner is self.recent else "num_blocks"
        return {
            "role": role,
            "dtype": t.dtype,
            "shape": [blocks, owner.block_size, owner.num_kv_heads]
            + ([] if t.width is None else [t.width]),
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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerSpec:
        where = f"layer {d.get('index', '?')}"
        try:
            cache = cache_spec(
                d["window"],
                kv_cache_dtype=d["kv_cache_dtype"],
                num_kv_heads=d["num_kv_heads"],
                head_size=d["head_size"],
                block_size=d["block_size"],
                model_dtype=d["model_dtype"],
                k_scale=d["constants"].get("k_scale", 1.0),
                v_scale=d["constants"].get("v_scale", 1.0),
            )
            recent = d.get("recent")
            layer = cls(
                index=d["index"],
                module=d["module"],
                cache=cache,
                scale=d["scale"],
                softcap=d["softcap"],
                group=d["group"],
                skipped_by=d.get("skipped_by"),
                recent=None if recent is None else recent_spec(cache, recent["window"]),
                recent_group=None if recent is None else recent["group"],
            )
        except KeyError as e:
            raise SpecError(f"{where}: missing field {e.args[0]!r}") from None
        # Derived fields must agree with what this tqexport derives: a spec claiming e.g.
        # mode TURBOQUANT for dtype 'auto' is corrupt, not something to guess around.
        ours = layer.to_dict()
        for key, value in d.items():
            if key in ours and ours[key] != value:
                raise SpecError(
                    f"{where}: field {key!r} is {value!r} but {d['kv_cache_dtype']!r} with this "
                    f"shape means {ours[key]!r}; the spec is inconsistent, rebuild the artifact"
                )
        return layer


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one block table: same window (None = full attention)."""

    id: int
    window: int | None
    block_size: int
    layers: tuple[int, ...]
    #: the group holds these layers' recent-window caches, not their own caches
    recent: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "window": self.window,
            "block_size": self.block_size,
            "layers": list(self.layers),
        } | ({"recent": True} if self.recent else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheGroup:
        return cls(
            d["id"], d["window"], d["block_size"], tuple(d["layers"]), d.get("recent", False)
        )


def build_groups(
    windows: dict[int, int | None], block_size: int, recent: dict[int, int] | None = None
) -> tuple[CacheGroup, ...]:
    """Group layer indices by window: full attention first, then windows ascending; then one
    group per recent-window size (``recent`` maps layer -> its recent window)."""
    keys = sorted(set(windows.values()), key=lambda w: (w is not None, w or 0))
    groups = [
        CacheGroup(i, w, block_size, tuple(sorted(ix for ix, lw in windows.items() if lw == w)))
        for i, w in enumerate(keys)
    ]
    recent = recent or {}
    for w in sorted(set(recent.values())):
        layers = tuple(sorted(ix for ix, rw in recent.items() if rw == w))
        groups.append(CacheGroup(len(groups), w, block_size, layers, recent=True))
    return tuple(groups)


@dataclass(frozen=True)
class ModelSpec:
    """The whole ``tqexport.json``: model identity, layers, groups, provenance, graph I/O."""

    model: dict[str, Any]
    dtype: str
    block_size: int
    layers: tuple[LayerSpec, ...]
    groups: tuple[CacheGroup, ...]
    request: dict[str, Any] = field(default_factory=dict)
    io: dict[str, Any] | None = None
    tqexport_version: str = __version__

    def __post_init__(self):
        by_group = {g.id: g for g in self.groups}
        for layer in self.layers:
            g = by_group.get(layer.group)
            if g is None or g.recent or layer.index not in g.layers or g.window != layer.window:
                raise SpecError(f"layer {layer.index} is not in a cache group with its window")
            if layer.recent is not None:
                r = by_group.get(layer.recent_group)
                if (
                    r is None
                    or not r.recent
                    or layer.index not in r.layers
                    or (r.window != layer.recent_window)
                ):
                    raise SpecError(
                        f"layer {layer.index} is not in a recent-window group with its window"
                    )

    def layer(self, index: int) -> LayerSpec:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(index)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes each cached token adds (recent-window caches, bounded per sequence, aside)."""
        return sum(layer.cache.bytes_per_token for layer in self.layers)

    @property
    def recent_window(self) -> int:
        """The largest recent window of any layer (0 = none)."""
        return max((la.recent_window for la in self.layers), default=0)

    @property
    def recent_bytes_per_token(self) -> int:
        """Bytes per token of the recent-window caches (they hold at most their window)."""
        return sum(la.recent.bytes_per_token for la in self.layers if la.recent is not None)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs across every cache tensor of every layer."""
        return sum(la.page_size_bytes for la in self.layers)

    def group_block_bytes(self, group: CacheGroup) -> int:
        """Bytes one block of ``group`` holds over its layers' caches."""
        if group.recent:
            return sum(self.layer(i).recent.page_size_bytes for i in group.layers)
        return sum(self.layer(i).cache.page_size_bytes for i in group.layers)

    @property
    def bf16_bytes_per_token(self) -> int:
        """What the same layers would take with bf16 K and V caches."""
        return sum(4 * la.cache.head_size * la.cache.num_kv_heads for la in self.layers)

    def graph_io(self) -> dict[str, list[dict[str, Any]]]:
        """The graph's input/output contract: names, dtypes and symbolic shapes, in order."""
        vocab = self.model.get("vocab_size", "vocab")
        inputs = [
            _io("input_ids", "int64", ["T"]),
            _io("positions", "int64", ["T"]),
            _io("seq_lens", "int32", ["num_seqs"]),
            _io("query_start_loc", "int32", ["num_seqs_plus_1"]),
            _io("logits_indices", "int64", ["L"]),
        ]
        for g in self.groups:
            inputs.append(_io(f"slot_mapping_{g.id}", "int64", ["T"]))
            inputs.append(_io(f"block_tables_{g.id}", "int32", ["num_seqs", f"max_blocks_{g.id}"]))
        outputs = [_io("logits", "float32", ["L", vocab])]
        for layer in self.layers:
            for role, t, c in layer.cache_tensors:
                blocks = "num_recent_blocks" if c is layer.recent else "num_blocks"
                shape = [blocks, c.block_size, c.num_kv_heads] + (
                    [] if t.width is None else [t.width]
                )
                inputs.append(_io(layer.onnx_input(role), t.dtype, shape))
                outputs.append(_io(layer.onnx_output(role), t.dtype, shape))
        return {"inputs": inputs, "outputs": outputs}

    @cached_property
    def input_names(self) -> tuple[str, ...]:
        """Graph input names in order (derived once: the executor needs them every step)."""
        return tuple(x["name"] for x in self.graph_io()["inputs"])

    def plan_dict(self) -> dict[str, Any]:
        """The per-layer part of the spec (what ``tqexport plan --json`` prints)."""
        return {
            "groups": [g.to_dict() for g in self.groups],
            "layers": [la.to_dict() for la in self.layers],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "tqexport_version": self.tqexport_version,
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "request": self.request,
            **self.plan_dict(),
            "io": self.io,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SpecError(
                f"spec schema version {version!r} is not supported by tqexport {__version__} "
                f"(it reads version {SCHEMA_VERSION}); rebuild the artifact with this tqexport "
                "or use the tqexport version that built it"
            )
        try:
            return cls(
                model=d["model"],
                dtype=d["dtype"],
                block_size=d["block_size"],
                layers=tuple(LayerSpec.from_dict(x) for x in d["layers"]),
                groups=tuple(CacheGroup.from_dict(x) for x in d["groups"]),
                request=d.get("request", {}),
                io=d.get("io"),
                tqexport_version=d["tqexport_version"],
            )
        except KeyError as e:
            raise SpecError(f"spec is missing field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"spec is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise SpecError("spec must be a JSON object")
        return cls.from_dict(data)


def _io(name: str, dtype: str, shape: list) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape}


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a model config, canonically serialized (identifies what a spec was built for)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
