"""Per-layer KV-cache specs, cache groups and the versioned ``tqexport.json`` schema.

The spec is the single source of truth: every consumer (kernel, graph, plugin, executor) reads
a layer's own :class:`LayerSpec`. Sizes are derived properties, never stored twice; the JSON
carries them for readers without tqexport, and loading checks they still agree.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tqexport import __version__, kv_layers
from tqexport.errors import TQExportError
from tqexport.kvquant import transforms
from tqexport.kvquant.codecs import MAX_HEAD_SIZE, MODEL_DTYPES, Codec, TensorFormat, codec_for
from tqexport.kvquant.modes import KVQuantMode, parse_kv_cache_dtype
from tqexport.kvquant.transforms import KeyTransform
from tqexport.kvquant.turboquant import SlotLayout
from tqexport.skip_layers import parse_skip_pattern, parse_skip_patterns
from tqexport.validate import MAX_BLOCK_SIZE, MAX_RECENT_WINDOW, MAX_SINK_TOKENS

SCHEMA_VERSION = 1

# Bounds on every size a spec may hold: generous for any real model, small enough that nothing
# derived from a spec (codec tables, graph I/O lists, messages) can take unbounded time or memory.
# MAX_HEAD_SIZE lives with the codecs (every codec checks it), MAX_BLOCK_SIZE and
# MAX_RECENT_WINDOW with the argument checks of the command line (the same rules at build time).
#: bytes of a tqexport.json (a 1024-layer spec with a recent window is about 3 MiB)
MAX_SPEC_BYTES = 16 * 1024 * 1024
#: attention layers (the largest models have ~130)
MAX_LAYERS = 1024
#: query heads and kv heads of a layer (the largest models have 128 query heads)
MAX_HEADS = 1024
MAX_KV_HEADS = 1024
#: sliding-window tokens (more than any model's context)
MAX_WINDOW = 1 << 24
#: vocabulary entries (0 = unknown; the largest vocabularies have ~260k)
MAX_VOCAB_SIZE = 1 << 24
#: characters of a name, path or version string
MAX_TEXT = 4096
#: ONNX opset the graph was exported with
MAX_OPSET = 99
#: digits of a JSON integer (Python would otherwise parse, and refuse to print, 10^5000)
MAX_INT_DIGITS = 40
#: cache groups: one per window of the layers' own caches, one per recent window
MAX_GROUPS = 2 * MAX_LAYERS
MODEL_DTYPE_NAMES = tuple(MODEL_DTYPES)
#: why resolve leaves a layer unquantized (``skipped_by``): boundary protection or a pattern
SKIP_BOUNDARY = "turboquant boundary"
SKIP_PATTERN_PREFIX = "--skip-layers "

#: how every message about a damaged or inconsistent spec ends
REBUILD = "; rebuild the artifact"
INCONSISTENT = "; the spec is inconsistent, rebuild the artifact"


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
        _check_size("num_kv_heads", self.num_kv_heads, MAX_KV_HEADS)
        _check_size("head_size", self.head_size, MAX_HEAD_SIZE)
        _check_size("block_size", self.block_size, MAX_BLOCK_SIZE)
        if self.model_dtype not in MODEL_DTYPE_NAMES:
            raise SpecError(
                f"model_dtype must be one of {', '.join(MODEL_DTYPE_NAMES)}, "
                f"got {_show(self.model_dtype)}"
            )
        for name in ("k_scale", "v_scale"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not _positive(x):
                raise SpecError(f"{name} must be a finite positive number, got {_show(x)}")
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
        _check_size("sliding_window", self.sliding_window, MAX_WINDOW)
        super().__post_init__()

    @property
    def window(self) -> int | None:
        return self.sliding_window


def _check_size(name: str, value: Any, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise SpecError(f"{name} must be an integer in 1..{hi}, got {_show(value)}")


def cache_spec(window: int | None, **kw) -> KVCacheSpec:
    """FullAttentionSpec for ``window=None``, else SlidingWindowSpec."""
    if window is None:
        return FullAttentionSpec(**kw)
    return SlidingWindowSpec(sliding_window=window, **kw)


RECENT_PREFIX = "recent_"


def recent_spec(cache: KVCacheSpec, window: int) -> SlidingWindowSpec:
    """The full-precision (model dtype) sliding cache that holds a layer's recent window."""
    _check_size("recent window", window, MAX_RECENT_WINDOW)
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
            "shape": _symbolic_shape(b, t),
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

    @classmethod
    def from_dict(cls, d: Any, position: int | None = None) -> LayerSpec:
        """A layer from its ``to_dict`` form; every stored field is type- and range-checked and
        every derived field must equal what this tqexport derives (else :class:`SpecError`)."""
        if position is None:  # called on one layer: name it by its index field if it has one
            index = d.get("index") if isinstance(d, dict) else None
            position = index if _is_int(index) and 0 <= index < MAX_LAYERS else None
        where = f"layer {'?' if position is None else position}"
        d = _obj(d, where)
        _known_keys(d, _LAYER_KEYS, ("recent", "key_transform"), where)
        index = _int(d, "index", 0, MAX_LAYERS - 1, where)
        if position is not None and index != position:
            raise SpecError(
                f"{where}: field 'index' must be {position} (layers are listed in index "
                f"order 0..n-1), got {index}{REBUILD}"
            )
        window = _int(d, "window", 1, MAX_WINDOW, where, null=True)
        kv_cache_dtype = _str(d, "kv_cache_dtype", where, max_len=64)
        model_dtype = _choice(d, "model_dtype", MODEL_DTYPE_NAMES, where)
        constants = _obj(_field(d, "constants", where), f"{where}: field 'constants'")
        scales = {
            name: _float(constants, name, f"{where} constants") if name in constants else 1.0
            for name in ("k_scale", "v_scale")
        }
        recent = None
        if "recent" in d:
            recent = _obj(d["recent"], f"{where}: field 'recent'")
            _known_keys(recent, _RECENT_KEYS, ("sink_tokens",), f"{where} recent")
            recent_window = _int(recent, "window", 1, MAX_RECENT_WINDOW, f"{where} recent")
            recent_group = _int(recent, "group", 0, MAX_GROUPS - 1, f"{where} recent")
            sink_tokens = (
                _int(recent, "sink_tokens", 1, MAX_SINK_TOKENS, f"{where} recent")
                if "sink_tokens" in recent
                else 0
            )
        try:
            cache = cache_spec(
                window,
                kv_cache_dtype=kv_cache_dtype,
                num_kv_heads=_int(d, "num_kv_heads", 1, MAX_KV_HEADS, where),
                head_size=_int(d, "head_size", 1, MAX_HEAD_SIZE, where),
                block_size=_int(d, "block_size", 1, MAX_BLOCK_SIZE, where),
                model_dtype=model_dtype,
                **scales,
            )
            layer = cls(
                index=index,
                module=_str(d, "module", where),
                cache=cache,
                scale=_float(d, "scale", where),
                softcap=_float(d, "softcap", where, null=True),
                group=_int(d, "group", 0, MAX_GROUPS - 1, where),
                skipped_by=_skipped_by(d, where),
                recent=None if recent is None else recent_spec(cache, recent_window),
                recent_group=None if recent is None else recent_group,
                key_transform=_key_transform(d, cache, where),
                sink_tokens=0 if recent is None else sink_tokens,
            )
        except SpecError as e:
            if str(e).startswith(where):
                raise
            raise SpecError(f"{where}: {e}{REBUILD}") from None
        except TQExportError as e:  # the codec refuses the dtype or the head size
            raise SpecError(f"{where}: {e} (the spec cannot be served){REBUILD}") from None
        if layer.skipped_by is not None and kv_cache_dtype != "auto":
            raise SpecError(
                f"{where}: field 'skipped_by' says the layer is unquantized but its "
                f"kv_cache_dtype is {_show(kv_cache_dtype)}{REBUILD}"
            )
        if layer.recent is not None and not layer.mode.is_quantized:
            raise SpecError(
                f"{where}: an unquantized layer ({_show(kv_cache_dtype)}) has no recent-window "
                f"cache{REBUILD}"
            )
        why = transforms.refusal(
            layer.key_transform.kinds if layer.key_transform else (),
            parse_kv_cache_dtype(kv_cache_dtype).takes_key_transform,
            layer.softcap,
        )
        if why is not None:
            raise SpecError(f"{where}: field 'key_transform': {why}{REBUILD}")
        if window is not None and layer.recent_window > window:
            raise SpecError(
                f"{where}: recent window {layer.recent_window} exceeds the layer's sliding "
                f"window {window}{REBUILD}"
            )
        # Derived fields must agree with what this tqexport derives: a spec claiming e.g.
        # mode TURBOQUANT for dtype 'auto' is corrupt, not something to guess around.
        ours = layer.to_dict()
        _exact_keys(d, ours, where)
        for key, value in d.items():
            if not _same(value, ours[key]):
                raise SpecError(
                    f"{where}: field {key!r} is {_show(value)} but {kv_cache_dtype!r} with this "
                    f"shape means {_show(ours[key], full=True)}; the spec is inconsistent, "
                    "rebuild the artifact"
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
    #: a recent group also keeps the blocks of every sequence's first ``sink_tokens`` tokens
    sink_tokens: int = 0

    @property
    def sink_blocks(self) -> int:
        """Blocks holding a sequence's sink tokens (never freed while it runs)."""
        return -(-self.sink_tokens // self.block_size)

    @property
    def window_blocks(self) -> int | None:
        """Blocks a sequence holds at most in a windowed group: its window plus a partial block
        at each end (and its sink tokens' blocks); None for full attention (no bound)."""
        if self.window is None:
            return None
        return -(-self.window // self.block_size) + 2 + self.sink_blocks

    def live_blocks(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` holds at once: all of them, or for a windowed group
        at most :attr:`window_blocks`."""
        total = -(-tokens // self.block_size)
        return total if self.window is None else min(total, self.window_blocks)

    @property
    def bounded(self) -> bool:
        """Whether the group's caches are sized by :meth:`max_blocks` alone, before the memory
        budget is split (a recent-window group)."""
        return self.recent

    def max_blocks(
        self, max_num_seqs: int, max_step_tokens: int, tokens: int | None = None
    ) -> int | None:
        """Blocks a windowed group can use at most with ``max_num_seqs`` sequences (of at most
        ``tokens`` tokens) running: each one's live blocks, one step's new tokens and the null
        block (what vLLM's ``SlidingWindowSpec.max_memory_usage_bytes`` bounds per sequence);
        None for full attention, which can use any number."""
        if self.window is None:
            return None
        steps = -(-max_step_tokens // self.block_size)
        per_seq = self.window_blocks if tokens is None else self.live_blocks(tokens)
        return 1 + max_num_seqs * per_seq + steps

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "id": self.id,
                "window": self.window,
                "block_size": self.block_size,
                "layers": list(self.layers),
            }
            | ({"recent": True} if self.recent else {})
            | ({"sink_tokens": self.sink_tokens} if self.sink_tokens else {})
        )

    @classmethod
    def from_dict(cls, d: Any, position: int | None = None) -> CacheGroup:
        where = f"group {'?' if position is None else position}"
        d = _obj(d, where)
        _known_keys(d, ("id", "window", "block_size", "layers"), ("recent", "sink_tokens"), where)
        gid = _int(d, "id", 0, MAX_GROUPS - 1, where)
        if position is not None and gid != position:
            raise SpecError(
                f"{where}: field 'id' must be {position} (groups are listed in id order "
                f"0..n-1), got {gid}{REBUILD}"
            )
        recent = _bool(d, "recent", where) if "recent" in d else False
        sink_tokens = 0
        if "sink_tokens" in d:
            if not recent:
                raise SpecError(
                    f"{where}: field 'sink_tokens' belongs to a recent-window group only{REBUILD}"
                )
            sink_tokens = _int(d, "sink_tokens", 1, MAX_SINK_TOKENS, where)
        if recent:
            window = _int(d, "window", 1, MAX_RECENT_WINDOW, where)
        else:
            window = _int(d, "window", 1, MAX_WINDOW, where, null=True)
        block_size = _int(d, "block_size", 1, MAX_BLOCK_SIZE, where)
        layers = _list(d, "layers", 1, MAX_LAYERS, where)
        for i, x in enumerate(layers):
            if not (_is_int(x) and 0 <= x < MAX_LAYERS) or (i and x <= layers[i - 1]):
                raise SpecError(
                    f"{where}: field 'layers' must list layer indices in increasing order, each "
                    f"once; item {i} is {_show(x)}{REBUILD}"
                )
        return cls(gid, window, block_size, tuple(layers), recent, sink_tokens)


def build_groups(
    windows: dict[int, int | None],
    block_size: int,
    recent: dict[int, int] | None = None,
    sinks: dict[int, int] | None = None,
) -> tuple[CacheGroup, ...]:
    """Group layer indices by window: full attention first, then windows ascending; then one
    group per (recent window, sink tokens), ascending (``recent`` maps layer -> its recent
    window, ``sinks`` layer -> its sink tokens, 0 where absent)."""
    keys = sorted(set(windows.values()), key=lambda w: (w is not None, w or 0))
    groups = [
        CacheGroup(i, w, block_size, tuple(sorted(ix for ix, lw in windows.items() if lw == w)))
        for i, w in enumerate(keys)
    ]
    sinks = sinks or {}
    exact = {ix: (w, sinks.get(ix, 0)) for ix, w in (recent or {}).items()}
    for w, sink in sorted(set(exact.values())):
        layers = tuple(sorted(ix for ix, key in exact.items() if key == (w, sink)))
        groups.append(CacheGroup(len(groups), w, block_size, layers, recent=True,
                                 sink_tokens=sink))  # fmt: skip
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
        # Built or loaded, a spec is checked the same way: a build never writes what a load
        # would refuse.
        self._check_top()
        self._check_structure()
        self._check_fields()

    def _check_structure(self) -> None:
        """Layers, groups and block sizes agree with each other (any spec, loaded or built)."""
        n = len(self.layers)
        for pos, layer in enumerate(self.layers):
            if layer.index != pos:
                raise SpecError(
                    f"layer indices must be 0..{n - 1} in order; position {pos} holds layer "
                    f"{layer.index}{REBUILD}"
                )
            for what, c in (("cache", layer.cache), ("recent cache", layer.recent)):
                if c is not None and c.block_size != self.block_size:
                    raise SpecError(
                        f"layer {pos}: {what} block_size {c.block_size} differs from the spec's "
                        f"block_size {self.block_size}{INCONSISTENT}"
                    )
                if c is not None and c.model_dtype != self.dtype:
                    raise SpecError(
                        f"layer {pos}: model_dtype {c.model_dtype} differs from the spec's dtype "
                        f"{self.dtype}{INCONSISTENT}"
                    )
        for pos, g in enumerate(self.groups):
            if g.id != pos:
                raise SpecError(f"group ids must be 0..{len(self.groups) - 1} in order{REBUILD}")
            if g.block_size != self.block_size:
                raise SpecError(
                    f"group {g.id}: block_size {g.block_size} differs from the spec's block_size "
                    f"{self.block_size}{INCONSISTENT}"
                )
            for ix in g.layers:
                if not 0 <= ix < n:
                    raise SpecError(
                        f"group {g.id} names layer {ix}, but the spec has layers 0..{n - 1}"
                        f"{REBUILD}"
                    )
        by_group = {g.id: g for g in self.groups}
        for layer in self.layers:
            g = by_group.get(layer.group)
            if g is None or g.recent or layer.index not in g.layers or g.window != layer.window:
                raise SpecError(
                    f"layer {layer.index} is not in a cache group with its window{REBUILD}"
                )
            if layer.recent is not None:
                r = by_group.get(layer.recent_group)
                if (
                    r is None
                    or not r.recent
                    or layer.index not in r.layers
                    or (r.window != layer.recent_window)
                    or (r.sink_tokens != layer.sink_tokens)
                ):
                    raise SpecError(
                        f"layer {layer.index} is not in a recent-window group with its window "
                        f"and sink tokens{REBUILD}"
                    )
            elif layer.recent_group is not None:
                raise SpecError(
                    f"layer {layer.index} has a recent group but no recent cache{REBUILD}"
                )
        held: dict[tuple[bool, int | None], list[int]] = {}  # (recent?, group id) -> layers
        for la in self.layers:
            held.setdefault((False, la.group), []).append(la.index)
            if la.recent is not None:
                held.setdefault((True, la.recent_group), []).append(la.index)
        for g in self.groups:
            claims = held.get((g.recent, g.id), [])
            if list(g.layers) != claims:
                kind = "recent-window caches" if g.recent else "caches"
                raise SpecError(
                    f"group {g.id} lists layers {_show(list(g.layers), full=True)} but the "
                    f"layers whose {kind} it holds are {_show(claims, full=True)}{REBUILD}"
                )
        want = build_groups(
            {la.index: la.window for la in self.layers},
            self.block_size,
            {la.index: la.recent_window for la in self.layers if la.recent is not None},
            {la.index: la.sink_tokens for la in self.layers if la.sink_tokens},
        )
        if self.groups != want:
            raise SpecError(
                "the cache groups are not those the layers' windows give (one group per window, "
                "full attention first, windows ascending, then one per recent window)"
                f"{REBUILD}"
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
    def sink_tokens(self) -> int:
        """The most sink tokens any layer keeps (0 = none)."""
        return max((la.sink_tokens for la in self.layers), default=0)

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
        return sum(
            b.cache.page_size_bytes
            for i in group.layers
            for b in self.layer(i).bindings
            if b.group == group.id
        )

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
            inputs.append(_io(slot_mapping_name(g.id), "int64", ["T"]))
            inputs.append(_io(block_tables_name(g.id), "int32", ["num_seqs", f"max_blocks_{g.id}"]))
        outputs = [_io("logits", "float32", ["L", vocab])]
        for layer in self.layers:
            for role, t, b in layer.cache_tensors:
                shape = _symbolic_shape(b, t)
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
    def from_dict(cls, d: Any) -> ModelSpec:
        """The spec of a parsed ``tqexport.json``. Total: any JSON value gives a spec whose
        fields are all checked and agree with each other, or raises :class:`SpecError`."""
        try:
            return cls._from_dict(d)
        except RecursionError:
            raise SpecError(f"spec nests too deeply{REBUILD}") from None

    @classmethod
    def _from_dict(cls, d: Any) -> ModelSpec:
        d = _obj(d, "spec")
        version = d.get("schema_version")
        if not _is_int(version) or version != SCHEMA_VERSION:
            shown = version if version is None or _is_int(version) else _show(version)
            raise SpecError(
                f"spec schema version {shown} is not supported by tqexport "
                f"{__version__} (it reads version {SCHEMA_VERSION}); rebuild the artifact with "
                "this tqexport or use the tqexport version that built it"
            )
        _known_keys(d, _TOP_KEYS, (), "spec")
        block_size = _int(d, "block_size", 1, MAX_BLOCK_SIZE, "spec")
        layers = _list(d, "layers", 1, MAX_LAYERS, "spec")
        groups = _list(d, "groups", 1, MAX_GROUPS, "spec")
        dtype = _choice(d, "dtype", MODEL_DTYPE_NAMES, "spec")
        return cls(  # __post_init__ checks the rest: structure, model, request, io
            model=d["model"],
            dtype=dtype,
            block_size=block_size,
            layers=tuple(LayerSpec.from_dict(x, i) for i, x in enumerate(layers)),
            groups=tuple(CacheGroup.from_dict(x, i) for i, x in enumerate(groups)),
            request=d["request"],
            io=d["io"],
            tqexport_version=d["tqexport_version"],
        )

    def _check_top(self) -> None:
        top = {"block_size": self.block_size, "dtype": self.dtype}
        top["tqexport_version"] = self.tqexport_version
        _int(top, "block_size", 1, MAX_BLOCK_SIZE, "spec")
        if self.block_size & (self.block_size - 1):
            raise SpecError(
                f"spec: field 'block_size' must be a power of two (the kernels' rule), got "
                f"{self.block_size}{REBUILD}"
            )
        _choice(top, "dtype", MODEL_DTYPE_NAMES, "spec")
        _str(top, "tqexport_version", "spec", max_len=64)

    def _check_fields(self) -> None:
        """Beyond the structure: the model identity against the layers, the request
        (provenance) against the layers it produced, the graph I/O."""
        _model(self.model, len(self.layers))
        _request(self.request)
        if self.io is not None:
            _obj(self.io, "spec: field 'io'")
        heads = self.model.get("num_heads")
        for la in self.layers:
            if heads is not None and heads % la.cache.num_kv_heads:
                raise SpecError(
                    f"layer {la.index}: {la.cache.num_kv_heads} kv heads do not divide the "
                    f"model's {heads} query heads{REBUILD}"
                )
        requested = self.request.get("kv_cache_dtype")
        if requested is not None:
            self._check_request_layers(requested)
        if self.io is not None:
            ours = self.graph_io()
            if not _same(self.io, ours):
                raise SpecError(
                    f"spec: field 'io' does not match the graph I/O its layers and groups give "
                    f"({_io_difference(self.io, ours)}){INCONSISTENT}"
                )

    def _check_request_layers(self, requested: str) -> None:
        """Every layer's dtype, recent window and sink tokens are what the request gives it:
        its ``kv_layers`` entry's, else the requested dtype unless skipped."""
        rw = self.request.get("recent_window", 0)
        rs = self.request.get("sink_tokens", 0)
        quantized = parse_kv_cache_dtype(requested).mode.is_quantized
        own: dict[int, kv_layers.LayerRange] = {}
        if "kv_layers" in self.request:
            try:
                ranges = kv_layers.parse_kv_layers(self.request["kv_layers"])
                own = kv_layers.covered(ranges, len(self.layers))
            except TQExportError as e:
                raise SpecError(f"request: field 'kv_layers': {e}{REBUILD}") from None
        for pos, la in enumerate(self.layers):
            if pos in own:
                r = own[pos]
                if la.kv_cache_dtype != r.dtype or la.skipped_by is not None:
                    raise SpecError(
                        f"layer {la.index}: kv_cache_dtype {la.kv_cache_dtype!r} and skipped_by "
                        f"{_show(la.skipped_by)} do not fit the request's kv_layers entry "
                        f"{r.text!r}{REBUILD}"
                    )
                want, sinks = kv_layers.layer_recent(r, la.window, rw, rs)
                given = f"kv_layers entry {r.text!r}, recent_window {rw}, sink_tokens {rs}"
            else:
                if (la.kv_cache_dtype == requested) != (la.skipped_by is None):
                    raise SpecError(
                        f"layer {la.index}: kv_cache_dtype {la.kv_cache_dtype!r} and skipped_by "
                        f"{_show(la.skipped_by)} do not fit the requested {requested!r} (a layer "
                        f"has the requested dtype unless skipped){REBUILD}"
                    )
                want = min(rw, la.window or rw) if rw and quantized and not la.skipped_by else 0
                sinks = rs if want else 0
                given = f"recent_window {rw}, sink_tokens {rs}, {requested}"
            if la.recent_window != want:
                raise SpecError(
                    f"layer {la.index}: recent window {la.recent_window} but the request "
                    f"({given}) gives {want}{REBUILD}"
                )
            if la.sink_tokens != sinks:
                raise SpecError(
                    f"layer {la.index}: {la.sink_tokens} sink tokens but the request "
                    f"({given}) gives {sinks} to a layer "
                    f"{'with' if la.recent is not None else 'without'} a recent window"
                    f"{REBUILD}"
                )

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelSpec:
        return cls.from_dict(parse_spec_json(text))


_TOP_KEYS = (
    "schema_version",
    "tqexport_version",
    "model",
    "dtype",
    "block_size",
    "request",
    "groups",
    "layers",
    "io",
)
#: what ``LayerSpec.to_dict`` writes (and "recent" for a layer with a recent window)
_LAYER_KEYS = (
    "index",
    "module",
    "attention_type",
    "window",
    "scale",
    "softcap",
    "kv_cache_dtype",
    "quant_mode",
    "storage_dtype",
    "model_dtype",
    "num_kv_heads",
    "head_size",
    "block_size",
    "bytes_per_token_head",
    "page_size_bytes",
    "group",
    "skipped_by",
    "tensors",
    "constants",
)
_RECENT_KEYS = (
    "window",
    "kv_cache_dtype",
    "storage_dtype",
    "group",
    "bytes_per_token_head",
    "page_size_bytes",
)
_MODEL_KEYS = (
    "name",
    "architecture",
    "source",
    "config_digest",
    "num_layers",
    "num_heads",
    "vocab_size",
)


def parse_spec_json(text: str | bytes) -> Any:
    """Parse a spec file's bytes (or text) as strict JSON: UTF-8, at most
    :data:`MAX_SPEC_BYTES`, no NaN/Infinity, no integer longer than :data:`MAX_INT_DIGITS`
    digits, no duplicate keys, no nesting deeper than Python's recursion limit. Any other input
    raises :class:`SpecError` with one line."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES >> 20} MiB{REBUILD}")
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(
                f"spec is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
                f"{REBUILD}"
            ) from None
    elif not isinstance(text, str):
        raise SpecError(f"spec must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(
            text,
            parse_constant=_json_constant,
            parse_float=_json_float,
            parse_int=_json_int,
            object_pairs_hook=_json_object,
        )
    except json.JSONDecodeError as e:
        raise SpecError(f"spec is not valid JSON ({e}){REBUILD}") from None
    except RecursionError:
        raise SpecError(f"spec is not valid JSON (nested too deeply){REBUILD}") from None


def _json_constant(name: str):
    raise SpecError(f"spec is not valid JSON ({name} is not a JSON number){REBUILD}")


def _json_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise SpecError(f"spec is not valid JSON (number {text[:40]} is out of range){REBUILD}")
    return x


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise SpecError(
            f"spec has an integer of {len(text)} digits (at most {MAX_INT_DIGITS}){REBUILD}"
        )
    return int(text)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise SpecError(f"spec has the key {dup[:40]!r} twice in one object{REBUILD}")
    return d


# -- checked accessors: every field of a loaded spec is read through one of these -------------


def _show(value: Any, full: bool = False) -> str:
    """A value for a one-line message: JSON notation, strings cut at 40 characters, containers
    described (or, with ``full``, compact JSON cut at 120 characters)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return (
            str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        )
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value[:40]) + ("..." if len(value) > 40 else "")
    if isinstance(value, list | tuple | dict):
        if full:
            try:
                text = json.dumps(value, separators=(", ", ": "))
            except (RecursionError, TypeError, ValueError):
                text = None
            if text is not None:
                return text if len(text) <= 120 else text[:117] + "..."
        kind = "a list" if isinstance(value, list | tuple) else "an object"
        return f"{kind} of {len(value)} item{'s' if len(value) != 1 else ''}"
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be a JSON object, got {_show(value)}{REBUILD}")
    return value


def _field(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}: missing field {key!r}{REBUILD}")
    return d[key]


def _bad(where: str, key: str, want: str, value: Any) -> SpecError:
    return SpecError(f"{where}: field {key!r} must be {want}, got {_show(value)}{REBUILD}")


def _int(d, key: str, lo: int, hi: int, where: str, *, null: bool = False) -> int | None:
    value = _field(d, key, where)
    if value is None and null:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise _bad(where, key, f"an integer in {lo}..{hi}" + (" or null" if null else ""), value)
    return value


def _float(d, key: str, where: str, *, null: bool = False) -> float | None:
    """A finite positive number (ints accepted, bools not), as float."""
    value = _field(d, key, where)
    if value is None and null:
        return None
    if not (isinstance(value, int | float) and not isinstance(value, bool)) or not _positive(value):
        raise _bad(where, key, "a finite positive number" + (" or null" if null else ""), value)
    return float(value)


_TEXT_BAD = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _str(d, key: str, where: str, *, max_len: int = MAX_TEXT, empty: bool = False) -> str:
    """Text of at most ``max_len`` characters, without control characters or lone surrogates
    (it is printed and re-serialized)."""
    value = _field(d, key, where)
    if not isinstance(value, str) or len(value) > max_len or (not value and not empty):
        want = f"{'a' if empty else 'a non-empty'} string of at most {max_len} characters"
        raise _bad(where, key, want, value)
    if _TEXT_BAD.search(value):
        raise _bad(where, key, "text without control characters", value)
    return value


def _choice(d, key: str, options: tuple[str, ...], where: str) -> str:
    value = _field(d, key, where)
    if not isinstance(value, str) or value not in options:
        raise _bad(where, key, f"one of {', '.join(options)}", value)
    return value


def _bool(d, key: str, where: str) -> bool:
    value = _field(d, key, where)
    if not isinstance(value, bool):
        raise _bad(where, key, "true or false", value)
    return value


def _list(d, key: str, lo: int, hi: int, where: str) -> list[Any]:
    value = _field(d, key, where)
    if not isinstance(value, list) or not lo <= len(value) <= hi:
        raise _bad(where, key, f"a list of {lo}..{hi} items", value)
    return value


def _known_keys(d: dict[str, Any], required, optional, where: str) -> None:
    for key in d:
        if key not in required and key not in optional:
            raise SpecError(
                f"{where}: unknown field {key[:40]!r} (schema version {SCHEMA_VERSION} has no "
                f"such field; a typo?){REBUILD}"
            )
    for key in required:
        _field(d, key, where)


def _exact_keys(d: dict[str, Any], ours: dict[str, Any], where: str) -> None:
    _known_keys(d, tuple(ours), (), where)


def _same(value: Any, ours: Any) -> bool:
    """``value`` (parsed JSON) equals ``ours`` (derived) in JSON terms: true is not 1, a list
    is a list; recursion follows ``ours``, so the depth of ``value`` does not matter."""
    if ours is None or isinstance(ours, bool):
        return value is ours
    if isinstance(ours, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool) and value == ours
    if isinstance(ours, str):
        return isinstance(value, str) and value == ours
    if isinstance(ours, list | tuple):
        return (
            isinstance(value, list)
            and len(value) == len(ours)
            and all(_same(v, o) for v, o in zip(value, ours, strict=True))
        )
    if isinstance(ours, dict):
        return (
            isinstance(value, dict)
            and value.keys() == ours.keys()
            and all(_same(value[k], o) for k, o in ours.items())
        )
    return False


def _io_difference(io: dict[str, Any], ours: dict[str, Any]) -> str:
    for kind in ("inputs", "outputs"):
        got, want = io.get(kind), ours[kind]
        if not isinstance(got, list):
            return f"{kind} is {_show(got)}"
        for i, w in enumerate(want):
            if i >= len(got) or not _same(got[i], w):
                return f"{kind} item {i} should be {w['name']!r}"
        if len(got) > len(want):
            return f"{kind} has {len(got) - len(want)} extra items"
    return f"fields {_show(sorted(io), full=True)}"


_DIGEST = re.compile(r"(sha256:[0-9a-f]{64})?")


def _model(value: Any, num_layers: int) -> dict[str, Any]:
    """The model identity: what the CLI prints (name), what the torch backend reloads (path,
    config_digest), what the graph and sampler size by (num_heads, vocab_size)."""
    m = _obj(value, "spec: field 'model'")
    _known_keys(m, _MODEL_KEYS, ("path",), "model")
    _str(m, "name", "model")
    _str(m, "architecture", "model", max_len=256)
    _str(m, "source", "model", empty=True)
    if not _DIGEST.fullmatch(_str(m, "config_digest", "model", max_len=71, empty=True)):
        raise _bad(
            "model", "config_digest", '"" or "sha256:" and 64 hex digits', m["config_digest"]
        )
    if _int(m, "num_layers", 1, MAX_LAYERS, "model") != num_layers:
        raise SpecError(
            f"model: field 'num_layers' is {m['num_layers']} but the spec lists {num_layers} "
            f"layers{REBUILD}"
        )
    _int(m, "num_heads", 1, MAX_HEADS, "model")
    _int(m, "vocab_size", 0, MAX_VOCAB_SIZE, "model")
    if "path" in m:
        _str(m, "path", "model")
    return m


def _request(value: Any) -> dict[str, Any]:
    """What the build was asked for (provenance; ``bench`` and ``quality`` read it back)."""
    r = _obj(value, "spec: field 'request'")
    keys = (
        "kv_cache_dtype", "skip_layers", "boundary", "recent_window", "kv_scales", "opset",
        "key_transform", "sink_tokens", "kv_layers",
    )  # fmt: skip
    _known_keys(r, (), keys, "request")
    if "kv_layers" in r:
        try:
            kv_layers.parse_kv_layers(_str(r, "kv_layers", "request", max_len=MAX_TEXT))
        except SpecError:
            raise
        except TQExportError as e:
            raise SpecError(f"request: field 'kv_layers': {e}{REBUILD}") from None
    if "key_transform" in r:
        try:
            transforms.parse_key_transform(_str(r, "key_transform", "request", max_len=64))
        except SpecError:
            raise
        except TQExportError as e:
            raise SpecError(f"request: {e}{REBUILD}") from None
    if "kv_cache_dtype" in r:
        try:
            parse_kv_cache_dtype(_str(r, "kv_cache_dtype", "request", max_len=64))
        except SpecError:
            raise
        except TQExportError as e:
            raise SpecError(f"request: {e}{REBUILD}") from None
    if "skip_layers" in r:
        patterns = _list(r, "skip_layers", 0, MAX_LAYERS, "request")
        for i, pattern in enumerate(patterns):
            _str({"skip_layers": pattern}, "skip_layers", f"request item {i}", max_len=256)
        try:
            parse_skip_patterns(patterns)
        except TQExportError as e:
            raise SpecError(f"request: field 'skip_layers': {e}{REBUILD}") from None
    if "boundary" in r:
        _bool(r, "boundary", "request")
    if "recent_window" in r:
        _int(r, "recent_window", 0, MAX_RECENT_WINDOW, "request")
    if "sink_tokens" in r:
        _int(r, "sink_tokens", 1, MAX_SINK_TOKENS, "request")
        if not r.get("recent_window"):
            raise SpecError(
                f"request: field 'sink_tokens' needs a recent_window (the sink tokens live in "
                f"the recent-window cache){REBUILD}"
            )
    if "kv_scales" in r:
        scales = r["kv_scales"]
        if isinstance(scales, str) and scales != "calibrate":
            try:
                ok = len(scales) <= 64 and _positive(float(scales))
            except ValueError:
                ok = False
        else:
            ok = scales == "calibrate" or (
                isinstance(scales, int | float)
                and not isinstance(scales, bool)
                and _positive(scales)
            )
        if not ok:
            raise _bad("request", "kv_scales", '"calibrate" or a positive number', scales)
    if "opset" in r:
        _int(r, "opset", 1, MAX_OPSET, "request")
    return r


def _key_transform(d: dict[str, Any], cache: KVCacheSpec, where: str) -> KeyTransform | None:
    """The layer's stored key transform (None when absent); its values are compared with the
    re-derived form afterwards, like every other field."""
    if "key_transform" not in d:
        return None
    kt = _obj(d["key_transform"], f"{where}: field 'key_transform'")
    _known_keys(kt, ("version", "kinds", "seed", "center", "scale"), (), f"{where} key_transform")
    try:
        return transforms.from_dict(kt, cache.num_kv_heads, cache.head_size)
    except TQExportError as e:
        raise SpecError(f"{where}: field 'key_transform': {e}{REBUILD}") from None
    except (TypeError, ValueError, OverflowError):
        raise SpecError(
            f"{where}: field 'key_transform' must hold lists of numbers{REBUILD}"
        ) from None


def _skipped_by(d: dict[str, Any], where: str) -> str | None:
    """None, or a reason resolve writes: boundary protection or a ``--skip-layers`` pattern."""
    value = _field(d, "skipped_by", where)
    if value is None or value == SKIP_BOUNDARY:
        return value
    if isinstance(value, str) and value.startswith(SKIP_PATTERN_PREFIX):
        _str(d, "skipped_by", where, max_len=256)
        try:
            parse_skip_pattern(value[len(SKIP_PATTERN_PREFIX) :])
            return value
        except TQExportError:
            pass
    raise _bad(
        where, "skipped_by", f'null, "{SKIP_BOUNDARY}" or "{SKIP_PATTERN_PREFIX}PATTERN"', value
    )


def slot_mapping_name(group: int) -> str:
    """The graph input holding each step token's cache slot in ``group`` (-1 = padding)."""
    return f"slot_mapping_{group}"


def block_tables_name(group: int) -> str:
    """The graph input holding every sequence's block table in ``group``."""
    return f"block_tables_{group}"


def _symbolic_shape(b: CacheBinding, t: TensorFormat) -> list:
    """A cache tensor's shape with its block count by name: ``[num_blocks, bs, kvh(, X)]``."""
    lead = [b.blocks_dim, b.cache.block_size, b.cache.num_kv_heads]
    return lead + ([] if t.width is None else [t.width])


def _io(name: str, dtype: str, shape: list) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape}


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a model config, canonically serialized (identifies what a spec was built for)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
