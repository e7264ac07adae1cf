"""The per-layer spec, the single source of truth: every consumer (kernel, graph, plugin,
executor) reads a layer's own :class:`LayerSpec`. Sizes are derived properties, never stored
twice; the JSON carries them for readers without tqexport, and loading checks they still agree.

``cache`` (how one layer's cache is stored), ``layer``, ``groups`` and ``model`` are the layout;
``request`` the typed build request it is resolved from; ``checks`` the rules a spec must
satisfy; ``reading`` and ``load`` the strict JSON readers; ``graph_io`` the graph's names.
"""

from tqexport.spec.cache import (
    RECENT_PREFIX,
    AttentionType,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cache_spec,
    recent_label,
    recent_spec,
)
from tqexport.spec.graph_io import block_tables_name, slot_mapping_name
from tqexport.spec.groups import CacheGroup, build_groups
from tqexport.spec.layer import SKIP_BOUNDARY, SKIP_PATTERN_PREFIX, CacheBinding, LayerSpec
from tqexport.spec.limits import (
    INCONSISTENT,
    MAX_GROUPS,
    MAX_HEADS,
    MAX_INT_DIGITS,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_OPSET,
    MAX_POSITIONS,
    MAX_SPEC_BYTES,
    MAX_TEXT,
    MAX_VOCAB_SIZE,
    MAX_WINDOW,
    MODEL_DTYPE_NAMES,
    REBUILD,
    SCHEMA_VERSION,
    SpecError,
)
from tqexport.spec.load import layer_from_dict, spec_from_dict, spec_from_json
from tqexport.spec.model import ModelSpec, config_digest
from tqexport.spec.reading import parse_spec_json
from tqexport.spec.request import DEFAULT_OPSET, BuildRequest, parse_kv_scales

__all__ = [
    "layer_from_dict",
    "spec_from_dict",
    "spec_from_json",
    "DEFAULT_OPSET",
    "INCONSISTENT",
    "MAX_GROUPS",
    "MAX_HEADS",
    "MAX_INT_DIGITS",
    "MAX_KV_HEADS",
    "MAX_LAYERS",
    "MAX_POSITIONS",
    "MAX_OPSET",
    "MAX_SPEC_BYTES",
    "MAX_TEXT",
    "MAX_VOCAB_SIZE",
    "MAX_WINDOW",
    "MODEL_DTYPE_NAMES",
    "RECENT_PREFIX",
    "REBUILD",
    "SCHEMA_VERSION",
    "SKIP_BOUNDARY",
    "SKIP_PATTERN_PREFIX",
    "AttentionType",
    "BuildRequest",
    "CacheBinding",
    "CacheGroup",
    "FullAttentionSpec",
    "KVCacheSpec",
    "LayerSpec",
    "ModelSpec",
    "SlidingWindowSpec",
    "SpecError",
    "block_tables_name",
    "build_groups",
    "cache_spec",
    "config_digest",
    "parse_kv_scales",
    "parse_spec_json",
    "recent_label",
    "recent_spec",
    "slot_mapping_name",
]
