"""Cache groups: layers whose caches share one block table (one group per window, then one per
recent window and sink count), and how many blocks a windowed group can use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one block table: same window (None = full attention)."""

    id: int
    window: int | None
    block_size: int
    layers: tuple[int, ...]
    #: the group holds these layers' recent-window caches, not their own caches
    recent: bool = False
    #: a recent group also keeps the blocks of every sequence's first ``sink_tokens`` tokens
    sink_tokens: int = 0

    @property
    def sink_blocks(self) -> int:
        """Blocks holding a sequence's sink tokens (never freed while it runs)."""
        return -(-self.sink_tokens // self.block_size)

    @property
    def window_blocks(self) -> int | None:
        """Blocks a sequence holds at most in a windowed group: its window plus a partial block
        at each end (and its sink tokens' blocks); None for full attention (no bound)."""
        if self.window is None:
            return None
        return -(-self.window // self.block_size) + 2 + self.sink_blocks

    def live_blocks(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` holds at once: all of them, or for a windowed group
        at most :attr:`window_blocks`."""
        total = -(-tokens // self.block_size)
        return total if self.window is None else min(total, self.window_blocks)

    @property
    def bounded(self) -> bool:
        """Whether the group's caches are sized by :meth:`max_blocks` alone, before the memory
        budget is split (a recent-window group)."""
        return self.recent

    def max_blocks(
        self, max_num_seqs: int, max_step_tokens: int, tokens: int | None = None
    ) -> int | None:
        """Blocks a windowed group can use at most with ``max_num_seqs`` sequences (of at most
        ``tokens`` tokens) running: each one's live blocks, one step's new tokens and the null
        block (what vLLM's ``SlidingWindowSpec.max_memory_usage_bytes`` bounds per sequence);
        None for full attention, which can use any number."""
        if self.window is None:
            return None
        steps = -(-max_step_tokens // self.block_size)
        per_seq = self.window_blocks if tokens is None else self.live_blocks(tokens)
        return 1 + max_num_seqs * per_seq + steps

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "id": self.id,
                "window": self.window,
                "block_size": self.block_size,
                "layers": list(self.layers),
            }
            | ({"recent": True} if self.recent else {})
            | ({"sink_tokens": self.sink_tokens} if self.sink_tokens else {})
        )


def build_groups(
    windows: dict[int, int | None],
    block_size: int,
    recent: dict[int, int] | None = None,
    sinks: dict[int, int] | None = None,
) -> tuple[CacheGroup, ...]:
    """Group layer indices by window: full attention first, then windows ascending; then one
    group per (recent window, sink tokens), ascending (``recent`` maps layer -> its recent
    window, ``sinks`` layer -> its sink tokens, 0 where absent)."""
    keys = sorted(set(windows.values()), key=lambda w: (w is not None, w or 0))
    groups = [
        CacheGroup(i, w, block_size, tuple(sorted(ix for ix, lw in windows.items() if lw == w)))
        for i, w in enumerate(keys)
    ]
    sinks = sinks or {}
    exact = {ix: (w, sinks.get(ix, 0)) for ix, w in (recent or {}).items()}
    for w, sink in sorted(set(exact.values())):
        layers = tuple(sorted(ix for ix, key in exact.items() if key == (w, sink)))
        groups.append(CacheGroup(len(groups), w, block_size, layers, recent=True,
                                 sink_tokens=sink))  # fmt: skip
    return tuple(groups)
