"""A request's state while it is served."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tqexport.validate import integer, sampling


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 = off. Out-of-range values (nan, a negative
    temperature, top_p outside (0, 1], a seed torch cannot take) raise TQExportError."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False

    def __post_init__(self):
        # TQExportError is a ValueError: one line naming the field, the rule and the value
        sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed)
        for t in self.stop_token_ids:
            integer(t, "stop_token_ids", 0)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Prompt + generated tokens; ``num_cached`` of them are in the cache."""

    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # per cache group
    finish_reason: str | None = None
    #: why it ended with finish_reason "error" (it alone failed while being stepped or sampled)
    error: BaseException | None = None
    preemptions: int = 0
    rng: torch.Generator = field(init=False)

    def __post_init__(self):
        # Each request owns its RNG: sampling never depends on what else is in the batch.
        self.rng = torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens known but not yet in the cache (the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_cached

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
