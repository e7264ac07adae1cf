"""``--kv-bits B``: each layer's cache chosen from a calibration table under a bits budget.

A knapsack solved exactly: dynamic programming over the layers, each state a (bits, predicted
cost) pair of a partial plan, keeping only the Pareto front (fewer bits or less cost). Bits are
exact (:class:`fractions.Fraction`): every candidate's all-in bits per token of each layer, as
``bench quality`` counts them (unquantized storage at 16 bits; recent windows and sliding
layers, which hold a window of each sequence, amortized over 4096 tokens); the predicted cost
of a plan is the sum of its layers' measured costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from tqexport.errors import TQExportError

UNQUANTIZED = "auto"


@dataclass(frozen=True)
class Choice:
    """The chosen plan: each layer's candidate, as ``--kv-layers``, and what it predicts."""

    candidates: tuple[str, ...]  # per layer position
    kv_layers: str
    predicted_cost: float
    bits_per_element: Fraction


def candidate_bits(desc, candidates) -> list[list[Fraction]]:
    """[layer][candidate] bits per token, exact; candidate 0 is ``auto``."""
    from tqexport.resolve import resolve
    from tqexport.spec import BuildRequest
    from tqexport.storage_bits import layer_bits

    last = len(desc.layers) - 1
    out = [[] for _ in desc.layers]
    for c in (UNQUANTIZED, *candidates):
        spec = resolve(desc, BuildRequest(kv_layers=f"0-{last}:{c}")).spec
        for pos, la in enumerate(spec.layers):
            out[pos].append(layer_bits(spec, la, 16))
    return out


def layer_elements(desc) -> list[int]:
    return [2 * la.num_kv_heads * la.head_size for la in desc.layers]


def least_cost(
    bits: list[list[Fraction]], cost: list[list[float]], limit: Fraction
) -> tuple[Fraction, float, tuple[int, ...]] | None:
    """One option per unit (``bits[u][j]``, ``cost[u][j]``) with the least summed cost whose
    summed bits are at most ``limit``: (bits, cost, the options picked), or None where even the
    fewest bits exceed it. Exact: Pareto fronts of partial plans, unit by unit."""
    front: list[tuple[Fraction, float, tuple[int, ...]]] = [(Fraction(0), 0.0, ())]
    for u in range(len(bits)):
        grown = sorted(
            (b + bits[u][j], c + cost[u][j], picks + (j,))
            for b, c, picks in front
            for j in range(len(bits[u]))
        )
        front = []
        for state in grown:  # ascending bits: keep a state only if it costs less than all before
            if not front or state[1] < front[-1][1]:
                front.append(state)
        rest = sum(min(row) for row in bits[u + 1 :])
        front = [s for s in front if s[0] + rest <= limit]
        if not front:
            return None
    return front[-1]


def choose(desc, table, budget: float) -> Choice:
    """The plan of least predicted cost whose bits per element, all in, are at most ``budget``."""
    names = (UNQUANTIZED, *table.candidates)
    bits = candidate_bits(desc, table.candidates)
    cost = [[0.0, *row] for row in table.cost]
    elements = sum(layer_elements(desc))
    best = least_cost(bits, cost, Fraction(budget) * elements)
    if best is None:
        least = sum(min(row) for row in bits) / elements
        raise TQExportError(
            f"--kv-bits {budget:g} is below the fewest bits the table's candidates reach "
            f"({float(least):.4f} per element); give at least that, or calibrate cheaper "
            "candidates"
        )
    total, predicted, picks = best
    chosen = tuple(names[j] for j in picks)
    return Choice(chosen, as_kv_layers(chosen), predicted, total / elements)


def as_kv_layers(chosen: tuple[str, ...]) -> str:
    """Per-layer candidates -> the shortest ``--kv-layers`` text (runs of one candidate)."""
    runs: list[tuple[int, int, str]] = []
    for pos, c in enumerate(chosen):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], pos, c)
        else:
            runs.append((pos, pos, c))
    return ",".join(f"{a}-{b}:{c}" if a != b else f"{a}:{c}" for a, b, c in runs)


def check_budget(kv_bits: float) -> float:
    from tqexport import validate

    return validate.number(kv_bits, "--kv-bits", above=0.0, maximum=16.0)


def conflicts(kv_bits, given: dict[str, bool]) -> None:
    """``--kv-bits`` chooses every layer's cache: an option that would too is refused
    (``given`` maps flag -> whether it was given)."""
    for flag, was in given.items():
        if was:
            raise TQExportError(
                f"--kv-bits {kv_bits} chooses every layer's dtype, window and sinks, so "
                f"{flag} has no effect; drop one of them"
            )


def budget_plan(
    model: str, desc, kv_bits: float, calibration, say, key_transform: tuple[str, ...] = ()
) -> tuple[Choice, object]:
    """The chosen plan and its table: read from ``calibration`` (measured under the build's
    ``key_transform``), or measured now under it (said)."""
    from tqexport import calibration as cal

    if calibration is not None:
        table = cal.read_table(calibration)
        cal.check_fits(table, desc, calibration)
        cal.check_same_transform(table, key_transform, calibration)
        where = f"{calibration} (measured in {table.elapsed_seconds:.0f} s)"
    else:
        say(f"--kv-bits {kv_bits:g}: no --calibration, measuring the costs now (`tqexport "
            "calibrate MODEL -o FILE` keeps them for the next run)")  # fmt: skip
        table = cal.measure(model, cal.DEFAULT_CANDIDATES, key_transform=key_transform)
        where = f"measured now in {table.elapsed_seconds:.0f} s"
    choice = choose(desc, table, kv_bits)
    say(f"--kv-bits {kv_bits:g}: {len(table.candidates)} candidates' costs from {where}")
    return choice, table
