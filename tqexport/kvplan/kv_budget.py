"""``--kv-bits B``: each layer's cache chosen from a calibration table under a bits budget.

A knapsack: dynamic programming over the layers, each state a (bits, predicted cost) pair of a
partial plan, keeping only the Pareto front (fewer bits or less cost). Exact while a front holds
at most :data:`MAX_FRONT` plans (the default candidates on every model measured); a larger front
is thinned to the cheapest plan of each of MAX_FRONT equal spans of bits, so time and memory
stay O(layers x MAX_FRONT x options) whatever the table (options: at most
:data:`tqexport.kvplan.calibration.MAX_CANDIDATES` + 1). Bits are
exact (:class:`fractions.Fraction`): every candidate's all-in bits per token of each layer, as
``bench quality`` counts them (unquantized storage at 16 bits; recent windows and sliding
layers, which hold a window of each sequence, amortized over 4096 tokens); the predicted cost
of a plan is the sum of its layers' measured costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from tqexport.errors import TQExportError

UNQUANTIZED = "auto"
#: partial plans kept per layer (see the module docstring)
MAX_FRONT = 2048


@dataclass(frozen=True)
class Choice:
    """The chosen plan: each layer's candidate, as ``--kv-layers``, and what it predicts."""

    candidates: tuple[str, ...]  # per layer position
    kv_layers: str
    predicted_cost: float
    bits_per_element: Fraction


def candidate_bits(desc, candidates) -> list[list[Fraction]]:
    """[layer][candidate] bits per token, exact; candidate 0 is ``auto``."""
    from tqexport.kvplan.resolve import resolve
    from tqexport.kvplan.storage_bits import layer_bits
    from tqexport.spec import BuildRequest

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
    fewest bits exceed it. Pareto fronts of partial plans, unit by unit, on exact integer bits
    (scaled by the denominators' least common multiple); exact while a front holds at most
    :data:`MAX_FRONT` plans, else thinned to that many spread over its bits (see the module)."""
    scale = math.lcm(*(Fraction(b).denominator for row in bits for b in row))
    units = [np.array([int(Fraction(b) * scale) for b in row], np.int64) for row in bits]
    if sum(int(u.max()) for u in units) >= 2**62 // max(len(units), 1):
        raise TQExportError("--kv-bits: the candidates' bits are too fine to add up exactly")
    top = math.floor(Fraction(limit) * scale)
    rest = np.cumsum([0] + [int(u.min()) for u in units[::-1]])[::-1]  # fewest bits from u on
    front_bits, front_cost = np.zeros(1, np.int64), np.zeros(1)
    steps = []  # per unit: each kept plan's (parent plan, option)
    for u, (ub, uc) in enumerate(zip(units, cost, strict=True)):
        k = len(ub)
        b = (front_bits[:, None] + ub[None, :]).ravel()
        c = (front_cost[:, None] + np.asarray(uc, np.float64)[None, :]).ravel()
        ok = np.flatnonzero(b + rest[u + 1] <= top)
        if not len(ok):
            return None
        ok = ok[np.lexsort((c[ok], b[ok]))]  # ascending bits, then cost; ties keep their order
        b, c = b[ok], c[ok]
        # keep a plan only if it costs less than every plan of fewer (or as many) bits
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(c)[:-1]))
        keep = c < best_before
        ok, b, c = ok[keep], b[keep], c[keep]
        if len(b) > MAX_FRONT:  # the cheapest plan of each of MAX_FRONT equal spans of bits
            span = (b - b[0]) * MAX_FRONT // (int(b[-1] - b[0]) + 1)
            last = np.flatnonzero(np.append(span[1:] != span[:-1], True))
            ok, b, c = ok[last], b[last], c[last]
        steps.append((ok // k, ok % k))
        front_bits, front_cost = b, c
    picks, at = [], len(front_bits) - 1
    for parent, option in reversed(steps):
        picks.append(int(option[at]))
        at = int(parent[at])
    return Fraction(int(front_bits[-1]), scale), float(front_cost[-1]), tuple(picks[::-1])


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


def check_calibration(kv_bits: float | None, calibration) -> None:
    """``--calibration`` is the table ``--kv-bits`` reads: without it, it has no effect."""
    if kv_bits is None and calibration is not None:
        raise TQExportError("--calibration is read only by --kv-bits; add --kv-bits or drop it")


def choose_kv_layers(
    model: str, dtype: str | None, kv_bits: float, calibration, key_transform: str,
    given: dict[str, bool], say,
) -> str:  # fmt: skip
    """``--kv-layers`` as ``--kv-bits`` chooses it, the choice and its predicted cost said;
    options it would override (``given`` maps flag -> whether it was given) are refused first."""
    kv_bits = check_budget(kv_bits)
    conflicts(f"{kv_bits:g}", given)
    from tqexport.kvquant.transforms import parse_key_transform
    from tqexport.models.config import describe_model

    desc = describe_model(model, dtype)
    kinds = parse_key_transform(key_transform)
    choice, _ = budget_plan(model, desc, kv_bits, calibration, say, kinds)
    say(
        f"--kv-bits {kv_bits:g} chose --kv-layers {choice.kv_layers}: "
        f"{float(choice.bits_per_element):.4f} bits per element all in, predicted KL "
        f"{choice.predicted_cost:.5f} (the sum of its layers' calibrated costs)"
    )
    return choice.kv_layers


def budget_plan(
    model: str, desc, kv_bits: float, calibration, say, key_transform: tuple[str, ...] = ()
) -> tuple[Choice, object]:
    """The chosen plan and its table: read from ``calibration`` (measured under the build's
    ``key_transform``), or measured now under it (said)."""
    from tqexport.kvplan import calibration as cal

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
