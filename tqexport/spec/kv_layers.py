"""The ``--kv-layers`` grammar: per-layer kv-cache formats, recent windows and sink tokens.

``RANGE:DTYPE[:wN][:sN]`` entries joined by commas, RANGE an attention-layer index (``5``) or an
inclusive range (``2-27``), e.g. ``0-1:auto,2-27:tqx_k4v2_mse:w64:s4,28-29:fp8``. ``wN`` keeps
the range's last N tokens in the model dtype (``--kv-recent-window`` for that range only), ``sN``
its first N tokens there too (``--kv-sink-tokens``). Layers no range covers get
``--kv-cache-dtype`` (with ``--skip-layers``, boundary protection and the global window).
Resolution and the spec loader both ask :func:`layer_recent` what a covered layer keeps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tqexport import validate
from tqexport.errors import ResolveError, TQExportError
from tqexport.kvquant.modes import parse_kv_cache_dtype

OPTION = "--kv-layers"
_SYNTAX = "write RANGE:DTYPE[:wN][:sN] entries joined by commas, e.g. 0-1:auto,2-27:fp8:w64"
_ENTRY = re.compile(r"(\d+)(?:-(\d+))?:([A-Za-z0-9_]+)((?::[ws]\d+)*)")


@dataclass(frozen=True)
class LayerRange:
    """One entry: layers ``start..stop`` (inclusive) take ``dtype``; ``recent_window`` and
    ``sink_tokens`` are None where the entry leaves them to the global options."""

    start: int
    stop: int
    dtype: str
    recent_window: int | None = None
    sink_tokens: int | None = None

    @property
    def text(self) -> str:
        """The entry in canonical form (what the spec records)."""
        where = str(self.start) if self.start == self.stop else f"{self.start}-{self.stop}"
        extra = "" if self.recent_window is None else f":w{self.recent_window}"
        extra += "" if self.sink_tokens is None else f":s{self.sink_tokens}"
        return f"{where}:{self.dtype}{extra}"


def _number(text: str, name: str, maximum: int) -> int:
    try:
        return validate.parse_int(text, name, 0, maximum)
    except TQExportError as e:
        raise ResolveError(str(e)) from None


def _entry(text: str) -> LayerRange:
    m = _ENTRY.fullmatch(text)
    shown = validate.clip(text)
    if m is None:
        raise ResolveError(f"{OPTION}: malformed entry {shown!r}; {_SYNTAX}")
    last = validate.MAX_LAYERS - 1
    start = _number(m[1], f"{OPTION} {shown}: a layer index", last)
    stop = _number(m[2], f"{OPTION} {shown}: a layer index", last) if m[2] is not None else start
    if start > stop:
        raise ResolveError(f"{OPTION} {text}: range start is after its end; write {stop}-{start}")
    try:
        entry = parse_kv_cache_dtype(m[3])
    except TQExportError as e:
        raise ResolveError(f"{OPTION} {text}: {e}") from None
    found: dict[str, int] = {}
    what = {"w": ("the recent window wN", validate.MAX_RECENT_WINDOW),
            "s": ("the sink tokens sN", validate.MAX_SINK_TOKENS)}  # fmt: skip
    for part in m[4].split(":")[1:]:
        if part[0] in found:
            raise ResolveError(f"{OPTION} {shown}: {part[0]}N is given twice; give it once")
        name, maximum = what[part[0]]
        found[part[0]] = _number(part[1:], f"{OPTION} {shown}: {name}", maximum)
    window, sinks = found.get("w"), found.get("s")
    if (window or sinks) and not entry.mode.is_quantized:
        raise ResolveError(
            f"{OPTION} {text}: {m[3]} is not quantized, so a recent window or sink tokens have "
            "no effect; drop them"
        )
    if sinks and window == 0:
        raise ResolveError(
            f"{OPTION} {text}: s{sinks} needs a recent window (the sink tokens are kept in "
            "it); give wN >= 1 or drop sN"
        )
    return LayerRange(start, stop, m[3], window, sinks)


def parse_kv_layers(text: str) -> tuple[LayerRange, ...]:
    """Every entry of ``text``, in order; one error naming the first bad or overlapping one."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise ResolveError(f"{OPTION} {validate.clip(text)!r} has an empty entry; {_SYNTAX}")
    if len(parts) > validate.MAX_LAYERS:
        raise ResolveError(
            f"{OPTION} has {len(parts)} entries, more than a model has layers "
            f"({validate.MAX_LAYERS} at most); join ranges as START-END:DTYPE"
        )
    ranges = tuple(_entry(p) for p in parts)
    for i, a in enumerate(ranges):
        for b in ranges[:i]:
            if a.start <= b.stop and b.start <= a.stop:
                both = sorted({max(a.start, b.start), min(a.stop, b.stop)})
                shown = "-".join(map(str, both))
                raise ResolveError(
                    f"{OPTION}: {b.text} and {a.text} both cover layer{'s' * (len(both) > 1)} "
                    f"{shown}; give each layer one entry"
                )
    return ranges


def canonical(ranges: tuple[LayerRange, ...]) -> str:
    """The entries as the spec records them (sorted by first layer, canonical form)."""
    return ",".join(r.text for r in sorted(ranges, key=lambda r: r.start))


def covered(ranges: tuple[LayerRange, ...], num_layers: int) -> dict[int, LayerRange]:
    """Layer position -> its entry; refuses an entry past the model's last attention layer."""
    out = {}
    for r in ranges:
        if r.stop >= num_layers:
            raise ResolveError(
                f"{OPTION} {r.text}: layer {r.stop} is outside the model (attention layers "
                f"0..{num_layers - 1}); end the range at {num_layers - 1} at most"
            )
        out |= dict.fromkeys(range(r.start, r.stop + 1), r)
    return out


def spans(positions: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for p in sorted(positions):
        if run and p != run[-1] + 1:
            out.append(run)
            run = []
        run.append(p)
    out += [run] if run else []
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def layer_recent(
    r: LayerRange, layer_window: int | None, recent_window: int, sink_tokens: int
) -> tuple[int, int]:
    """(recent window, sink tokens) a layer of entry ``r`` keeps: the entry's own wN/sN, else
    the global ``--kv-recent-window``/``--kv-sink-tokens`` for a quantized dtype; a sliding
    layer keeps at most its own window."""
    quantized = parse_kv_cache_dtype(r.dtype).mode.is_quantized
    window = r.recent_window if r.recent_window is not None else recent_window * quantized
    if not window:
        return 0, 0
    sinks = r.sink_tokens if r.sink_tokens is not None else sink_tokens
    return min(window, layer_window or window), sinks
