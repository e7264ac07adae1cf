"""The rules a spec must satisfy, built or loaded alike: layers, groups and block sizes agree;
the model identity fits the layers; every layer is what its build request gives it; the
stored graph I/O is the one the layers give."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from tqexport.errors import TQExportError
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.spec import kv_layers
from tqexport.spec.groups import build_groups
from tqexport.spec.limits import (
    INCONSISTENT,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
    MODEL_DTYPE_NAMES,
    REBUILD,
    SpecError,
)
from tqexport.spec.reading import (
    as_object,
    bad,
    choice_field,
    int_field,
    io_difference,
    known_keys,
    same,
    show,
    str_field,
)
from tqexport.validate import MAX_BLOCK_SIZE

if TYPE_CHECKING:
    from tqexport.spec.model import ModelSpec

#: the fields of the model identity (and "path" where a build recorded its source, and
#: "max_position_embeddings" where it recorded the model's position limit: older builds did not)
MODEL_KEYS = (
    "name",
    "architecture",
    "source",
    "config_digest",
    "num_layers",
    "num_heads",
    "vocab_size",
)


def check_structure(spec: ModelSpec) -> None:
    """Layers, groups and block sizes agree with each other (any spec, loaded or built)."""
    n = len(spec.layers)
    for pos, layer in enumerate(spec.layers):
        if layer.index != pos:
            raise SpecError(
                f"layer indices must be 0..{n - 1} in order; position {pos} holds layer "
                f"{layer.index}{REBUILD}"
            )
        for what, c in (("cache", layer.cache), ("recent cache", layer.recent)):
            if c is not None and c.block_size != spec.block_size:
                raise SpecError(
                    f"layer {pos}: {what} block_size {c.block_size} differs from the spec's "
                    f"block_size {spec.block_size}{INCONSISTENT}"
                )
            if c is not None and c.model_dtype != spec.dtype:
                raise SpecError(
                    f"layer {pos}: model_dtype {c.model_dtype} differs from the spec's dtype "
                    f"{spec.dtype}{INCONSISTENT}"
                )
    for pos, g in enumerate(spec.groups):
        if g.id != pos:
            raise SpecError(f"group ids must be 0..{len(spec.groups) - 1} in order{REBUILD}")
        if g.block_size != spec.block_size:
            raise SpecError(
                f"group {g.id}: block_size {g.block_size} differs from the spec's block_size "
                f"{spec.block_size}{INCONSISTENT}"
            )
        for ix in g.layers:
            if not 0 <= ix < n:
                raise SpecError(
                    f"group {g.id} names layer {ix}, but the spec has layers 0..{n - 1}{REBUILD}"
                )
    by_group = {g.id: g for g in spec.groups}
    for layer in spec.layers:
        g = by_group.get(layer.group)
        if g is None or g.recent or layer.index not in g.layers or g.window != layer.window:
            raise SpecError(f"layer {layer.index} is not in a cache group with its window{REBUILD}")
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
            raise SpecError(f"layer {layer.index} has a recent group but no recent cache{REBUILD}")
    held: dict[tuple[bool, int | None], list[int]] = {}  # (recent?, group id) -> layers
    for la in spec.layers:
        held.setdefault((False, la.group), []).append(la.index)
        if la.recent is not None:
            held.setdefault((True, la.recent_group), []).append(la.index)
    for g in spec.groups:
        claims = held.get((g.recent, g.id), [])
        if list(g.layers) != claims:
            kind = "recent-window caches" if g.recent else "caches"
            raise SpecError(
                f"group {g.id} lists layers {show(list(g.layers), full=True)} but the "
                f"layers whose {kind} it holds are {show(claims, full=True)}{REBUILD}"
            )
    want = build_groups(
        {la.index: la.window for la in spec.layers},
        spec.block_size,
        {la.index: la.recent_window for la in spec.layers if la.recent is not None},
        {la.index: la.sink_tokens for la in spec.layers if la.sink_tokens},
    )
    if spec.groups != want:
        raise SpecError(
            "the cache groups are not those the layers' windows give (one group per window, "
            "full attention first, windows ascending, then one per recent window)"
            f"{REBUILD}"
        )


def check_top(spec: ModelSpec) -> None:
    top = {"block_size": spec.block_size, "dtype": spec.dtype}
    top["tqexport_version"] = spec.tqexport_version
    int_field(top, "block_size", 1, MAX_BLOCK_SIZE, "spec")
    if spec.block_size & (spec.block_size - 1):
        raise SpecError(
            f"spec: field 'block_size' must be a power of two (the kernels' rule), got "
            f"{spec.block_size}{REBUILD}"
        )
    choice_field(top, "dtype", MODEL_DTYPE_NAMES, "spec")
    str_field(top, "tqexport_version", "spec", max_len=64)


def check_fields(spec: ModelSpec) -> None:
    """Beyond the structure: the model identity against the layers, the request
    (provenance) against the layers it produced, the graph I/O."""
    check_model_identity(spec.model, len(spec.layers))
    if spec.io is not None:
        as_object(spec.io, "spec: field 'io'")
    heads = spec.model.get("num_heads")
    for la in spec.layers:
        if heads is not None and heads % la.cache.num_kv_heads:
            raise SpecError(
                f"layer {la.index}: {la.cache.num_kv_heads} kv heads do not divide the "
                f"model's {heads} query heads{REBUILD}"
            )
    if spec.request is not None:
        check_request_layers(spec)
    if spec.io is not None:
        ours = spec.graph_io()
        if not same(spec.io, ours):
            raise SpecError(
                f"spec: field 'io' does not match the graph I/O its layers and groups give "
                f"({io_difference(spec.io, ours)}){INCONSISTENT}"
            )


def check_request_layers(spec: ModelSpec) -> None:
    """Every layer's dtype, recent window and sink tokens are what the request gives it:
    its ``kv_layers`` entry's, else the requested dtype unless skipped."""
    requested = spec.request.kv_cache_dtype
    if spec.request.block_size != spec.block_size:
        raise SpecError(
            f"request: block_size {spec.request.block_size} differs from the spec's block_size "
            f"{spec.block_size}{INCONSISTENT}"
        )
    rw, rs = spec.request.recent_window, spec.request.sink_tokens
    quantized = parse_kv_cache_dtype(requested).mode.is_quantized
    own: dict[int, kv_layers.LayerRange] = {}
    if spec.request.kv_layers is not None:
        try:
            ranges = kv_layers.parse_kv_layers(spec.request.kv_layers)
            own = kv_layers.covered(ranges, len(spec.layers))
        except TQExportError as e:
            raise SpecError(f"request: field 'kv_layers': {e}{REBUILD}") from None
    for pos, la in enumerate(spec.layers):
        if pos in own:
            r = own[pos]
            if la.kv_cache_dtype != r.dtype or la.skipped_by is not None:
                raise SpecError(
                    f"layer {la.index}: kv_cache_dtype {la.kv_cache_dtype!r} and skipped_by "
                    f"{show(la.skipped_by)} do not fit the request's kv_layers entry "
                    f"{r.text!r}{REBUILD}"
                )
            want, sinks = kv_layers.layer_recent(r, la.window, rw, rs)
            given = f"kv_layers entry {r.text!r}, recent_window {rw}, sink_tokens {rs}"
        else:
            if (la.kv_cache_dtype == requested) != (la.skipped_by is None):
                raise SpecError(
                    f"layer {la.index}: kv_cache_dtype {la.kv_cache_dtype!r} and skipped_by "
                    f"{show(la.skipped_by)} do not fit the requested {requested!r} (a layer "
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


DIGEST = re.compile(r"(sha256:[0-9a-f]{64})?")


def check_model_identity(value: Any, num_layers: int) -> dict[str, Any]:
    """The model identity: what the CLI prints (name), what the torch backend reloads (path,
    config_digest), what the graph and sampler size by (num_heads, vocab_size)."""
    m = as_object(value, "spec: field 'model'")
    known_keys(m, MODEL_KEYS, ("path", "max_position_embeddings"), "model")
    str_field(m, "name", "model")
    str_field(m, "architecture", "model", max_len=256)
    str_field(m, "source", "model", empty=True)
    if not DIGEST.fullmatch(str_field(m, "config_digest", "model", max_len=71, empty=True)):
        raise bad("model", "config_digest", '"" or "sha256:" and 64 hex digits', m["config_digest"])
    if int_field(m, "num_layers", 1, MAX_LAYERS, "model") != num_layers:
        raise SpecError(
            f"model: field 'num_layers' is {m['num_layers']} but the spec lists {num_layers} "
            f"layers{REBUILD}"
        )
    int_field(m, "num_heads", 1, MAX_HEADS, "model")
    int_field(m, "vocab_size", 0, MAX_VOCAB_SIZE, "model")
    if "path" in m:
        str_field(m, "path", "model")
    if "max_position_embeddings" in m:
        int_field(m, "max_position_embeddings", 1, MAX_POSITIONS, "model")
    return m
