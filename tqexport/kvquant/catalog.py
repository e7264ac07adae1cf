"""The kv-cache dtype table (``tqexport dtypes``): every registry entry's codec at a head size."""

from __future__ import annotations

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import MAX_HEAD_SIZE, compression_vs_bf16, make_codec
from tqexport.kvquant.modes import KV_CACHE_DTYPES


def check_head_size(head_size: int) -> int:
    """``--head-size`` of the table: positive, and no larger than any codec takes."""
    if head_size <= 0:
        raise TQExportError(f"--head-size must be positive, got {head_size}")
    if head_size > MAX_HEAD_SIZE:
        raise TQExportError(f"--head-size must be at most {MAX_HEAD_SIZE}, got {head_size}")
    return head_size


def dtype_rows(head_size: int) -> list[dict]:
    """One row per kv-cache dtype at this head size (auto assumed bf16)."""
    rows = []
    for name, entry in KV_CACHE_DTYPES.items():
        row = {"name": name, "mode": entry.mode.name, "summary": entry.summary, "data_bits": None}
        try:
            codec = make_codec(name, head_size, model_dtype="bfloat16")
        except TQExportError as e:
            row.update(available=False, reason=str(e))
            rows.append(row)
            continue
        b = codec.bytes_per_token_head
        layout = getattr(codec, "layout", None)
        if layout is not None:
            row["data_bits"] = f"k{layout.preset.key_bits}v{layout.preset.value_bits}"
        elif entry.data_bits is not None:
            row["data_bits"] = entry.data_bits
        row.update(
            available=True,
            bytes_per_token_head=b,
            bits_per_element=8 * b / (2 * head_size),
            compression_vs_bf16=compression_vs_bf16(codec),
        )
        rows.append(row)
    return rows
