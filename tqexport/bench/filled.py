"""Block tables of sequences whose caches are already filled, for decode points measured
without a prefill (the cache bytes stay zeros: a decode step's cost does not depend on them).

Each cache group holds what the block manager would hold at that point: every block of a
full-attention group; in a windowed group the blocks still in the window (and a recent group's
sink blocks), the null block where it freed the ones before (``GroupAllocator``'s rule).
"""

from __future__ import annotations

from tqexport.runtime.blocks import NULL_BLOCK
from tqexport.spec import CacheGroup, ModelSpec


def dropped_blocks(group: CacheGroup, query: int) -> range:
    """Indices of the blocks ``group`` has freed once the next query is at position ``query``:
    those whose every position is out of its window, its sink blocks aside."""
    if group.window is None:
        return range(0)
    return range(group.sink_blocks, max(group.sink_blocks, (query - group.window + 1)
                                        // group.block_size))  # fmt: skip


def filled_tables(
    spec: ModelSpec, batch: int, tokens: int, query: int
) -> tuple[list[int], list[list[list[int]]]]:
    """(blocks per group, the null block included; ``tables[seq][group]``) for ``batch``
    sequences with room for ``tokens`` tokens whose next query is at position ``query``: each
    holds its own contiguous run of block ids per group, the null block where it was freed."""
    counts, per_group = [], []
    for g in spec.groups:
        n = -(-tokens // g.block_size)
        gone = dropped_blocks(g, query)
        gone = range(gone.start, min(gone.stop, n))
        live = n - len(gone)
        tables = []
        for i in range(batch):
            ids = list(range(1 + i * live, 1 + (i + 1) * live))
            tables.append(ids[: gone.start] + [NULL_BLOCK] * len(gone) + ids[gone.start :])
        counts.append(1 + batch * live)
        per_group.append(tables)
    return counts, [list(t) for t in zip(*per_group, strict=True)]
