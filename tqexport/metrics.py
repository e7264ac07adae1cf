"""Perplexity, KL divergence and top-1 agreement of next-token distributions, accumulated.

Within a chunk of n tokens the logits at position i predict token i+1: n-1 predictions per
chunk. Perplexity = exp(mean negative log-likelihood over every prediction of every chunk).
KL(P_base || P) and top-1 agreement compare a run with its own unquantized baseline on the same
predictions; all in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: predictions per block while scoring: float64 log-probabilities of a 262k-token vocabulary
#: take 2 MiB a row, so a 4096-token window is scored a block of rows at a time
ROWS_PER_BLOCK = 256


def _log_probs(logits) -> torch.Tensor:
    return torch.log_softmax(torch.as_tensor(logits).double(), dim=-1)


def log_probs(logits) -> torch.Tensor:
    """Next-token log-probabilities in float64 of a chunk's ``logits [n, vocab]``: [n-1, vocab]."""
    return _log_probs(torch.as_tensor(logits)[:-1])


class Baseline:
    """The baseline's float64 next-token log-probabilities, probabilities and top-1 of some rows,
    computed once for every run compared with them (a quality run compares several configurations
    with one baseline a prefill step at a time; raw baseline logits are converted per run)."""

    def __init__(self, logits, rows: int):
        self.log_probs = _log_probs(torch.as_tensor(logits)[:rows])
        self.probs = self.log_probs.exp()
        self.top1 = self.log_probs.argmax(-1)

    def block(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.log_probs[rows], self.probs[rows], self.top1[rows]


def _baseline_block(base, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(base, Baseline):
        return base.block(rows)
    bp = _log_probs(base[rows])
    return bp, bp.exp(), bp.argmax(-1)


@dataclass
class Totals:
    """Sums over predictions; ``compare`` sums exist only for runs given a baseline."""

    nll: float = 0.0
    count: int = 0
    kl: float = 0.0
    top1: int = 0
    compared: int = 0

    def add(self, logits, tokens: list[int], base_logits=None) -> None:
        """One chunk: ``logits [n, vocab]`` for its ``n`` tokens (and the baseline's)."""
        self.add_rows(logits, tokens[1:], base_logits)

    def add_rows(self, logits, targets: list[int], base_logits=None) -> None:
        """Predictions ``logits[i] -> targets[i]`` (and the baseline's logits, or its
        :class:`Baseline`, for the same rows); rows past ``targets`` predict nothing (a chunk's
        last position). A long window is added one prefill step's rows at a time."""
        targets = torch.as_tensor(targets, dtype=torch.int64)
        for start in range(0, len(targets), ROWS_PER_BLOCK):
            rows = slice(start, min(start + ROWS_PER_BLOCK, len(targets)))
            lp = _log_probs(logits[rows])
            self.nll -= float(lp.gather(1, targets[rows, None]).sum())
            if base_logits is not None:
                bp, p, top1 = _baseline_block(base_logits, rows)
                self.kl += float((p * (bp - lp)).sum())
                self.top1 += int((top1 == lp.argmax(-1)).sum())
        self.count += len(targets)
        if base_logits is not None:
            self.compared += len(targets)

    def summary(self) -> dict:
        out = {"predictions": self.count, "ppl": math.exp(self.nll / self.count)}
        if self.compared:
            out["kl"] = self.kl / self.compared
            out["top1"] = self.top1 / self.compared
        return out
