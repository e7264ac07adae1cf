"""Build the step tensors (the graph inputs other than caches; names, dtypes and shapes in
``ModelSpec.graph_io``) from per-sequence token chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tqexport.spec import ModelSpec, block_tables_name, slot_mapping_name


@dataclass
class SeqChunk:
    """One sequence's part of a step: new tokens starting at absolute position ``start``,
    and per cache group the sequence's block table (block ids, 0 = null)."""

    tokens: list[int]
    start: int
    block_tables: list[list[int]]
    want_logits: str = "last"  # "last" | "all" | "none"


def build_step(
    spec: ModelSpec, chunks: list[SeqChunk], pad_tokens: int = 0, pad_seqs: int = 0
) -> dict[str, torch.Tensor]:
    """Flattened step inputs keyed by graph input name (caches not included).

    ``pad_tokens`` adds padding tokens (slot -1) at the end; ``pad_seqs`` adds rows with
    q_len 0 whose block tables are all null: both are legal padding.
    """
    bs = spec.block_size
    ids, pos, qsl, seq_lens, logits_idx = [], [], [0], [], []
    slots = [[] for _ in spec.groups]
    for c in chunks:
        n = len(c.tokens)
        p = list(range(c.start, c.start + n))
        base = len(ids)
        ids += c.tokens
        pos += p
        qsl.append(qsl[-1] + n)
        seq_lens.append(c.start + n)
        if c.want_logits == "all":
            logits_idx += list(range(base, base + n))
        elif c.want_logits == "last" and n:
            logits_idx.append(base + n - 1)
        positions = torch.arange(c.start, c.start + n)
        for g in spec.groups:
            table = torch.tensor(c.block_tables[g.id] or [0], dtype=torch.int64)
            slots[g.id].append(table[positions // bs] * bs + positions % bs)
    ids += [0] * pad_tokens
    pos += [0] * pad_tokens
    for s in slots:
        s.append(torch.full((pad_tokens,), -1, dtype=torch.int64))
    qsl += [qsl[-1]] * pad_seqs  # padding tokens belong to no sequence
    seq_lens += [0] * pad_seqs
    out = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.tensor(pos, dtype=torch.int64),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "logits_indices": torch.tensor(logits_idx, dtype=torch.int64),
    }
    for g in spec.groups:
        width = max([len(c.block_tables[g.id]) for c in chunks] + [1])
        rows = [c.block_tables[g.id] + [0] * (width - len(c.block_tables[g.id])) for c in chunks]
        rows += [[0] * width] * pad_seqs
        out[slot_mapping_name(g.id)] = torch.cat(slots[g.id])
        out[block_tables_name(g.id)] = torch.tensor(rows, dtype=torch.int32)
    return out


def ordered_inputs(spec: ModelSpec, step: dict, caches: dict) -> list[torch.Tensor]:
    """Step + cache tensors in the graph's input order."""
    merged = {**step, **caches}
    return [merged[n] for n in spec.input_names]
