"""Reading a spec back from JSON: every stored field type- and range-checked, every derived
field compared with what this tqexport derives, each failure one line (:class:`SpecError`)."""

from __future__ import annotations

from typing import Any

from tqexport import __version__
from tqexport.errors import TQExportError
from tqexport.kvquant import transforms
from tqexport.kvquant.codecs import MAX_HEAD_SIZE
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.kvquant.transforms import KeyTransform
from tqexport.spec.cache import KVCacheSpec, cache_spec, recent_spec
from tqexport.spec.groups import CacheGroup
from tqexport.spec.layer import SKIP_BOUNDARY, SKIP_PATTERN_PREFIX, LayerSpec
from tqexport.spec.limits import (
    MAX_GROUPS,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_WINDOW,
    MODEL_DTYPE_NAMES,
    REBUILD,
    SCHEMA_VERSION,
    SpecError,
)
from tqexport.spec.model import ModelSpec
from tqexport.spec.reading import (
    as_object,
    bad,
    bool_field,
    choice_field,
    exact_keys,
    float_field,
    int_field,
    is_int,
    known_keys,
    list_field,
    need,
    parse_spec_json,
    same,
    show,
    str_field,
)
from tqexport.spec.request import request_from_dict
from tqexport.spec.skip_layers import parse_skip_pattern
from tqexport.spec.weights import weights_from_dict
from tqexport.validate import MAX_BLOCK_SIZE, MAX_RECENT_WINDOW, MAX_SINK_TOKENS

TOP_KEYS = (
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
LAYER_KEYS = (
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
RECENT_KEYS = (
    "window",
    "kv_cache_dtype",
    "storage_dtype",
    "group",
    "bytes_per_token_head",
    "page_size_bytes",
)


def spec_from_json(text: str | bytes) -> ModelSpec:
    """The spec of a ``tqexport.json``'s bytes or text (strict JSON, every field checked)."""
    return spec_from_dict(parse_spec_json(text))


def spec_from_dict(d: Any) -> ModelSpec:
    """The spec of a parsed ``tqexport.json``. Total: any JSON value gives a spec whose
    fields are all checked and agree with each other, or raises :class:`SpecError`."""
    try:
        return _spec_from_dict(d)
    except RecursionError:
        raise SpecError(f"spec nests too deeply{REBUILD}") from None


def _spec_from_dict(d: Any) -> ModelSpec:
    d = as_object(d, "spec")
    version = d.get("schema_version")
    if not is_int(version) or version != SCHEMA_VERSION:
        shown = version if version is None or is_int(version) else show(version)
        raise SpecError(
            f"spec schema version {shown} is not supported by tqexport "
            f"{__version__} (it reads version {SCHEMA_VERSION}); rebuild the artifact with "
            "this tqexport or use the tqexport version that built it"
        )
    known_keys(d, TOP_KEYS, ("weights",), "spec")
    block_size = int_field(d, "block_size", 1, MAX_BLOCK_SIZE, "spec")
    layers = list_field(d, "layers", 1, MAX_LAYERS, "spec")
    groups = list_field(d, "groups", 1, MAX_GROUPS, "spec")
    dtype = choice_field(d, "dtype", MODEL_DTYPE_NAMES, "spec")
    return ModelSpec(  # its checks do the rest: structure, model, request against layers, io
        model=d["model"],
        dtype=dtype,
        block_size=block_size,
        layers=tuple(layer_from_dict(x, i) for i, x in enumerate(layers)),
        groups=tuple(group_from_dict(x, i) for i, x in enumerate(groups)),
        request=request_from_dict(d["request"], block_size),
        io=d["io"],
        tqexport_version=d["tqexport_version"],
        weights=weights_from_dict(d["weights"]) if "weights" in d else None,
    )


def layer_from_dict(d: Any, position: int | None = None) -> LayerSpec:
    """A layer from its ``to_dict`` form; every stored field is type- and range-checked and
    every derived field must equal what this tqexport derives (else :class:`SpecError`)."""
    if position is None:  # called on one layer: name it by its index field if it has one
        index = d.get("index") if isinstance(d, dict) else None
        position = index if is_int(index) and 0 <= index < MAX_LAYERS else None
    where = f"layer {'?' if position is None else position}"
    d = as_object(d, where)
    known_keys(d, LAYER_KEYS, ("recent", "key_transform"), where)
    index = int_field(d, "index", 0, MAX_LAYERS - 1, where)
    if position is not None and index != position:
        raise SpecError(
            f"{where}: field 'index' must be {position} (layers are listed in index "
            f"order 0..n-1), got {index}{REBUILD}"
        )
    window = int_field(d, "window", 1, MAX_WINDOW, where, null=True)
    kv_cache_dtype = str_field(d, "kv_cache_dtype", where, max_len=64)
    model_dtype = choice_field(d, "model_dtype", MODEL_DTYPE_NAMES, where)
    constants = as_object(need(d, "constants", where), f"{where}: field 'constants'")
    scales = {
        name: float_field(constants, name, f"{where} constants") if name in constants else 1.0
        for name in ("k_scale", "v_scale")
    }
    recent = None
    if "recent" in d:
        recent = as_object(d["recent"], f"{where}: field 'recent'")
        known_keys(recent, RECENT_KEYS, ("sink_tokens",), f"{where} recent")
        recent_window = int_field(recent, "window", 1, MAX_RECENT_WINDOW, f"{where} recent")
        recent_group = int_field(recent, "group", 0, MAX_GROUPS - 1, f"{where} recent")
        sink_tokens = (
            int_field(recent, "sink_tokens", 1, MAX_SINK_TOKENS, f"{where} recent")
            if "sink_tokens" in recent
            else 0
        )
    try:
        cache = cache_spec(
            window,
            kv_cache_dtype=kv_cache_dtype,
            num_kv_heads=int_field(d, "num_kv_heads", 1, MAX_KV_HEADS, where),
            head_size=int_field(d, "head_size", 1, MAX_HEAD_SIZE, where),
            block_size=int_field(d, "block_size", 1, MAX_BLOCK_SIZE, where),
            model_dtype=model_dtype,
            **scales,
        )
        layer = LayerSpec(
            index=index,
            module=str_field(d, "module", where),
            cache=cache,
            scale=float_field(d, "scale", where),
            softcap=float_field(d, "softcap", where, null=True),
            group=int_field(d, "group", 0, MAX_GROUPS - 1, where),
            skipped_by=skipped_by_from_dict(d, where),
            recent=None if recent is None else recent_spec(cache, recent_window),
            recent_group=None if recent is None else recent_group,
            key_transform=key_transform_from_dict(d, cache, where),
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
            f"kv_cache_dtype is {show(kv_cache_dtype)}{REBUILD}"
        )
    if layer.recent is not None and not layer.mode.is_quantized:
        raise SpecError(
            f"{where}: an unquantized layer ({show(kv_cache_dtype)}) has no recent-window "
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
    exact_keys(d, ours, where)
    for key, value in d.items():
        if not same(value, ours[key]):
            raise SpecError(
                f"{where}: field {key!r} is {show(value)} but {kv_cache_dtype!r} with this "
                f"shape means {show(ours[key], full=True)}; the spec is inconsistent, "
                "rebuild the artifact"
            )
    return layer


def group_from_dict(d: Any, position: int | None = None) -> CacheGroup:
    where = f"group {'?' if position is None else position}"
    d = as_object(d, where)
    known_keys(d, ("id", "window", "block_size", "layers"), ("recent", "sink_tokens"), where)
    gid = int_field(d, "id", 0, MAX_GROUPS - 1, where)
    if position is not None and gid != position:
        raise SpecError(
            f"{where}: field 'id' must be {position} (groups are listed in id order "
            f"0..n-1), got {gid}{REBUILD}"
        )
    recent = bool_field(d, "recent", where) if "recent" in d else False
    sink_tokens = 0
    if "sink_tokens" in d:
        if not recent:
            raise SpecError(
                f"{where}: field 'sink_tokens' belongs to a recent-window group only{REBUILD}"
            )
        sink_tokens = int_field(d, "sink_tokens", 1, MAX_SINK_TOKENS, where)
    if recent:
        window = int_field(d, "window", 1, MAX_RECENT_WINDOW, where)
    else:
        window = int_field(d, "window", 1, MAX_WINDOW, where, null=True)
    block_size = int_field(d, "block_size", 1, MAX_BLOCK_SIZE, where)
    layers = list_field(d, "layers", 1, MAX_LAYERS, where)
    for i, x in enumerate(layers):
        if not (is_int(x) and 0 <= x < MAX_LAYERS) or (i and x <= layers[i - 1]):
            raise SpecError(
                f"{where}: field 'layers' must list layer indices in increasing order, each "
                f"once; item {i} is {show(x)}{REBUILD}"
            )
    return CacheGroup(gid, window, block_size, tuple(layers), recent, sink_tokens)


def key_transform_from_dict(
    d: dict[str, Any], cache: KVCacheSpec, where: str
) -> KeyTransform | None:
    """The layer's stored key transform (None when absent); its values are compared with the
    re-derived form afterwards, like every other field."""
    if "key_transform" not in d:
        return None
    kt = as_object(d["key_transform"], f"{where}: field 'key_transform'")
    known_keys(kt, ("version", "kinds", "seed", "center", "scale"), (), f"{where} key_transform")
    try:
        return transforms.from_dict(kt, cache.num_kv_heads, cache.head_size)
    except TQExportError as e:
        raise SpecError(f"{where}: field 'key_transform': {e}{REBUILD}") from None
    except (TypeError, ValueError, OverflowError):
        raise SpecError(
            f"{where}: field 'key_transform' must hold lists of numbers{REBUILD}"
        ) from None


def skipped_by_from_dict(d: dict[str, Any], where: str) -> str | None:
    """None, or a reason resolve writes: boundary protection or a ``--skip-layers`` pattern."""
    value = need(d, "skipped_by", where)
    if value is None or value == SKIP_BOUNDARY:
        return value
    if isinstance(value, str) and value.startswith(SKIP_PATTERN_PREFIX):
        str_field(d, "skipped_by", where, max_len=256)
        try:
            parse_skip_pattern(value[len(SKIP_PATTERN_PREFIX) :])
            return value
        except TQExportError:
            pass
    raise bad(
        where, "skipped_by", f'null, "{SKIP_BOUNDARY}" or "{SKIP_PATTERN_PREFIX}PATTERN"', value
    )
