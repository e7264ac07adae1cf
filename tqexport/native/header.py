"""The C++ header of the native kernels' constants, generated from the Python definitions.

The ONNX Runtime kernels in ``plugins/`` never retype a format: the dtype registry, each
format's cache tensors (roles, element types, widths per head size, from the codecs), the
element and model dtypes, the TurboQuant presets and slot layouts, the codebooks and their
store thresholds, the fp8 formats and the numeric constants of every codec come from this
header, written from :mod:`tqexport.kvquant` at build time (so it cannot drift from the
reference codecs), and so do the op and node attribute names (:mod:`tqexport.ops.attributes`).
A new dtype name over an existing mode needs no C++ edit; a new mode's encode and decode
arithmetic is the one thing written by hand (``plugins/formats.cc`` and ``plugins/decode.h``,
each a ``switch`` on ``Mode``).
"""

from __future__ import annotations

import struct

import torch

from tqexport.kvquant import codecs, float_bytes, packing, turboquant
from tqexport.kvquant.modes import KV_CACHE_DTYPES, KVQuantMode
from tqexport.ops import attributes

#: head sizes the native kernels serve: multiples of 8 up to the largest head size any codec
#: takes (every real model; another size runs the function bodies)
NATIVE_HEAD_SIZES = tuple(range(8, codecs.MAX_HEAD_SIZE + 1, 8))
CODEBOOK_BITS = (2, 3, 4)
#: the fp8 formats by their C++ names
FP8_NAMES = ((float_bytes.E4M3, "kE4M3"), (float_bytes.E5M2, "kE5M2"))


def _f(x: float) -> str:
    """A float32 as an exact C++ literal."""
    v = struct.unpack("<f", struct.pack("<f", float(x)))[0]
    if v != v:
        return "std::numeric_limits<float>::quiet_NaN()"
    if v in (float("inf"), float("-inf")):
        return ("-" if v < 0 else "") + "std::numeric_limits<float>::infinity()"
    return f"{v.hex()}f"


def _floats(values) -> str:
    return "{" + ", ".join(_f(v) for v in values) + "}"


def _layouts() -> tuple[tuple, ...]:
    """(preset, head size, layout) for every pair the preset accepts among the native sizes."""
    out = []
    for name, p in turboquant.PRESETS.items():
        for d in NATIVE_HEAD_SIZES:
            try:
                turboquant.check_head_size(p, d)
            except Exception:  # noqa: BLE001 - a size the preset refuses is simply not listed
                continue
            out.append((name, d, turboquant.SlotLayout(p, d)))
    return tuple(out)


def _codebook_sizes() -> list[int]:
    return [d for d in NATIVE_HEAD_SIZES if d & (d - 1) == 0]


def supported(kv_cache_dtype: str, head_size: int, layouts: tuple | None = None) -> bool:
    """Whether the generated tables (so the native kernels) cover this layer's cache
    (``layouts``: :func:`_layouts`, when the caller already has them)."""
    entry = KV_CACHE_DTYPES.get(kv_cache_dtype)
    if entry is None or head_size not in NATIVE_HEAD_SIZES:
        return False
    if entry.mode is KVQuantMode.TURBOQUANT:
        layouts = _layouts() if layouts is None else layouts
        return any(n == kv_cache_dtype and d == head_size for n, d, _ in layouts)
    try:
        codecs.make_codec(kv_cache_dtype, head_size)
    except Exception:  # noqa: BLE001 - the codec refuses this size
        return False
    return True


def _cache_tensors(name: str, layouts: tuple) -> list[tuple[str, str, bool, list[int]]]:
    """(role, element, whether it is a per-token-head scalar, width per native head size, 0
    where the format has no kernel) of each tensor of a dtype's codec; element "model" where it
    follows the model's dtype."""
    entry = KV_CACHE_DTYPES[name]
    out = None
    for i, d in enumerate(NATIVE_HEAD_SIZES):
        if not supported(name, d, layouts):
            continue
        per_model = [codecs.cache_tensors(name, d, m) for m in codecs.MODEL_DTYPES]
        tensors = per_model[0]
        if out is None:
            out = [(t.role, t.dtype, t.width is None, [0] * len(NATIVE_HEAD_SIZES))
                   for t in tensors]  # fmt: skip
        assert [(r, s) for r, _, s, _ in out] == [(t.role, t.width is None) for t in tensors]
        for j, t in enumerate(tensors):
            follows = len({ts[j].dtype for ts in per_model}) > 1
            assert not follows or entry.element == "model", f"{name}: {t.role}'s element varies"
            out[j] = (t.role, "model" if follows else t.dtype, out[j][2], out[j][3])
            out[j][3][i] = t.width or 1
    return out or []


def _check_packing() -> None:
    """``plugins/formats.cc`` packs every code width as one LSB-first bit stream: refuse to
    generate the header for a packing.py whose layout is another."""
    for b in packing.SUPPORTED_BITS:
        n = 8 * b
        codes = torch.arange(n) % (1 << b)
        stream = sum(int(c) << (b * i) for i, c in enumerate(codes.tolist()))
        got = packing.pack_codes(codes, b).tolist()
        assert got == list(stream.to_bytes(packing.packed_bytes(n, b), "little")), b


def _tensor_lines() -> list[str]:
    """Elements, model dtypes, fp8 formats, and every dtype's cache tensors."""
    elements = list(codecs.TENSOR_DTYPES)
    lines = [
        "enum class Elem : int { " + ", ".join(elements) + " };",
        "inline constexpr int kElemSize[] = {"
        + ", ".join(str(t.itemsize) for t in codecs.TENSOR_DTYPES.values())
        + "};",
        "struct ModelDtype { const char* name; Elem elem; };",
        "inline constexpr ModelDtype kModelDtypes[] = {",
        *(f'    {{"{m}", Elem::{m}}},' for m in codecs.MODEL_DTYPES),
        "};",
        "",
        "struct Fp8 { int bias; int mantissa; float max; const float* table; };",
    ]
    for fmt, cname in FP8_NAMES:
        lines.append(
            f"inline constexpr Fp8 {cname}Format = {{{fmt.bias}, {fmt.mantissa_bits}, "
            f"{_f(fmt.max_value)}, {cname}}};"
        )
    fp8 = {fmt.name: f"&{cname}Format" for fmt, cname in FP8_NAMES}
    lines += [
        "",
        f"inline constexpr int kNativeHeadSizes = {len(NATIVE_HEAD_SIZES)};  // 8, 16, ...",
        "// one cache tensor of a dtype: width[head_size / 8 - 1] values per (token, head), 0",
        "// where the dtype has no kernel; a scalar is one value, shape [blocks, size, heads]",
        "struct TensorEntry { const char* role; Elem elem; bool model_elem; bool scalar;"
        " const int* width; };",
    ]
    widths: dict[tuple, str] = {}
    tensors, spans, layouts = [], [], _layouts()
    for name in KV_CACHE_DTYPES:
        entries = _cache_tensors(name, layouts)
        spans.append((len(tensors), len(entries)))
        for role, elem, scalar, w in entries:
            wname = widths.setdefault(tuple(w), f"kWidths{len(widths)}")
            model = elem == "model"
            e = elements[0] if model else elem
            flags = f"{str(model).lower()}, {str(scalar).lower()}"
            tensors.append(f'    {{"{role}", Elem::{e}, {flags}, {wname}}},')
    for w, wname in widths.items():
        lines.append(f"inline constexpr int {wname}[] = {{{', '.join(map(str, w))}}};")
    lines += ["inline constexpr TensorEntry kTensors[] = {", *tensors, "};"]
    most = max(count for _, count in spans)
    lines += [f"inline constexpr int kMaxCacheTensors = {most};  // of any dtype", ""]
    lines += [
        "// a dtype: its mode, fp8 format (nullptr: none) and tensors kTensors[first, +count)",
        "struct DtypeEntry { const char* name; Mode mode; const Fp8* fp8; int first; int count; };",
        "inline constexpr DtypeEntry kDtypes[] = {",
    ]
    for d, (first, count) in zip(KV_CACHE_DTYPES.values(), spans, strict=True):
        ptr = fp8.get(d.element, "nullptr")
        lines.append(f'    {{"{d.name}", Mode::{d.mode.name}, {ptr}, {first}, {count}}},')
    return [*lines, "};", ""]


def _node_lines() -> list[str]:
    """The op domain, op names and node attribute names, each a constant of its own name."""
    names = [*attributes.CACHE_ATTRS, *attributes.ATTENTION_ATTRS, *attributes.SEGMENT_ATTRS,
             *attributes.NORM_ATTRS, *attributes.NODE_ATTRS]  # fmt: skip
    return [
        f'inline constexpr char kDomain[] = "{attributes.DOMAIN}";',
        f'inline constexpr char kCacheWrite[] = "{attributes.CACHE_WRITE}";',
        f'inline constexpr char kPagedAttention[] = "{attributes.PAGED_ATTENTION}";',
        f'inline constexpr char kAddBlockOffsets[] = "{attributes.ADD_BLOCK_OFFSETS}";',
        f'inline constexpr char kRotateHalf[] = "{attributes.ROTATE_HALF}";',
        f'inline constexpr char kFusedAddRMSNorm[] = "{attributes.FUSED_ADD_RMS_NORM}";',
        f'inline constexpr char kSiluAndMul[] = "{attributes.SILU_AND_MUL}";',
        "namespace attr {",
        *(f'inline constexpr char {n}[] = "{n}";' for n in names),
        "}  // namespace attr",
        "",
    ]


def render() -> str:
    """The header's text (deterministic: the library's source hash covers it)."""
    _check_packing()
    lines = [
        "// Generated by tqexport.native.header from tqexport.kvquant: do not edit.",
        "#pragma once",
        "#include <cstdint>",
        "#include <limits>",
        "namespace tqx::gen {",
        "",
        "enum class Mode : int { " + ", ".join(m.name for m in KVQuantMode) + " };",
        "",
        "struct PresetEntry {",
        "  const char* name; int key_bits; int value_bits; bool norm_correction;",
        "  int value_group; bool value_mse;",
        "};",
        "inline constexpr PresetEntry kPresets[] = {",
    ]
    for p in turboquant.PRESETS.values():
        lines.append(
            f'    {{"{p.name}", {p.key_bits}, {p.value_bits}, '
            f"{str(p.norm_correction).lower()}, {p.value_group}, {str(p.value_mse).lower()}}},"
        )
    lines += [
        "};",
        "",
        "// every offset of SlotLayout; -1 where the layout has none",
        "struct LayoutEntry {",
        "  const char* preset; int head_size; int key_code_bytes; int key_norm_offset;",
        "  int value_offset; int value_code_bytes; int value_groups; int value_params_offset;",
        "  int value_norm_offset; int slot_size; int slot_size_aligned;",
        "};",
        "inline constexpr LayoutEntry kLayouts[] = {",
    ]
    for name, d, lay in _layouts():
        norm = -1 if lay.key_norm_offset is None else lay.key_norm_offset
        vnorm = -1 if lay.value_norm_offset is None else lay.value_norm_offset
        lines.append(
            f'    {{"{name}", {d}, {lay.key_code_bytes}, {norm}, {lay.value_offset}, '
            f"{lay.value_code_bytes}, {lay.value_groups}, {lay.value_params_offset}, {vnorm}, "
            f"{lay.slot_size}, {lay.slot_size_aligned}}},"
        )
    lines += [
        "};",
        "",
        "// Lloyd-Max centroids (sorted) and store thresholds of the presets' codebooks",
        "struct Codebook { int head_size; int bits; const float* centroids;"
        " const float* thresholds; };",
    ]
    books = []
    for d in _codebook_sizes():
        for b in CODEBOOK_BITS:
            c = turboquant.centroids(d, b)
            t = turboquant.thresholds(c)
            lines.append(f"inline constexpr float kCentroids_{d}_{b}[] = {_floats(c.tolist())};")
            lines.append(f"inline constexpr float kThresholds_{d}_{b}[] = {_floats(t.tolist())};")
            books.append(f"    {{{d}, {b}, kCentroids_{d}_{b}, kThresholds_{d}_{b}}},")
    lines += ["inline constexpr Codebook kCodebooks[] = {", *books, "};", ""]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for fmt, cname in FP8_NAMES:
        lines.append(
            f"inline constexpr float {cname}[256] = "
            f"{_floats(float_bytes.fp8_decode(every, fmt).tolist())};"
        )
    lines += [
        f"inline constexpr float kE4M3Max = {_f(float_bytes.E4M3.max_value)};",
        f"inline constexpr float kE5M2Max = {_f(float_bytes.E5M2.max_value)};",
        f"inline constexpr int kE4M3Bias = {float_bytes.E4M3.bias}, kE4M3Mantissa = "
        f"{float_bytes.E4M3.mantissa_bits};",
        f"inline constexpr int kE5M2Bias = {float_bytes.E5M2.bias}, kE5M2Mantissa = "
        f"{float_bytes.E5M2.mantissa_bits};",
        f"inline constexpr float kE2M1[8] = {_floats(codecs.E2M1_VALUES.tolist())};",
        f"inline constexpr int kNvfp4Block = {codecs.NVFP4_BLOCK};",
        f"inline constexpr float kInt8Qmax = {_f(codecs.INT8_QMAX)};",
        f"inline constexpr int kInt4Levels = {codecs.INT4_LEVELS};",
        f"inline constexpr float kPerTokenHeadMinScale = {_f(codecs.PER_TOKEN_HEAD_MIN_SCALE)};",
        f"inline constexpr float kNormEps = {_f(codecs.NORM_EPS)};",
        f"inline constexpr float kNcEps = {_f(codecs.NC_EPS)};",
        f"inline constexpr float kValueMinScale = {_f(turboquant.VALUE_MIN_SCALE)};",
        f"inline constexpr uint16_t kFp16Nan = {turboquant.FP16_NAN:#x};",
        f"inline constexpr uint8_t kE4M3Nan = {turboquant.E4M3_NAN:#x};",
        f"inline constexpr int kMaxHeadSize = {codecs.MAX_HEAD_SIZE};",
        "",
        *_tensor_lines(),
        *_node_lines(),
        "}  // namespace tqx::gen",
        "",
    ]
    return "\n".join(lines)
