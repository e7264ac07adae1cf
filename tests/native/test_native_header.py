"""The native kernels' tables come from the Python registry: a new dtype name needs no C++ edit.

Cheap (no ONNX Runtime, no library build): the generated header's text and the C++ sources.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tqexport.kvquant import codecs, modes
from tqexport.kvquant.modes import KV_CACHE_DTYPES, KVCacheDType, KVQuantMode
from tqexport.native import build, header
from tqexport.ops import attributes

SOURCES = sorted(build.SOURCE_DIR.glob("*.cc")) + sorted(build.SOURCE_DIR.glob("*.h"))
THROWAWAY = KVCacheDType(
    "tqx_throwaway_int8", KVQuantMode.INT8_PER_TOKEN_HEAD, "int8", 8, "test only", native=True
)


@pytest.fixture
def throwaway(monkeypatch):
    """The registry with one more dtype name over an existing encoding (in-process only)."""
    monkeypatch.setitem(modes.KV_CACHE_DTYPES, THROWAWAY.name, THROWAWAY)
    return THROWAWAY


def _block(lines: list[str], opening: str) -> list[str]:
    """The rows of one generated array."""
    start = lines.index(opening) + 1
    return lines[start : lines.index("};", start)]


def test_a_registered_dtype_adds_only_its_rows_to_the_generated_tables(throwaway):
    with pytest.MonkeyPatch.context() as m:
        m.delitem(modes.KV_CACHE_DTYPES, throwaway.name)
        before = header._tensor_lines()
    after = header._tensor_lines()
    tensors = "inline constexpr TensorEntry kTensors[] = {"
    dtypes = "inline constexpr DtypeEntry kDtypes[] = {"
    row = next(r for r in _block(before, dtypes) if '"int8_per_token_head"' in r)
    first, count = map(int, re.findall(r"(\d+), (\d+)}", row)[0])
    old = _block(before, tensors)
    assert _block(after, tensors) == old + old[first : first + count]
    assert _block(after, dtypes) == [
        *_block(before, dtypes),
        f'    {{"{throwaway.name}", Mode::INT8_PER_TOKEN_HEAD, nullptr, {len(old)}, {count}}},',
    ]
    assert len(after) == len(before) + count + 1  # nothing else was added


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_the_kernels_compile_against_a_header_with_a_registered_dtype(throwaway, tmp_path):
    (tmp_path / "tqx_generated.h").write_text(header.render())
    assert throwaway.name in (tmp_path / "tqx_generated.h").read_text()
    res = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
         f"-I{tmp_path}", f"-I{build.SOURCE_DIR}", str(build.SOURCE_DIR / "formats.cc")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr


def test_the_cpp_sources_retype_no_registry_name():
    """Dtype, element, model-dtype and tensor-role names reach the format code only through the
    header; ops.cc (which names ONNX types and op inputs, a vocabulary of its own) no dtype and
    no op, domain or node attribute name."""
    dtypes = set(KV_CACHE_DTYPES) - {"auto"}  # "auto": the recent window's cache (spec.cache)
    names = dtypes | {d.element for d in KV_CACHE_DTYPES.values()} | set(codecs.TENSOR_DTYPES)
    names |= {t.role for n in KV_CACHE_DTYPES for t in codecs.cache_tensors(n, 128)}
    onnx_types = set(codecs.TENSOR_DTYPES)  # ops.cc's type names ("float16" is a dtype too)
    node = {attributes.DOMAIN, attributes.CACHE_WRITE, attributes.PAGED_ATTENTION}
    for table in (attributes.CACHE_ATTRS, attributes.ATTENTION_ATTRS, attributes.SEGMENT_ATTRS,
                  attributes.NODE_ATTRS):  # fmt: skip
        node |= set(table)
    for src in SOURCES:
        quoted = set(re.findall(r'"([A-Za-z0-9_]+)"', src.read_text()))
        found = quoted & ((dtypes - onnx_types) | node if src.name == "ops.cc" else names)
        assert not found, f"{src.name} retypes {sorted(found)}"


def test_a_new_mode_needs_its_arithmetic_in_the_two_places_the_header_names():
    """A new encoding (a KVQuantMode) is code: its encode in plugins/formats.cc and its decode in
    plugins/decode.h, each a case of a switch on Mode; every mode has both."""
    assert "plugins/formats.cc" in header.__doc__ and "plugins/decode.h" in header.__doc__
    for src in ("formats.cc", "decode.h"):
        text = (build.SOURCE_DIR / src).read_text()
        for mode in KVQuantMode:
            assert f"case Mode::{mode.name}" in text, f"{src} has no case for {mode.name}"
