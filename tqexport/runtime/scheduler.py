"""Continuous batching: decode and (chunked) prefill in one step, preemption by recompute."""

from __future__ import annotations

from collections import deque

from tqexport.runtime.blocks import BlockManager
from tqexport.runtime.sequence import Sequence, Status


class Scheduler:
    """``long_prefill_token_threshold`` (0: off): while any sequence decodes, a step carries at
    most this many prompt tokens in all, so a long prompt being admitted delays the others'
    next token by a small chunk's time, not a whole ``max_num_batched_tokens`` chunk's; a
    prompt with no sequence decoding beside it still prefills in whole chunks. (vLLM's option
    of that name caps each request's chunk, decoding or not.)"""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill_token_threshold: int = 0,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or long_prefill_token_threshold < 0:
            raise ValueError(
                "max_num_batched_tokens and max_num_seqs must be >= 1, "
                "long_prefill_token_threshold >= 0"
            )
        self.blocks = blocks
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.long_prefill = long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        #: preemptions since the scheduler was made (a metric)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if not self.blocks.fits_ever(len(seq.prompt) + 1):
            bs = self.blocks.groups[0].block_size
            seq.finish(
                f"rejected: a prompt of {len(seq.prompt)} tokens does not fit in the whole cache "
                f"({self.blocks.num_blocks - 1} blocks of {bs} tokens)"
            )
            return
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is recomputed from its tokens later."""
        self.blocks.free(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute this step) pairs, running ones first, in arrival order."""
        budget = self.max_tokens
        prefill = self._prefill_budget()
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.remaining, budget, prefill if seq.remaining > 1 else 1)
            if n == 0:
                continue
            while not self.blocks.can_grow(seq, seq.num_cached + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    seq.finish("length: the cache is full")
                    self.blocks.free(seq)
                    self.running.remove(seq)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_cached + n)
            batch.append((seq, n))
            budget -= n
            prefill -= n if seq.remaining > 1 else 0
        while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.remaining, budget, prefill)
            if not self.blocks.can_grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.blocks.grow(seq, n)
            batch.append((seq, n))
            budget -= n
            prefill -= n
        return batch

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may carry: the threshold while a sequence decodes."""
        decoding = any(s.status is Status.RUNNING and s.remaining == 1 for s in self.running)
        return self.long_prefill if self.long_prefill and decoding else self.max_tokens

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        self.blocks.free(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End a waiting or running request now (finished ones are left alone); its blocks are
        freed at once."""
        if seq.status is Status.RUNNING:
            self.finish(seq, reason)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            if seq.block_tables:
                self.blocks.free(seq)
            seq.finish(reason)
