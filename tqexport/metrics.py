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


def log_probs(logits) -> torch.Tensor:
    """Next-token log-probabilities in float64 of a chunk's ``logits [n, vocab]``: [n-1, vocab]."""
    return torch.log_softmax(torch.as_tensor(logits)[:-1].double(), dim=-1)


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
        lp = log_probs(logits)
        targets = torch.as_tensor(tokens[1:], dtype=torch.int64)
        self.nll -= float(lp.gather(1, targets[:, None]).sum())
        self.count += len(targets)
        if base_logits is not None:
            bp = log_probs(base_logits)
            self.kl += float((bp.exp() * (bp - lp)).sum())
            self.top1 += int((bp.argmax(-1) == lp.argmax(-1)).sum())
            self.compared += len(targets)

    def summary(self) -> dict:
        out = {"predictions": self.count, "ppl": math.exp(self.nll / self.count)}
        if self.compared:
            out["kl"] = self.kl / self.compared
            out["top1"] = self.top1 / self.compared
        return out
