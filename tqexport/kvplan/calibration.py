"""``tqexport calibrate``: what each cache candidate costs in each layer, measured.

A candidate is a ``--kv-layers`` entry without its range (``DTYPE[:wN][:sN]``). Its cost in a
layer is the mean KL(baseline || run) of the next-token distributions over the calibration
tokens when only that layer takes it (every other layer ``auto``), scored in an unpaged forward
whose chosen layer reads what its paged cache would hold (:mod:`tqexport.kvplan.calibration_sim`).
Default text: the held-out pydoc topics the key transforms fit on
(:func:`~tqexport.kvplan.fitting.held_out_calibration_text`), which the evaluation windows
never see. Under a key transform (``--kv-key-transform``) the chosen layer's keys are
transformed as a build with that transform stores them (fitted on the calibration text), so a
table predicts the builds of its own transform only; candidates that cannot take one (fp8)
are measured with plain keys, as a ``--kv-layers`` build under that transform stores them.

The table file (JSON, ``format`` ``tqexport-kv-calibration``, ``version`` 2; version 1 is
read as ``key_transform`` ``none``)::

    {"format": "tqexport-kv-calibration", "version": 2,
     "model": {...ModelDescription.identity()...},
     "text": {"name": str, "sha256": str, "characters": int, "tokens": int},
     "key_transform": "none" | "center" | ...,         # as --kv-key-transform
     "candidates": ["tqx_k4v2_mse:w24:s8", ...],        # "auto" is implicit: cost 0
     "cost": [[float per candidate] per layer],          # mean KL in nats per prediction
     "baseline_ppl": float, "elapsed_seconds": float}

The bits each candidate takes are not stored: they follow from the model and the candidate
(:func:`tqexport.kvplan.storage_bits.layer_bits`), so a table never disagrees with the codecs.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.kvquant import transforms
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.safe_files import read_regular_file, write_output
from tqexport.spec.kv_layers import parse_kv_layers

FORMAT, VERSION = "tqexport-kv-calibration", 2
#: the versions read (1: written before key transforms, so measured without one)
READS = (1, 2)
#: the candidates measured unless asked otherwise: 2.75 to 8 bits per element all in
DEFAULT_CANDIDATES = (
    "fp8",
    "tqx_k4v4:w24:s8",
    "tqx_k4v3_mse:w24:s8",
    "tqx_k4v2_mse:w24:s8",
    "tqx_k4v2_mse:w56:s8",
    "tqx_k4v2_mse",
    "tqx_k3v3:w24:s8",
    "tqx_k3v2_mse:w24:s8",
    "tqx_k3v2_mse",
)
#: the most candidates a table holds: the measurement and the --kv-bits solver scale with their
#: number (a dtype, 4 sizes of window and a few of sinks: a few dozen at most make sense)
MAX_CANDIDATES = 64
#: the largest table file read (1024 layers of 64 candidates take about 2 MiB)
MAX_TABLE_BYTES = 8 * 2**20
#: the largest cost a table may give (mean KL in nats per prediction: a cache that loses all
#: information costs about ln(vocabulary) < 20; the sum over every layer stays exact in a float)
MAX_COST = 1e6
#: how every message about a damaged table ends
_REMEASURE = "; measure it again with `tqexport calibrate`"
#: calibration tokens scored per candidate and layer (one window from an empty cache)
DEFAULT_TOKENS = 512
#: the most calibration tokens (one window from an empty cache)
MAX_TOKENS = 2**15


def parse_candidates(text: str) -> tuple[str, ...]:
    """'a,b:w8' -> canonical candidates, each checked as a --kv-layers entry (auto refused: it
    is always a candidate, at cost 0); at most :data:`MAX_CANDIDATES`."""
    out = []
    shown = validate.clip(text)
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > MAX_CANDIDATES:
        raise TQExportError(
            f"--candidates has {len(parts)} values, more than {MAX_CANDIDATES}; measure the "
            "ones --kv-bits should choose among"
        )
    for part in parts:
        if not part:
            raise TQExportError(f"--candidates {shown!r} has an empty value; separate by commas")
        r = parse_kv_layers(f"0:{part}")[0]
        if r.dtype == "auto":
            raise TQExportError("--candidates: auto is always a candidate (cost 0); drop it")
        out.append(r.text.split(":", 1)[1])
    if len(set(out)) != len(out):
        raise TQExportError(f"--candidates {shown!r} names a candidate twice; give each once")
    return tuple(out)


def check_options(candidates: str | None, tokens: int, text: Path | None) -> tuple[str, ...]:
    """``calibrate``'s measurement options checked before anything loads: the candidates
    (default :data:`DEFAULT_CANDIDATES`), the tokens scored, the calibration text."""
    cands = parse_candidates(candidates) if candidates is not None else DEFAULT_CANDIDATES
    validate.integer(tokens, "--tokens", 2, MAX_TOKENS)
    if text is not None:
        validate.text_file(text, "--calibration-text")
    return cands


@dataclass(frozen=True)
class Table:
    """A calibration table (see the module docstring for the file format)."""

    model: dict
    text: dict
    candidates: tuple[str, ...]
    cost: tuple[tuple[float, ...], ...]
    baseline_ppl: float
    elapsed_seconds: float
    key_transform: str = transforms.NONE  # the --kv-key-transform it was measured under

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "text": self.text,
            "key_transform": self.key_transform,
            "candidates": list(self.candidates),
            "cost": [list(row) for row in self.cost],
            "baseline_ppl": self.baseline_ppl,
            "elapsed_seconds": self.elapsed_seconds,
        }

    def write(self, path: Path, force: bool = False) -> None:
        """Written under a fresh name beside ``path`` and renamed (see :mod:`tqexport.safe_files`):
        never a half-written table, never through a link; an existing file only with ``force``."""
        write_output(path, json.dumps(self.to_dict(), indent=1) + "\n", force)


def read_table(path: Path, option: str = "--calibration") -> Table:
    """A table file, checked as strictly as a spec (a regular file of at most
    :data:`MAX_TABLE_BYTES`, strict JSON, every field's type and range): one error naming the
    file and what is wrong."""
    from tqexport.spec.reading import strict_json

    bad = f"{option} {path} is not a `tqexport calibrate` table"
    d = strict_json(read_regular_file(path, option, MAX_TABLE_BYTES), f"{option} {path}",
                    _REMEASURE, MAX_TABLE_BYTES, TQExportError)  # fmt: skip
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") not in READS:
        raise TQExportError(f"{bad} (format {FORMAT!r} version {VERSION} expected)")
    try:
        kinds = transforms.parse_key_transform(
            _text(d["key_transform"]) if d["version"] > 1 else transforms.NONE
        )
        names = d["candidates"]
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_CANDIDATES:
            raise ValueError(f"candidates must be a list of 1 to {MAX_CANDIDATES}")
        cands = parse_candidates(",".join(map(_text, names)))
        model, text = d["model"], d["text"]
        if not isinstance(model, dict) or not isinstance(text, dict):
            raise ValueError("model and text must be objects")
        layers = model.get("num_layers")
        if not isinstance(layers, int) or not 1 <= layers <= validate.MAX_LAYERS:
            raise ValueError(f"model.num_layers must be from 1 to {validate.MAX_LAYERS}")
        rows = d["cost"]
        if (
            not isinstance(rows, list)
            or len(rows) != layers
            or not all(isinstance(r, list) and len(r) == len(cands) for r in rows)
        ):
            raise ValueError("cost is not one row per layer, one column per candidate")
        cost = tuple(tuple(_number(x, "a cost", 0.0, MAX_COST) for x in r) for r in rows)
        ppl = _number(d["baseline_ppl"], "baseline_ppl", 1.0, math.inf)
        secs = _number(d["elapsed_seconds"], "elapsed_seconds", 0.0, math.inf)
    except (KeyError, TypeError, ValueError, TQExportError) as e:
        raise TQExportError(f"{bad} ({validate.clip(str(e), 200)}){_REMEASURE}") from None
    return Table(model, text, cands, cost, ppl, secs, transforms.key_transform_label(kinds))


def _text(value) -> str:
    if not isinstance(value, str) or len(value) > 200:
        raise ValueError(f"{validate.clip(repr(value))} is not a short string")
    return value


def _number(value, name: str, low: float, high: float) -> float:
    """A finite JSON number within [low, high] (the parser already refused NaN and huge ones)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    x = float(value)
    if not (math.isfinite(x) and low <= x <= high):
        raise ValueError(f"{name} {x:g} is not from {low:g} to {high:g}")
    return x


def check_fits(table: Table, desc, path) -> None:
    """The table must be of this model (its config digest and layer count)."""
    ours = desc.identity()
    for key in ("config_digest", "num_layers"):
        if table.model.get(key) != ours[key]:
            raise TQExportError(
                f"--calibration {path} was measured on {table.model.get('name')!r}, not on "
                f"{desc.name!r} ({key} differs); run `tqexport calibrate` on this model"
            )


def _native_turboquant(candidate: str) -> bool:
    entry = parse_kv_cache_dtype(candidate.split(":", 1)[0])
    return entry.takes_key_transform


def check_transform(desc, candidates: tuple[str, ...], kinds: tuple[str, ...]) -> None:
    """Every tqx_* candidate must take the key transform in every layer (as a build would
    check); the others keep plain keys."""
    label = transforms.key_transform_label(kinds)
    if kinds and not any(_native_turboquant(c) for c in candidates):
        raise TQExportError(
            f"--kv-key-transform {label} has no effect: no candidate is a tqexport-native "
            "TurboQuant dtype (tqx_*); add one to --candidates or drop the transform"
        )
    for c in candidates:
        if not _native_turboquant(c):
            continue
        for la in desc.layers:
            why = transforms.refusal(kinds, _native_turboquant(c), la.softcap)
            if why:
                raise TQExportError(
                    f"--kv-key-transform {label}: candidate {c} (layer {la.index}): {why}; "
                    "drop it from --candidates"
                )


def check_same_transform(table: Table, kinds: tuple[str, ...], path) -> None:
    """A table predicts only builds of the key transform it was measured under."""
    label = transforms.key_transform_label(kinds)
    if table.key_transform != label:
        raise TQExportError(
            f"--calibration {path} was measured under --kv-key-transform {table.key_transform}, "
            f"not {label}; give --kv-key-transform {table.key_transform}, or run `tqexport "
            f"calibrate` with --kv-key-transform {label}"
        )


def text_identity(name: str, text: str, tokens: int) -> dict:
    return {
        "name": name,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "characters": len(text),
        "tokens": tokens,
    }


class BaselineKL:
    """Mean KL(baseline || run) per prediction, as :class:`~tqexport.metrics.Totals` sums it,
    with the baseline's log-probabilities computed once (not once per run: they were a third
    of a run's time)."""

    def __init__(self, base_logits):
        from tqexport.metrics import log_probs

        self.base = log_probs(base_logits)
        self.p = self.base.exp()

    def __call__(self, logits) -> float:
        from tqexport.metrics import log_probs

        return float((self.p * (self.base - log_probs(logits))).sum()) / self.base.shape[0]


def measure(
    model: str,
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
    text_file: Path | None = None,
    tokens: int = DEFAULT_TOKENS,
    progress: Callable[[int, int], None] = lambda done, total: None,
    key_transform: tuple[str, ...] = (),
) -> Table:
    """Score every (layer, candidate) with only that layer changed against the baseline, the
    layer's keys under ``key_transform`` (fitted on the calibration text, as a build fits it)."""
    from tqexport import validate
    from tqexport.kvplan.calibration_sim import LayerSimulation
    from tqexport.kvplan.fitting import (
        calibrate_key_transforms,
        calibration_tokens,
        held_out_calibration_text,
    )
    from tqexport.kvplan.resolve import resolve
    from tqexport.metrics import Totals
    from tqexport.models.loader import load_model
    from tqexport.spec import BuildRequest

    start = time.monotonic()
    if text_file is not None:
        name, text = str(text_file), validate.text_file(text_file, "--calibration-text")
    else:
        name = "held-out pydoc topics (the default of --kv-key-transform's calibration)"
        text = held_out_calibration_text()
    lm = load_model(model, "float32")
    check_transform(lm.description, candidates, key_transform)
    fitted = calibrate_key_transforms(lm, text, key_transform) if key_transform else {}
    if lm.tokenizer is not None:
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    else:  # a tiny random built-in: its bytes, as the key transforms' calibration reads them
        ids = calibration_tokens(lm, resolve(lm.description, BuildRequest()).spec, text, tokens)
    if len(ids) < 2:
        raise TQExportError(f"the calibration text has {len(ids)} tokens; give a longer one")
    sim = LayerSimulation(lm, ids)
    totals = Totals()
    totals.add(sim.baseline, ids)
    kl = BaselineKL(sim.baseline)
    entries = [parse_kv_layers(f"0:{c}")[0] for c in candidates]
    keyed = [_native_turboquant(c) for c in candidates]  # fp8 and the like keep plain keys
    n = len(lm.description.layers)
    cost = []
    for pos in range(n):
        row = []
        for j, e in enumerate(entries):
            index = lm.description.layers[pos].index
            window, sinks = e.recent_window or 0, e.sink_tokens or 0
            transform = fitted.get(index) if keyed[j] else None
            logits = sim.logits(pos, e.dtype, window, sinks, transform)
            row.append(max(kl(logits), 0.0))
            progress(pos * len(entries) + j + 1, n * len(entries))
        cost.append(tuple(row))
    return Table(
        lm.description.identity(),
        text_identity(name, text, len(ids)),
        tuple(candidates),
        tuple(cost),
        totals.summary()["ppl"],
        round(time.monotonic() - start, 1),
        transforms.key_transform_label(key_transform),
    )
