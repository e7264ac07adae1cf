"""What a build is asked for: one typed, frozen request, checked when made, that the command line
builds once and ``resolve``, ``plan``, ``build``, ``bench`` and calibration all take. The spec
records it as ``request`` (provenance that ``bench`` reads back); :func:`request_from_dict`
reads it back as strictly as every other field."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqexport import validate
from tqexport.errors import ResolveError, TQExportError
from tqexport.kvquant import transforms
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.spec import kv_layers
from tqexport.spec.limits import (
    MAX_LAYERS,
    MAX_OPSET,
    MAX_TEXT,
    MODEL_DTYPE_NAMES,
    REBUILD,
    SpecError,
)
from tqexport.spec.reading import (
    as_object,
    bad,
    bool_field,
    choice_field,
    int_field,
    known_keys,
    list_field,
    need,
    positive,
    str_field,
)
from tqexport.spec.skip_layers import parse_skip_patterns
from tqexport.validate import DEFAULT_BLOCK_SIZE, MAX_RECENT_WINDOW, MAX_SINK_TOKENS

#: the ONNX opsets a build may target: fp8 casts need 21
DEFAULT_OPSET, MAX_BUILD_OPSET = 21, 23
#: ``--kv-scales``: a number every fp8/nvfp4 layer takes, or this word (fitted per layer)
CALIBRATE_SCALES = "calibrate"
DEFAULT_KV_SCALES = "1.0"
#: ``--weights``: how the matrices are stored (:mod:`tqexport.weights.precision` says what each
#: means per source); a spec recorded before the option existed stored them as fp32
WEIGHTS = ("auto", "fp32", "fp16", "int8", "int4")
DEFAULT_WEIGHTS, UNRECORDED_WEIGHTS = "auto", "fp32"
#: the options whose explicit use :meth:`BuildRequest.check_given` judges (field names)
GIVEN_RULES = ("boundary", "kv_scales")


def parse_kv_scales(value: str) -> float | None:
    """``--kv-scales`` as the scale every layer takes, None for ``calibrate``."""
    if value == CALIBRATE_SCALES:
        return None
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise TQExportError(f"--kv-scales must be a number or 'calibrate', got {value!r}") from None
    if not 0 < scale < float("inf"):  # also refuses nan: tqexport.json must stay JSON
        raise TQExportError(f"--kv-scales must be a positive finite number, got {value}")
    return scale


@dataclass(frozen=True)
class BuildRequest:
    """Every option that decides a build's spec and graph, each checked here with the one-line
    message the command line prints. ``dtype`` and ``calibration_text`` are inputs only (the
    spec records its dtype at the top; the text is not kept), so they do not count in ``==``."""

    kv_cache_dtype: str = "auto"
    #: ``--skip-layers`` patterns as given (recorded as given)
    skip_layers: tuple[str, ...] = ()
    boundary: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    recent_window: int = 0
    sink_tokens: int = 0
    #: ``--kv-key-transform`` kinds (a label such as ``center+signs`` is parsed)
    key_transform: tuple[str, ...] = ()
    #: ``--kv-layers`` in canonical form (entries sorted by first layer)
    kv_layers: str | None = None
    #: ``--kv-scales`` as given: a number, or ``calibrate``
    kv_scales: str = DEFAULT_KV_SCALES
    opset: int = DEFAULT_OPSET
    weights: str = DEFAULT_WEIGHTS
    #: the compute dtype (None: the config's)
    dtype: str | None = field(default=None, compare=False)
    calibration_text: Path | None = field(default=None, compare=False)

    def __post_init__(self):
        put = object.__setattr__
        parse_kv_cache_dtype(self.kv_cache_dtype)
        skip = self.skip_layers
        skip = (skip,) if isinstance(skip, str) else tuple(skip or ())
        parse_skip_patterns(skip)
        put(self, "skip_layers", skip)
        if not isinstance(self.boundary, bool):
            raise TQExportError(f"--boundary must be true or false, got {self.boundary!r}")
        validate.block_size(self.block_size)
        validate.recent_window(self.recent_window)
        validate.sink_tokens(self.sink_tokens)
        if self.sink_tokens and not self.recent_window:
            raise ResolveError(
                f"--kv-sink-tokens {self.sink_tokens} needs --kv-recent-window >= 1: the sink "
                "tokens are kept in the recent-window cache"
            )
        kinds = self.key_transform
        if not isinstance(kinds, str):
            kinds = transforms.key_transform_label(tuple(kinds))
        put(self, "key_transform", transforms.parse_key_transform(kinds))
        if self.kv_layers is not None:
            put(self, "kv_layers", kv_layers.canonical(kv_layers.parse_kv_layers(self.kv_layers)))
        put(self, "kv_scales", str(self.kv_scales))
        fixed = parse_kv_scales(self.kv_scales)
        validate.integer(self.opset, "--opset")
        if not DEFAULT_OPSET <= self.opset <= MAX_BUILD_OPSET:
            raise TQExportError(
                f"--opset must be {DEFAULT_OPSET}..{MAX_BUILD_OPSET} (fp8 casts need "
                f"{DEFAULT_OPSET}+), got {self.opset}"
            )
        validate.choice(self.weights, "--weights", WEIGHTS)
        if self.dtype is not None:
            validate.choice(self.dtype, "--dtype", MODEL_DTYPE_NAMES)
        if self.calibration_text is not None:
            put(self, "calibration_text", Path(self.calibration_text))
            if fixed is not None and not transforms.needs_text(self.key_transform):
                raise TQExportError(
                    "--calibration-text is read only by --kv-scales calibrate (and "
                    "--kv-key-transform center or smooth); add --kv-scales calibrate or drop "
                    "--calibration-text"
                )

    @property
    def fixed_kv_scale(self) -> float | None:
        """The scale every fp8/nvfp4 layer takes, None when ``--kv-scales calibrate`` fits them."""
        return parse_kv_scales(self.kv_scales)

    @property
    def key_transform_label(self) -> str:
        return transforms.key_transform_label(self.key_transform)

    def dtype_names(self) -> list[str]:
        """Every kv dtype the request names: the global one and each ``--kv-layers`` entry's."""
        ranges = kv_layers.parse_kv_layers(self.kv_layers) if self.kv_layers else ()
        return [self.kv_cache_dtype, *(r.dtype for r in ranges)]

    def check_given(self, given: Collection[str], layers_pending: bool = False) -> None:
        """The command line's rule for options it names in ``given`` (field names): an option
        given explicitly must change something, else one line says so. ``layers_pending``:
        ``--kv-bits`` has yet to choose the layers, so ``--kv-scales`` is judged after it."""
        entry = parse_kv_cache_dtype(self.kv_cache_dtype)
        if "boundary" in given and not entry.is_turboquant:
            flag = "--boundary" if self.boundary else "--no-boundary"
            raise TQExportError(
                f"{flag} has no effect: --kv-cache-dtype {self.kv_cache_dtype} is not TurboQuant; "
                "drop it"
            )
        if self.skip_layers and self.kv_cache_dtype == "auto":
            raise TQExportError(
                "--skip-layers has no effect with --kv-cache-dtype auto (no layer is quantized); "
                "give a quantized dtype or drop it"
            )
        scaled = any(parse_kv_cache_dtype(n).mode.uses_layer_scales for n in self.dtype_names())
        if "kv_scales" in given and not layers_pending and not scaled:
            where = f"--kv-cache-dtype {self.kv_cache_dtype}" + (
                " nor --kv-layers" if self.kv_layers else ""
            )
            raise TQExportError(
                f"--kv-scales {self.kv_scales} has no effect: {where} has no per-layer scales "
                "(fp8 and nvfp4 have); drop it"
            )

    def to_dict(self) -> dict[str, Any]:
        """The spec's ``request`` (optional fields only where set, as every build wrote them)."""
        return (
            {
                "kv_cache_dtype": self.kv_cache_dtype,
                "skip_layers": list(self.skip_layers),
                "boundary": self.boundary,
            }
            | ({"recent_window": self.recent_window} if self.recent_window else {})
            | ({"sink_tokens": self.sink_tokens} if self.sink_tokens else {})
            | ({"key_transform": self.key_transform_label} if self.key_transform else {})
            | ({"kv_layers": self.kv_layers} if self.kv_layers is not None else {})
            | {"kv_scales": self.kv_scales, "opset": self.opset, "weights": self.weights}
        )


#: the fields of a recorded request: the first is required, the others default
REQUEST_KEYS = (
    "kv_cache_dtype", "skip_layers", "boundary", "recent_window", "kv_scales", "opset",
    "key_transform", "sink_tokens", "kv_layers", "weights",
)  # fmt: skip


def request_from_dict(value: Any, block_size: int = DEFAULT_BLOCK_SIZE) -> BuildRequest | None:
    """The recorded request of a loaded spec (None for ``{}``: not recorded), every field
    checked; one :class:`SpecError` line naming the first bad one. The block size is recorded
    once, at the spec's top, so the reader passes it."""
    r = as_object(value, "spec: field 'request'")
    if not r:
        return None
    known_keys(r, (), REQUEST_KEYS, "request")
    need(r, "kv_cache_dtype", "request")
    fields: dict[str, Any] = {"block_size": block_size}

    def check(name: str, text: Any, parse, prefix: str = "request: ") -> None:
        try:
            parse(text)
        except TQExportError as e:
            raise SpecError(f"{prefix}{e}{REBUILD}") from None
        fields[name] = text

    text = str_field(r, "kv_cache_dtype", "request", max_len=64)
    check("kv_cache_dtype", text, parse_kv_cache_dtype)
    if "kv_layers" in r:
        text = str_field(r, "kv_layers", "request", max_len=MAX_TEXT)
        check("kv_layers", text, kv_layers.parse_kv_layers, "request: field 'kv_layers': ")
    if "key_transform" in r:
        text = str_field(r, "key_transform", "request", max_len=64)
        check("key_transform", text, transforms.parse_key_transform)
    if "skip_layers" in r:
        patterns = list_field(r, "skip_layers", 0, MAX_LAYERS, "request")
        for i, pattern in enumerate(patterns):
            str_field({"skip_layers": pattern}, "skip_layers", f"request item {i}", max_len=256)
        check("skip_layers", tuple(patterns), parse_skip_patterns, "request: field 'skip_layers': ")
    if "boundary" in r:
        fields["boundary"] = bool_field(r, "boundary", "request")
    if "recent_window" in r:
        fields["recent_window"] = int_field(r, "recent_window", 0, MAX_RECENT_WINDOW, "request")
    if "sink_tokens" in r:
        fields["sink_tokens"] = int_field(r, "sink_tokens", 1, MAX_SINK_TOKENS, "request")
        if not fields.get("recent_window"):
            raise SpecError(
                f"request: field 'sink_tokens' needs a recent_window (the sink tokens live in "
                f"the recent-window cache){REBUILD}"
            )
    if "kv_scales" in r:
        fields["kv_scales"] = _kv_scales(r["kv_scales"])
    if "opset" in r:
        fields["opset"] = int_field(r, "opset", 1, MAX_OPSET, "request")
    fields["weights"] = (
        choice_field(r, "weights", WEIGHTS, "request") if "weights" in r else UNRECORDED_WEIGHTS
    )
    try:
        return BuildRequest(**fields)
    except TQExportError as e:
        raise SpecError(f"request: {e}{REBUILD}") from None


def _kv_scales(scales: Any) -> str:
    """A recorded ``kv_scales``: "calibrate", a positive number, or one as text."""
    if isinstance(scales, str) and scales != CALIBRATE_SCALES:
        try:
            ok = len(scales) <= 64 and positive(float(scales))
        except ValueError:
            ok = False
    else:
        ok = scales == CALIBRATE_SCALES or (
            isinstance(scales, int | float) and not isinstance(scales, bool) and positive(scales)
        )
    if not ok:
        raise bad("request", "kv_scales", '"calibrate" or a positive number', scales)
    return str(scales)
