"""Token sampling per request: greedy, temperature, top-k, top-p, with the request's own RNG."""

from __future__ import annotations

import torch

from tqexport.runtime.sequence import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator) -> int:
    """One token from a ``[vocab]`` row of logits. The most likely token always stays a
    candidate (it is scaled to 0 before the temperature, and top-k and top-p keep it), so any
    params draw from a valid distribution; only non-finite logits can make this raise."""
    if params.temperature == 0:
        return int(logits.argmax())
    x = logits.float()
    x = (x - x.max()) / params.temperature
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.numel())).values[-1]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    if params.top_p < 1.0:
        order = torch.argsort(x, descending=True)
        probs = torch.softmax(x[order], dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop = order[1:][before[1:] >= params.top_p]
        x[drop] = float("-inf")
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=rng))
