"""Per-cache-group block allocation: block tables, on-demand blocks, sliding-window recycling.

Each cache group (the caches sharing one window, see ``ModelSpec.groups``) has its own block
count, a free list over blocks 1..n-1 (block 0 is the null block, never handed out) and its own
block table per sequence. A sliding-window group replaces blocks that no future query can see
by the null block and frees them (vLLM's scheme); a recent group keeps its sink blocks.
"""

from __future__ import annotations

from collections import deque

from tqexport.runtime.sequence import Sequence
from tqexport.spec import CacheGroup

NULL_BLOCK = 0


class GroupAllocator:
    def __init__(self, group: CacheGroup, num_blocks: int):
        self.group = group
        self.block_size = group.block_size
        self.free = deque(range(1, num_blocks))
        self.capacity = num_blocks - 1

    def blocks_needed(self, table: list[int], upto_tokens: int) -> int:
        return max(0, -(-upto_tokens // self.block_size) - len(table))

    def max_live_blocks(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` holds at once (bounded by the window)."""
        return self.group.live_blocks(tokens)

    def grow(self, table: list[int], upto_tokens: int) -> None:
        for _ in range(self.blocks_needed(table, upto_tokens)):
            table.append(self.free.popleft())

    def _out_of_window(self, table: list[int], next_query_pos: int) -> list[int]:
        """Indices of ``table``'s blocks whose every position is invisible to queries at >=
        next_query_pos (a recent group's sink blocks, the sequence's first, never are)."""
        w = self.group.window
        if w is None:
            return []
        # block i's last position is (i + 1) * block_size - 1 <= next_query_pos - w
        end = min(len(table), (next_query_pos - w + 1) // self.block_size)
        return [i for i in range(self.group.sink_blocks, end) if table[i] != NULL_BLOCK]

    def reclaimable(self, table: list[int], next_query_pos: int) -> int:
        """Blocks :meth:`drop_out_of_window` would free now."""
        return len(self._out_of_window(table, next_query_pos))

    def drop_out_of_window(self, table: list[int], next_query_pos: int) -> None:
        """Free the blocks no query at >= next_query_pos sees; the null block takes their place."""
        for i in self._out_of_window(table, next_query_pos):
            self.free.append(table[i])
            table[i] = NULL_BLOCK

    def release(self, table: list[int]) -> None:
        self.free.extend(b for b in table if b != NULL_BLOCK)
        table.clear()


class BlockManager:
    def __init__(self, groups: tuple[CacheGroup, ...], num_blocks: int | list[int]):
        """``num_blocks``: per group (by id), or one count for every group."""
        counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else num_blocks
        self.groups = [GroupAllocator(g, n) for g, n in zip(groups, counts, strict=True)]
        self.num_blocks = max(counts)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` can fit in an otherwise empty cache."""
        return all(g.max_live_blocks(tokens) <= g.capacity for g in self.groups)

    def can_grow(self, seq: Sequence, upto_tokens: int) -> bool:
        """Whether every group has the blocks ``seq`` needs for positions < upto_tokens,
        counting the ones that leave its window first (:meth:`grow` frees those before it
        takes new ones)."""
        tables = seq.block_tables or [[] for _ in self.groups]
        return all(
            g.blocks_needed(t, upto_tokens) <= len(g.free) + g.reclaimable(t, seq.num_cached)
            for g, t in zip(self.groups, tables, strict=True)
        )

    def grow(self, seq: Sequence, upto_tokens: int) -> None:
        """Give ``seq`` blocks for positions < upto_tokens, after freeing out-of-window ones."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
        for g, table in zip(self.groups, seq.block_tables, strict=True):
            g.drop_out_of_window(table, seq.num_cached)
            g.grow(table, upto_tokens)

    def free(self, seq: Sequence) -> None:
        for g, table in zip(self.groups, seq.block_tables, strict=True):
            g.release(table)
        seq.block_tables = []

    def used_blocks(self) -> list[int]:
        return [g.capacity - len(g.free) for g in self.groups]
