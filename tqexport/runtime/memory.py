"""The memory plan of an artifact's caches: how many blocks each cache group gets from a block
count or a byte budget, and what every layer's caches then take (``inspect`` prints it)."""

from __future__ import annotations

from pathlib import Path

from tqexport import validate
from tqexport.contract.artifact import Artifact
from tqexport.errors import TQExportError
from tqexport.kvquant.transforms import key_transform_label
from tqexport.spec import ModelSpec


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
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
    memory_limit: int | None = None,
    context: int | None = None,
) -> list[int]:
    """Blocks per cache group, each sized by what it can use (vLLM's hybrid allocator, with a
    fixed split: every layer's cache is a tensor of its own).

    A sequence holds at most ``window_blocks`` blocks of a windowed group, so a windowed group
    never gets more than ``max_num_seqs`` sequences' worth plus one step's tokens
    (``CacheGroup.max_blocks``), nor more than the full-attention groups. A recent-window group
    gets exactly that, paid first. With a memory budget the rest is split for sequences of
    ``context`` tokens (the longest served, ``engine.context_limit``): the full-attention groups
    get the blocks of the k such sequences the budget holds (k <= ``max_num_seqs``), the
    windowed groups what is left up to what they can use, so at ``context`` tokens the
    full-attention groups bound the batch; what the windowed groups cannot use goes to the
    full-attention groups. Where that gives the full-attention groups fewer blocks than an equal
    split (a ``context`` within the window), or without a ``context``, every group gets the
    equal split. ``--num-blocks`` gives the full-attention groups that count. ``memory_limit``:
    bytes the caches may take at most (the executor passes this machine's RAM, its caches live
    in host memory); ``None`` only bounds the block count."""
    spec = artifact.spec
    if num_blocks is not None and memory is not None:
        raise TQExportError("give --num-blocks or --kv-cache-memory, not both")
    validate.serving(num_blocks, max_num_seqs, max_num_batched_tokens)
    budget = validate.parse_memory(memory) if memory is not None else None
    step = max_num_batched_tokens
    cap = {g.id: g.max_blocks(max_num_seqs, step) for g in spec.groups if g.window is not None}
    recent = {g.id: cap[g.id] for g in spec.groups if g.bounded}
    recent_bytes = sum(n * spec.group_block_bytes(spec.groups[g]) for g, n in recent.items())
    if num_blocks is None:
        budget = budget or validate.parse_memory(validate.DEFAULT_KV_CACHE_MEMORY)
        num_blocks, windowed = _split(spec, max(0, budget - recent_bytes), cap, context,
                                      max_num_seqs, step)  # fmt: skip
        num_blocks = min(num_blocks, validate.MAX_NUM_BLOCKS)
    else:
        windowed = {}
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
    # a sequence never holds more blocks of a windowed group than blocks of its own cache
    groups = [
        num_blocks if g.window is None else min(windowed.get(g.id, cap[g.id]), num_blocks)
        for g in spec.groups
    ]
    need = sum(n * spec.group_block_bytes(g) for g, n in zip(spec.groups, groups, strict=True))
    if memory_limit is not None and need > memory_limit:
        what = f"--kv-cache-memory {memory}" if memory is not None else f"--num-blocks {num_blocks}"
        raise TQExportError(
            f"{what} needs {_fmt_size(need)} of KV cache, more than this machine's "
            f"{_fmt_size(memory_limit)} of memory; lower it"
        )
    return groups


def _split(
    spec: ModelSpec, budget: int, cap: dict, context: int | None, max_num_seqs: int, step: int
) -> tuple[int, dict[int, int]]:
    """(full-attention blocks, {windowed group: blocks}) of ``budget`` bytes, as
    :func:`resolve_num_blocks` says: the full-attention groups get the blocks of the k
    sequences of ``context`` tokens the budget holds (or of ``max_num_seqs``), the windowed
    groups the rest up to what they can use, in proportion to one sequence's live blocks."""
    own = [g for g in spec.groups if not g.bounded]
    full = sum(spec.group_block_bytes(g) for g in own if g.window is None)
    windowed = [g for g in own if g.window is not None]
    equal = budget // sum(spec.group_block_bytes(g) for g in own)
    if not full or not windowed or context is None:
        return equal, {}
    live = sum(g.live_blocks(context) * spec.group_block_bytes(g) for g in windowed)
    fixed = sum(g.max_blocks(0, step) * spec.group_block_bytes(g) for g in windowed)
    full_per_seq = -(-context // spec.block_size)
    seqs = min((budget - fixed - full) // (full_per_seq * full + live), max_num_seqs)
    spare = budget - fixed - (1 + seqs * full_per_seq) * full  # for the windowed groups' blocks
    if seqs < 1:
        return equal, {}
    counts = {
        g.id: min(g.max_blocks(0, step) + spare * g.live_blocks(context) // live, cap[g.id])
        for g in windowed
    }
    rest = budget - sum(n * spec.group_block_bytes(spec.groups[g]) for g, n in counts.items())
    if rest // full <= equal:
        return equal, {}
    return rest // full, counts


def max_sequences(
    spec: ModelSpec,
    per_group: list[int],
    tokens: int,
    max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> tuple[int, int | None]:
    """(sequences of ``tokens`` tokens that ``per_group`` blocks hold at once, the group that
    bounds them): full-attention groups need every block, windowed ones their live blocks and
    one step's new tokens (the inverse of ``CacheGroup.max_blocks``)."""
    full = [n for g, n in zip(spec.groups, per_group, strict=True) if g.window is None]
    best = None
    for g, n in zip(spec.groups, per_group, strict=True):
        if g.window is None:
            seqs = (n - 1) // g.live_blocks(tokens)
        elif full and n >= max(full):
            continue  # it holds no more of a sequence than the full-attention groups do
        else:
            spare = n - g.max_blocks(0, max_num_batched_tokens)
            seqs = max(0, spare) // g.live_blocks(tokens)
        if best is None or seqs < best[0]:
            best = (seqs, g.id)
    return best


def check_batched_tokens(spec: ModelSpec, artifact_dir: Path, given: bool) -> None:
    """``--max-num-batched-tokens`` sizes only windowed caches: given without any, refused."""
    if not any(g.window for g in spec.groups) and given:
        raise TQExportError(
            f"--max-num-batched-tokens has no effect: {artifact_dir} has no windowed caches for it "
            "to size; drop it"
        )


def allocation(
    spec: ModelSpec,
    per_group: list[int],
    context: int | None = None,
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> dict:
    """Per layer, per group and in total: the blocks and bytes ``per_group`` gives each cache,
    and with ``context`` how many sequences of that many tokens it holds at once and which
    group or ``max_num_seqs`` bounds them (``inspect --json``'s document)."""
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
         "layers": list(g.layers), "blocks": per_group[g.id] - 1,
         "bytes": per_group[g.id] * spec.group_block_bytes(g),
         "max_blocks_per_seq": g.window_blocks}
        for g in spec.groups
    ]  # fmt: skip
    full = [n for g, n in zip(spec.groups, per_group, strict=True) if g.window is None]
    summary = {
        "num_blocks": blocks,
        "block_size": spec.block_size,
        "full_attention_tokens": (max(full) - 1) * spec.block_size if full else None,
        "total_bytes": sum(r["bytes"] for r in layers),
        "bf16_total_bytes": sum(
            per_group[la.group] * spec.block_size * 4 * la.cache.head_size * la.cache.num_kv_heads
            for la in spec.layers
        ),
        "bytes_per_token": spec.bytes_per_token,
        "bf16_bytes_per_token": spec.bf16_bytes_per_token,
        "context": context,
    }
    if context is not None:
        seqs, group = max_sequences(spec, per_group, context, max_num_batched_tokens)
        summary["max_seqs_at_context"] = min(seqs, max_num_seqs)
        summary["bound_by"] = "max_num_seqs" if max_num_seqs < seqs else f"group {group}"
    return {"layers": layers, "groups": groups, "summary": summary}
