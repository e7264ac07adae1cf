"""From a model description, a kv-cache dtype and skip patterns to the per-layer spec.

After this step nothing reads the global kv dtype again: every layer carries its own cache spec
(the requested dtype is kept only as provenance in ``ModelSpec.request``).

Skip patterns (repeatable or comma-separated), layer = attention-layer index:
``5``, ``-1``, ``0-3``, ``sw``/``sliding_window``, ``full``, ``boundary:N`` (first and last N).
"""

from __future__ import annotations

from dataclasses import dataclass

from tqexport.errors import ResolveError, TQExportError
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.kvquant.transforms import KeyTransform, key_transform_label, refusal
from tqexport.models.description import ModelDescription
from tqexport.spec import (
    BuildRequest,
    LayerSpec,
    ModelSpec,
    build_groups,
    cache_spec,
    recent_spec,
)
from tqexport.spec.kv_layers import OPTION as KV_LAYERS
from tqexport.spec.kv_layers import covered, layer_recent, parse_kv_layers, spans
from tqexport.spec.skip_layers import parse_skip_patterns

UNQUANTIZED = "auto"
#: vLLM protects the first and last 2 attention layers of dense models for every TurboQuant preset
#: (``TurboQuantConfig.get_boundary_skip_layers``: at most ``L // 2`` on each side).
TURBOQUANT_BOUNDARY_LAYERS = 2


def turboquant_boundary(
    num_layers: int, n: int = TURBOQUANT_BOUNDARY_LAYERS, *, vllm: bool = True
) -> set[int]:
    """First and last ``n`` layers. vLLM presets cap ``n`` at half the layers, as vLLM does
    (``min(n, L // 2)`` per side: 2 and 4 layers are all protected, 1 layer none); tqexport-native
    ones (``vllm=False``) at a quarter, so at most half the layers are protected in total."""
    n = min(n, num_layers // 2 if vllm else num_layers // 4)
    return set(range(n)) | set(range(num_layers - n, num_layers))


def _boundary_warning(kv_cache_dtype: str, num_layers: int, protected: set[int]) -> list[str]:
    """A warning when the boundary protection leaves no layer quantized."""
    if len(protected) < num_layers:
        return []
    return [
        f"{kv_cache_dtype}: turboquant boundary protection (vLLM's first and last "
        f"min(2, L // 2) layers) keeps all {num_layers} attention layers unquantized; "
        "pass --no-boundary to quantize them"
    ]


@dataclass(frozen=True)
class Resolution:
    spec: ModelSpec
    warnings: tuple[str, ...]


def resolve(
    model: ModelDescription,
    request: BuildRequest,
    *,
    kv_scales: dict[int, tuple[float, float]] | None = None,
    key_transforms: dict[int, KeyTransform] | None = None,
) -> Resolution:
    """Decide every layer's cache for ``request`` (its fields: :class:`BuildRequest`); the spec
    records the request. ``boundary`` turns TurboQuant boundary protection on/off; a recent
    window N > 0 also keeps the last N tokens of every quantized layer in the model dtype (a
    sliding layer keeps at most its own window), and S sink tokens the first S tokens of every
    sequence there as well. The key transform names the kinds of exact key transform every
    quantized layer takes (checked here; with ``kv_layers``, every ``tqx_*`` layer, the others
    keeping plain keys). ``kv_layers`` (the ``--kv-layers`` grammar, :mod:`tqexport.spec.kv_layers`)
    gives ranges of layers their own dtype, window and sinks; the others get all of the above.
    Fitted values come beside the request: ``kv_scales`` maps layer index -> (k_scale,
    v_scale) for fp8/nvfp4 layers (default 1.0), ``key_transforms`` the fitted transforms per
    layer index (None: checked only, e.g. before weights load)."""
    kv_cache_dtype, skip_layers = request.kv_cache_dtype, request.skip_layers
    boundary, block_size = request.boundary, request.block_size
    recent_window, sink_tokens = request.recent_window, request.sink_tokens
    key_transform, kv_layers = request.key_transform, request.kv_layers
    entry = parse_kv_cache_dtype(kv_cache_dtype)
    ranges = parse_kv_layers(kv_layers) if kv_layers is not None else ()
    layers = model.layers
    if not layers:
        raise ResolveError(f"model {model.name!r} has no attention layers")
    warnings: list[str] = []
    own = covered(ranges, len(layers))
    if ranges:
        warnings += _coverage(own, len(layers), kv_cache_dtype, kv_layers)
    skipped: dict[int, str] = {}
    for pattern in parse_skip_patterns(skip_layers):
        hit = pattern.matches(layers)
        if both := sorted(hit & own.keys()):
            raise ResolveError(
                f"--skip-layers {pattern.text} and {KV_LAYERS} {own[both[0]].text} both choose "
                f"layer {both[0]}'s cache; drop the layer from one of them"
            )
        if not hit and pattern.kind == "class":
            warnings.append(
                f"--skip-layers {pattern.text}: model {model.name!r} has no "
                f"{pattern.attention} layers; nothing skipped by it"
            )
        for i in sorted(hit):
            skipped.setdefault(i, f"--skip-layers {pattern.text}")
    if entry.is_turboquant and boundary:
        protected = turboquant_boundary(len(layers), vllm=not entry.native) - own.keys()
        warnings += _boundary_warning(kv_cache_dtype, len(layers), protected)
        for i in sorted(protected):
            skipped.setdefault(i, "turboquant boundary")

    dtypes = {
        pos: own[pos].dtype if pos in own else UNQUANTIZED if pos in skipped else kv_cache_dtype
        for pos in range(len(layers))
    }
    recent, sinks = _recent(layers, own, skipped, recent_window, sink_tokens, kv_cache_dtype)
    groups = build_groups({la.index: la.window for la in layers}, block_size, recent, sinks)
    group_of = {ix: g.id for g in groups if not g.recent for ix in g.layers}
    recent_group_of = {ix: g.id for g in groups if g.recent for ix in g.layers}
    kv_scales = kv_scales or {}
    #: the layers a key transform applies to: every one the global dtype quantizes; with
    #: --kv-layers, every quantized layer whose dtype takes one (tqx_*: the others store plain
    #: keys, so a per-layer plan may mix fp8 and transformed tqx_* layers)
    keyed = {
        pos
        for pos in range(len(layers))
        if pos not in skipped and (not own or parse_kv_cache_dtype(dtypes[pos]).takes_key_transform)
    }
    if key_transform and own and not keyed:
        raise ResolveError(
            f"--kv-key-transform {key_transform_label(key_transform)} has no effect: "
            f"{KV_LAYERS} {kv_layers} and --kv-cache-dtype {kv_cache_dtype} give no layer a "
            "tqexport-native TurboQuant dtype (tqx_*); drop it"
        )
    for pos, la in enumerate(layers):
        layer_entry = parse_kv_cache_dtype(dtypes[pos])
        why = pos in keyed and refusal(key_transform, layer_entry.takes_key_transform, la.softcap)
        if why:
            raise ResolveError(
                f"--kv-key-transform {key_transform_label(key_transform)}: layer {la.index}: {why}"
            )
    specs = []
    for pos, la in enumerate(layers):
        dtype = dtypes[pos]
        scaled = parse_kv_cache_dtype(dtype).mode.uses_layer_scales
        k_scale, v_scale = kv_scales.get(la.index, (1.0, 1.0)) if scaled else (1.0, 1.0)
        try:
            cache = cache_spec(
                la.window,
                kv_cache_dtype=dtype,
                num_kv_heads=la.num_kv_heads,
                head_size=la.head_size,
                block_size=block_size,
                model_dtype=model.dtype,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        except TQExportError as e:
            raise ResolveError(f"layer {la.index} (head_size {la.head_size}): {e}") from None
        specs.append(
            LayerSpec(
                index=la.index,
                module=la.module,
                cache=cache,
                scale=la.scale,
                softcap=la.softcap,
                group=group_of[la.index],
                skipped_by=skipped.get(pos) if pos not in own and dtype != kv_cache_dtype else None,
                recent=recent_spec(cache, recent[la.index]) if la.index in recent else None,
                recent_group=recent_group_of.get(la.index),
                key_transform=(key_transforms or {}).get(la.index) if pos in keyed else None,
                sink_tokens=sinks.get(la.index, 0),
            )
        )
    spec = ModelSpec(
        model=model.identity(),
        dtype=model.dtype,
        block_size=block_size,
        layers=tuple(specs),
        groups=groups,
        request=request,
    )
    return Resolution(spec, tuple(warnings))


def _coverage(own: dict, num_layers: int, kv_cache_dtype: str, text: str) -> list[str]:
    """What the layers no ``--kv-layers`` entry covers get (a warning), or why
    ``--kv-cache-dtype`` has no effect (every layer covered)."""
    left = [pos for pos in range(num_layers) if pos not in own]
    if not left:
        if kv_cache_dtype != UNQUANTIZED:
            raise ResolveError(
                f"--kv-cache-dtype {kv_cache_dtype} has no effect: {KV_LAYERS} {text} covers "
                "every layer; drop it, or leave the layers it should cover out of --kv-layers"
            )
        return []
    return [
        f"{KV_LAYERS} leaves layers {spans(left)} out: they get --kv-cache-dtype "
        f"{kv_cache_dtype} (give them an entry to choose otherwise)"
    ]


def _recent(layers, own, skipped, recent_window, sink_tokens, kv_cache_dtype):
    """Each layer's recent window and sink tokens ({layer index: N}, only where N > 0): a
    covered layer's from its entry (else the global options), the others' from the global
    options where their dtype is quantized; refuses a global option no layer takes."""
    recent, sinks, takers = {}, {}, 0
    global_dtype = parse_kv_cache_dtype(kv_cache_dtype).mode.is_quantized
    for pos, la in enumerate(layers):
        if pos in own:
            r = own[pos]
            window, sink = layer_recent(r, la.window, recent_window, sink_tokens)
            if r.sink_tokens and not window:
                raise ResolveError(
                    f"{KV_LAYERS} {r.text}: s{r.sink_tokens} needs a recent window (the sink "
                    "tokens are kept in it); add wN to the entry or give --kv-recent-window"
                )
            takers += r.recent_window is None and window > 0
        elif global_dtype and pos not in skipped and recent_window:
            window, sink = min(recent_window, la.window or recent_window), sink_tokens
            takers += 1
        else:
            window, sink = 0, 0
        if window:
            recent[la.index] = window
        if sink:
            sinks[la.index] = sink
    if recent_window and not own and not parse_kv_cache_dtype(kv_cache_dtype).mode.is_quantized:
        raise ResolveError(
            f"--kv-recent-window {recent_window} has no effect: --kv-cache-dtype "
            f"{kv_cache_dtype} is not quantized; drop it"
        )
    if recent_window and own and not takers:
        raise ResolveError(
            f"--kv-recent-window {recent_window} has no effect: every quantized layer has its "
            f"own wN in {KV_LAYERS} or none is quantized; drop it"
        )
    return recent, sinks
