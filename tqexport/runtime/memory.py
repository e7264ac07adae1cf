"""The memory plan of an artifact's caches: how many blocks each cache group gets from a block
count or a byte budget, and what every layer's caches then take (``inspect`` prints it)."""

from __future__ import annotations

import re

from tqexport import validate
from tqexport.contract.artifact import Artifact
from tqexport.errors import TQExportError
from tqexport.kvquant.transforms import key_transform_label
from tqexport.runtime.config import DEFAULT_KV_CACHE_MEMORY
from tqexport.spec import ModelSpec

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_memory(text: str, option: str = "--kv-cache-memory") -> int:
    """'512MiB' -> bytes (a positive size); ``option`` names the flag in the error."""
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]i?B|B)?\s*", str(text), re.I)
    if not m:
        raise TQExportError(
            f"{option}: cannot read {str(text)!r}; write e.g. 512MiB or 2GiB (units B, KiB, MiB, "
            "GiB, TiB, KB, MB, GB, TB)"
        )
    n = int(float(m[1]) * _UNITS[(m[2] or "").upper()])
    if n < 1:
        raise TQExportError(f"{option} must be a positive size, got {text!r}")
    return n


def _fmt_size(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def block_bytes(artifact: Artifact) -> int:
    """Bytes one block id costs across the groups the budget sizes (not the bounded ones)."""
    spec = artifact.spec
    return sum(spec.group_block_bytes(g) for g in spec.groups if not g.bounded)


def resolve_num_blocks(
    artifact: Artifact,
    num_blocks: int | None,
    memory: str | None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    memory_limit: int | None = None,
) -> list[int]:
    """Blocks per cache group. The layers' own caches get ``num_blocks`` (or what the memory
    budget leaves after the recent-window caches, which need only their window per sequence).

    ``memory_limit``: bytes the caches may take at most (the executor passes this machine's
    RAM, its caches live in host memory); ``None`` only bounds the block count."""
    spec = artifact.spec
    if num_blocks is not None and memory is not None:
        raise TQExportError("give --num-blocks or --kv-cache-memory, not both")
    validate.serving(num_blocks, max_num_seqs, max_num_batched_tokens)
    budget = parse_memory(memory) if memory is not None else None
    bounds = [g.max_blocks(max_num_seqs, max_num_batched_tokens) for g in spec.groups]
    recent = {g.id: n for g, n in zip(spec.groups, bounds, strict=True) if n is not None}
    recent_bytes = sum(n * spec.group_block_bytes(spec.groups[g]) for g, n in recent.items())
    if num_blocks is None:
        budget = budget or parse_memory(DEFAULT_KV_CACHE_MEMORY)
        num_blocks = max(0, budget - recent_bytes) // block_bytes(artifact)
        num_blocks = min(num_blocks, validate.MAX_NUM_BLOCKS)
    if num_blocks < 2:
        extra = (
            f"; the recent-window caches of {max_num_seqs} sequences take {recent_bytes} bytes "
            "first (lower --max-num-seqs)"
            if recent
            else ""
        )
        raise TQExportError(
            f"the KV budget holds {num_blocks} blocks; at least 2 are needed (block 0 is the null "
            f"block, one block is {block_bytes(artifact)} bytes){extra}"
        )
    # a sequence never holds more recent-window blocks than blocks of its own cache
    groups = [min(recent.get(g.id, num_blocks), num_blocks) for g in spec.groups]
    need = sum(n * spec.group_block_bytes(g) for g, n in zip(spec.groups, groups, strict=True))
    if memory_limit is not None and need > memory_limit:
        what = f"--kv-cache-memory {memory}" if memory is not None else f"--num-blocks {num_blocks}"
        raise TQExportError(
            f"{what} needs {_fmt_size(need)} of KV cache, more than this machine's "
            f"{_fmt_size(memory_limit)} of memory; lower it"
        )
    return groups


def allocation(spec: ModelSpec, per_group: list[int]) -> dict:
    """Per layer, per group and in total: the blocks and bytes ``per_group`` gives each cache
    (``inspect --json``'s document)."""
    blocks = max(per_group)
    layers = [
        {
            "index": la.index,
            "attention_type": la.attention_type.value,
            "window": la.window,
            "kv_cache_dtype": la.kv_cache_dtype,
            "quant_mode": la.mode.name,
            "group": la.group,
            "bytes_per_token": la.cache.bytes_per_token,
            "recent_window": la.recent_window,
            "recent_group": la.recent_group,
            "sink_tokens": la.sink_tokens,
            "key_transform": key_transform_label(la.key_transform.kinds)
            if la.key_transform
            else None,
            "blocks": per_group[la.group],
            "bytes": sum(per_group[b.group] * b.cache.page_size_bytes for b in la.bindings),
        }
        for la in spec.layers
    ]
    groups = [
        {"id": g.id, "window": g.window, "recent": g.recent, "sink_tokens": g.sink_tokens,
         "layers": list(g.layers), "blocks": per_group[g.id] - 1}
        for g in spec.groups
    ]  # fmt: skip
    summary = {
        "num_blocks": blocks,
        "block_size": spec.block_size,
        "usable_tokens_per_group": (blocks - 1) * spec.block_size,
        "total_bytes": sum(r["bytes"] for r in layers),
        "bf16_total_bytes": blocks * spec.block_size * spec.bf16_bytes_per_token,
        "bytes_per_token": spec.bytes_per_token,
        "bf16_bytes_per_token": spec.bf16_bytes_per_token,
    }
    return {"layers": layers, "groups": groups, "summary": summary}
