"""The ``--skip-layers`` grammar (layer = attention-layer index): ``5``, ``-1``, ``0-3``,
``sw``/``sliding_window``, ``full``, ``boundary:N`` (first and last N). Resolution applies the
patterns; the spec checks that the patterns it records still parse."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tqexport import validate
from tqexport.errors import ResolveError, TQExportError


@dataclass(frozen=True)
class SkipPattern:
    text: str
    kind: str  # "index" | "range" | "class" | "boundary"
    start: int = 0
    stop: int = 0  # inclusive for ranges
    attention: str | None = None  # an AttentionType value, for kind "class"

    def matches(self, layers: Sequence) -> set[int]:
        """Positions of the layers this pattern names; raises if it points outside the model."""
        n = len(layers)
        if self.kind == "index":
            if not -n <= self.start < n:
                raise ResolveError(
                    f"--skip-layers {self.text}: layer {self.start} is outside the model "
                    f"(attention layers 0..{n - 1}, or -{n}..-1 from the end)"
                )
            return {self.start % n}
        if self.kind == "range":
            if self.stop >= n:
                raise ResolveError(
                    f"--skip-layers {self.text}: range ends past the last layer ({n - 1})"
                )
            return set(range(self.start, self.stop + 1))
        if self.kind == "boundary":
            if self.start > n:
                raise ResolveError(
                    f"--skip-layers {self.text}: the model has only {n} attention layers"
                )
            return set(range(self.start)) | set(range(n - self.start, n))
        return {i for i, la in enumerate(layers) if la.attention_type.value == self.attention}


_CLASSES = {
    "sw": "sliding_window",
    "sliding_window": "sliding_window",
    "full": "full",
}
_SYNTAX = "use an index (5), a negative index (-1), a range (0-3), sw, full or boundary:N"


def _number(text: str, pattern: str, minimum: int, maximum: int) -> int:
    try:
        return validate.parse_int(text, f"--skip-layers {validate.clip(pattern)}: N", minimum,
                                  maximum)  # fmt: skip
    except TQExportError as e:
        raise ResolveError(str(e)) from None


def parse_skip_pattern(text: str) -> SkipPattern:
    t = text.strip().lower()
    n = validate.MAX_LAYERS
    if re.fullmatch(r"-?\d+", t):
        return SkipPattern(text, "index", start=_number(t, text, -n, n - 1))
    if m := re.fullmatch(r"(\d+)-(\d+)", t):
        a, b = _number(m[1], text, 0, n - 1), _number(m[2], text, 0, n - 1)
        if a > b:
            raise ResolveError(f"--skip-layers {text}: range start is after its end; write {b}-{a}")
        return SkipPattern(text, "range", start=a, stop=b)
    if t in _CLASSES:
        return SkipPattern(text, "class", attention=_CLASSES[t])
    if m := re.fullmatch(r"boundary:(\d+)", t):
        if m[1].strip("0") == "":
            raise ResolveError(f"--skip-layers {text}: N must be at least 1")
        return SkipPattern(text, "boundary", start=_number(m[1], text, 1, n))
    raise ResolveError(f"--skip-layers: malformed pattern {validate.clip(text)!r}; {_SYNTAX}")


def parse_skip_patterns(values: Sequence[str]) -> list[SkipPattern]:
    """Split repeated and comma-separated ``--skip-layers`` values into patterns."""
    out = []
    for value in values:
        if len(out) + value.count(",") >= validate.MAX_LAYERS:
            raise ResolveError(
                f"--skip-layers has more than {validate.MAX_LAYERS} patterns (a model has at "
                "most that many layers); use ranges such as 0-3"
            )
        for part in value.split(","):
            if not part.strip():
                raise ResolveError(f"--skip-layers: empty pattern in {value!r}; {_SYNTAX}")
            out.append(parse_skip_pattern(part))
    return out
