"""Strict JSON for spec files: the parser (size, depth, digits, duplicate keys, no NaN) and the
checked accessors every field of a loaded spec is read through, each failing with one line."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tqexport.spec.limits import (
    MAX_INT_DIGITS,
    MAX_SPEC_BYTES,
    MAX_TEXT,
    REBUILD,
    SCHEMA_VERSION,
    SpecError,
)


def parse_spec_json(text: str | bytes) -> Any:
    """Parse a spec file's bytes (or text) as strict JSON (:func:`strict_json`, at most
    :data:`MAX_SPEC_BYTES`); any other input raises :class:`SpecError` with one line."""
    return strict_json(text, "spec", REBUILD, MAX_SPEC_BYTES, SpecError)


class _Refused(Exception):
    """What a JSON hook refuses, as the end of a sentence about the file."""


def strict_json(text: str | bytes, what: str, fix: str, max_bytes: int,
                error: type[Exception] = SpecError) -> Any:  # fmt: skip
    """Parse ``text`` (bytes or text) as strict JSON: UTF-8, at most ``max_bytes``, no
    NaN/Infinity, no float out of range, no integer longer than :data:`MAX_INT_DIGITS` digits,
    no duplicate keys, no nesting deeper than Python's recursion limit. Anything else raises
    ``error`` with one line: ``what`` (the file), the problem, then ``fix``."""
    if len(text) > max_bytes:
        raise error(f"{what} is larger than {_size(max_bytes)}{fix}")
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(
                f"{what} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
                f"{fix}"
            ) from None
    elif not isinstance(text, str):
        raise error(f"{what} must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(
            text,
            parse_constant=_json_constant,
            parse_float=_json_float,
            parse_int=_json_int,
            object_pairs_hook=_json_object,
        )
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON ({e}){fix}") from None
    except RecursionError:
        raise error(f"{what} is not valid JSON (nested too deeply){fix}") from None
    except _Refused as e:
        raise error(f"{what} {e}{fix}") from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def _json_constant(name: str):
    raise _Refused(f"is not valid JSON ({name} is not a JSON number)")


def _json_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Refused(f"is not valid JSON (number {text[:40]} is out of range)")
    return x


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"has an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"has the key {dup[:40]!r} twice in one object")
    return d


# -- checked accessors: every field of a loaded spec is read through one of these -------------


def show(value: Any, full: bool = False) -> str:
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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be a JSON object, got {show(value)}{REBUILD}")
    return value


def need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}: missing field {key!r}{REBUILD}")
    return d[key]


def bad(where: str, key: str, want: str, value: Any) -> SpecError:
    return SpecError(f"{where}: field {key!r} must be {want}, got {show(value)}{REBUILD}")


def int_field(d, key: str, lo: int, hi: int, where: str, *, null: bool = False) -> int | None:
    value = need(d, key, where)
    if value is None and null:
        return None
    if not is_int(value) or not lo <= value <= hi:
        raise bad(where, key, f"an integer in {lo}..{hi}" + (" or null" if null else ""), value)
    return value


def float_field(d, key: str, where: str, *, null: bool = False) -> float | None:
    """A finite positive number (ints accepted, bools not), as float."""
    value = need(d, key, where)
    if value is None and null:
        return None
    if not (isinstance(value, int | float) and not isinstance(value, bool)) or not positive(value):
        raise bad(where, key, "a finite positive number" + (" or null" if null else ""), value)
    return float(value)


TEXT_BAD = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def str_field(d, key: str, where: str, *, max_len: int = MAX_TEXT, empty: bool = False) -> str:
    """Text of at most ``max_len`` characters, without control characters or lone surrogates
    (it is printed and re-serialized)."""
    value = need(d, key, where)
    if not isinstance(value, str) or len(value) > max_len or (not value and not empty):
        want = f"{'a' if empty else 'a non-empty'} string of at most {max_len} characters"
        raise bad(where, key, want, value)
    if TEXT_BAD.search(value):
        raise bad(where, key, "text without control characters", value)
    return value


def choice_field(d, key: str, options: tuple[str, ...], where: str) -> str:
    value = need(d, key, where)
    if not isinstance(value, str) or value not in options:
        raise bad(where, key, f"one of {', '.join(options)}", value)
    return value


def bool_field(d, key: str, where: str) -> bool:
    value = need(d, key, where)
    if not isinstance(value, bool):
        raise bad(where, key, "true or false", value)
    return value


def list_field(d, key: str, lo: int, hi: int, where: str) -> list[Any]:
    value = need(d, key, where)
    if not isinstance(value, list) or not lo <= len(value) <= hi:
        raise bad(where, key, f"a list of {lo}..{hi} items", value)
    return value


def known_keys(d: dict[str, Any], required, optional, where: str) -> None:
    for key in d:
        if key not in required and key not in optional:
            raise SpecError(
                f"{where}: unknown field {key[:40]!r} (schema version {SCHEMA_VERSION} has no "
                f"such field; a typo?){REBUILD}"
            )
    for key in required:
        need(d, key, where)


def exact_keys(d: dict[str, Any], ours: dict[str, Any], where: str) -> None:
    known_keys(d, tuple(ours), (), where)


def same(value: Any, ours: Any) -> bool:
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
            and all(same(v, o) for v, o in zip(value, ours, strict=True))
        )
    if isinstance(ours, dict):
        return (
            isinstance(value, dict)
            and value.keys() == ours.keys()
            and all(same(value[k], o) for k, o in ours.items())
        )
    return False


def io_difference(io: dict[str, Any], ours: dict[str, Any]) -> str:
    for kind in ("inputs", "outputs"):
        got, want = io.get(kind), ours[kind]
        if not isinstance(got, list):
            return f"{kind} is {show(got)}"
        for i, w in enumerate(want):
            if i >= len(got) or not same(got[i], w):
                return f"{kind} item {i} should be {w['name']!r}"
        if len(got) > len(want):
            return f"{kind} has {len(got) - len(want)} extra items"
    return f"fields {show(sorted(io), full=True)}"
