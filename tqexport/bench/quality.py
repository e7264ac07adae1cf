"""``tqexport bench quality``: perplexity, KL and top-1 agreement per kv-cache configuration.

Every configuration is scored THROUGH an executor's paged caches: each chunk is prefilled with
the graph's ``logits_indices`` asking for every position, and attention reads the cache it has
just written (:func:`tqexport.ops.reference.paged_attention`), so every prediction sees cache
entries stored in its layer's format.
Given a MODEL, each configuration's spec is resolved from it and run on the torch reference ops
(no export needed); given an artifact DIR, its own configuration runs on ONNX Runtime. The
baseline (every layer ``auto``) always runs on the torch reference ops of the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqexport.bench.evaltext import EvalText, chunk_tokens
from tqexport.contract.artifact import Artifact, open_artifact
from tqexport.errors import TQExportError
from tqexport.export.artifact_build import resolve_spec
from tqexport.kvplan.storage_bits import bits_per_element
from tqexport.kvquant.modes import parse_kv_cache_dtype
from tqexport.metrics import Baseline, Totals
from tqexport.runtime.executor import Executor
from tqexport.spec import BuildRequest, ModelSpec
from tqexport.spec.request import DEFAULT_KV_SCALES, DEFAULT_WEIGHTS


@dataclass(frozen=True)
class Config:
    """One kv-cache configuration of the model: the build request giving its spec, and for a
    ``--kv-bits`` plan the budget that chose it and the cost the calibration table predicts."""

    request: BuildRequest
    kv_bits: float | None = None
    predicted_kl: float | None = None

    @property
    def label(self) -> str:
        r = self.request
        keys = [f"keys {r.key_transform_label}"] if r.key_transform else []
        if self.kv_bits is not None:
            return " ".join([f"kv-bits {self.kv_bits:g}", *keys])
        tq = parse_kv_cache_dtype(r.kv_cache_dtype).is_turboquant
        extra = [] if r.boundary or not tq else ["no-boundary"]
        extra += [f"skip {','.join(r.skip_layers)}"] if r.skip_layers else []
        extra += [f"recent {r.recent_window}"] if r.recent_window else []
        extra += [f"sink {r.sink_tokens}"] if r.sink_tokens else []
        extra += [f"scales {r.kv_scales}"] if r.kv_scales != DEFAULT_KV_SCALES else []
        extra += keys
        if r.kv_layers:
            return " ".join([f"layers {r.kv_layers}", *extra] + [f"rest {r.kv_cache_dtype}"]
                            * (r.kv_cache_dtype != "auto"))  # fmt: skip
        return " ".join([r.kv_cache_dtype, *extra])

    @property
    def is_baseline(self) -> bool:
        """Whether this is the unquantized configuration every run is compared with."""
        r = self.request
        return r.kv_cache_dtype == "auto" and not r.skip_layers and not r.kv_layers


@dataclass
class Run:
    """One configuration's executor and its running totals."""

    config: Config | None
    spec: ModelSpec
    executor: Executor
    backend: str
    #: the weights every run of an evaluation computes with (:func:`source_model`)
    weights: str
    totals: Totals = field(default_factory=Totals)

    def result(self) -> dict:
        quantized = sorted({la.kv_cache_dtype for la in self.spec.layers} - {"auto"})
        request = self.spec.request or BuildRequest()
        return {
            "label": self.config.label if self.config else request.kv_cache_dtype,
            "kv_cache_dtype": request.kv_cache_dtype,
            "boundary": request.boundary,
            "skip_layers": list(request.skip_layers),
            "recent_window": self.spec.recent_window,
            "sink_tokens": self.spec.sink_tokens,
            "key_transform": request.key_transform_label,
            "kv_layers": request.kv_layers,
            **(
                {"kv_bits": self.config.kv_bits, "predicted_kl": self.config.predicted_kl}
                if self.config and self.config.kv_bits is not None
                else {}
            ),  # fmt: skip
            "layer_dtypes": [la.kv_cache_dtype for la in self.spec.layers],
            "quantized_dtypes": quantized,
            "bits_per_element": bits_per_element(self.spec, 16),
            "bits_per_element_as_run": bits_per_element(self.spec),
            "kv_bytes_per_token": self.spec.bytes_per_token,
            "backend": self.backend,
            "weights": self.weights,
            **self.totals.summary(),
        }


#: tokens per prefill step while scoring: a long window is prefilled in steps of this many
#: (chunked prefill reads the cache it wrote, so the scores are the same to rounding; one
#: 4096-token step would hold a 4096 x 4096 score matrix per head)
SCORE_STEP_TOKENS = 512


def _executor(spec: ModelSpec, backend: str, chunk: int, artifact_dir=None, lm=None):
    blocks = -(-chunk // spec.block_size) + 1
    art = Artifact(Path(artifact_dir) if artifact_dir else Path("."), spec)
    step = min(chunk, SCORE_STEP_TOKENS)
    return Executor(art, backend, num_blocks=blocks, max_num_batched_tokens=step, source_model=lm)


def source_model(target: str | Artifact, weights: str = DEFAULT_WEIGHTS):
    """(the float model, what its matrices are): an artifact's source holding the artifact's
    own weights, or MODEL holding what ``build --weights weights`` would store, dequantized."""
    from tqexport.export.source import BuildSource
    from tqexport.runtime.backends.torch import load_source_model
    from tqexport.weights.precision import stored_label

    if isinstance(target, Artifact):
        return load_source_model(target), stored_label(target.spec)
    source = BuildSource(target, BuildRequest(weights=weights, dtype="float32"))
    source.check()
    return source.reference_model(), source.weights_label


def _score_chunk(ids: list[int], base: Run, runs: list[Run]) -> None:
    """Add one chunk to every run's totals, one prefill step at a time: a step holds the
    baseline's distributions and one run's logits (a 4096-token window of a 262k vocabulary
    would be 4.3 GB of float32 logits per run)."""
    run_steps = [run.executor.score_steps(ids) for run in runs]
    start = 0
    for logits in base.executor.score_steps(ids):
        targets = ids[start + 1 : start + 1 + len(logits)]
        ref = Baseline(logits, len(targets))
        base.totals.add_rows(logits, targets, ref)
        for run, steps in zip(runs, run_steps, strict=True):
            run.totals.add_rows(next(steps), targets, ref)
        start += len(logits)
    for steps in run_steps:
        if next(steps, None) is not None:  # finishes the run's last step (frees its blocks)
            raise RuntimeError("a run was prefilled in more steps than the baseline")


def evaluate(
    target: str,
    configs: list[Config],
    text: EvalText,
    chunk: int = 1024,
    max_chunks: int = 8,
    progress: Callable[[int, int], None] = lambda done, total: None,
    tokenizer=None,
    weights: str = DEFAULT_WEIGHTS,
) -> tuple[dict, list[list[int]]]:
    """Score MODEL (``configs``) or an artifact DIR (its own config) against the baseline.

    Returns the results and the token chunks scored (for the peer to score the same ids)."""
    is_dir = Path(target).is_dir() and (Path(target) / "tqexport.json").is_file()
    if is_dir:
        art = open_artifact(target)
        lm, stored = source_model(art)
        model_name = art.spec.model["path"]
    else:
        lm, stored = source_model(target, weights)
        model_name = target
    tok = tokenizer or lm.tokenizer
    if tok is None:
        raise TQExportError(
            f"{model_name} has no tokenizer (a tiny random built-in): evaluate a real model"
        )
    tokens = tok(text.text, add_special_tokens=False)["input_ids"]
    chunks = chunk_tokens(tokens, chunk, max_chunks)
    base_spec, _ = resolve_spec(model_name, lm, BuildRequest())
    base_run = _executor(base_spec, "torch", chunk, lm=lm)
    base = Run(Config(BuildRequest()), base_spec, base_run, "torch", stored)
    runs = []
    if is_dir:
        runs.append(Run(None, art.spec, _executor(art.spec, "ort", chunk, art.path), "ort",
                        stored))  # fmt: skip
    for c in configs:
        if c.is_baseline:
            continue
        spec, _ = resolve_spec(model_name, lm, c.request)
        runs.append(Run(c, spec, _executor(spec, "torch", chunk, lm=lm), "torch", stored))
    for i, ids in enumerate(chunks):
        _score_chunk(ids, base, runs)
        progress(i + 1, len(chunks))
    results = {
        "model": model_name,
        "weights": stored,
        "text": text.describe(),
        "chunking": {"chunk_tokens": chunk, "chunks": len(chunks), "text_tokens": len(tokens)},
        "baseline": base.result(),
        "runs": [r.result() for r in runs],
    }
    return results, chunks


def with_deltas(quality: dict | None, peer: dict | None) -> list[dict]:
    """Every quality row with its PPL change vs its own tool's baseline, ours first."""
    rows = []
    if quality:
        base = quality["baseline"]["ppl"]
        for r in [quality["baseline"], *quality["runs"]]:
            rows.append({"tool": "tqexport", **r, "ppl_delta_pct": 100 * (r["ppl"] / base - 1)})
    if peer:
        base = next(r["ppl"] for r in peer["runs"] if r["kv_type"] == "f16")
        for r in peer["runs"]:
            rows.append({"tool": "llama.cpp", **r, "label": r["kv_type"],
                         "ppl_delta_pct": 100 * (r["ppl"] / base - 1)})  # fmt: skip
    return rows
