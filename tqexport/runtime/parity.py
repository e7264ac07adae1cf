"""``tqexport parity``: the artifact on ONNX Runtime against the torch reference, step by step.

Both run one prefill (several sequences of different lengths) and N decode steps, teacher
forced with the reference's greedy tokens. Logits must agree (assert_close, float32, 1e-4);
caches are compared at the end: float tensors within 1e-4, byte tensors byte for byte, with
at most ``max_code_flips`` of the written bytes allowed to differ (ORT's and torch's matmuls
give K/V that differ in the last bits, which moves a handful of values across a rounding
threshold; the function bodies alone are byte-exact on identical inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tqexport.errors import TQExportError
from tqexport.models.loader import load_model
from tqexport.models.paged import PagedCausalLM
from tqexport.runtime.artifact import Artifact
from tqexport.runtime.backends.ort import OrtRunner
from tqexport.runtime.caches import allocate_caches
from tqexport.runtime.steps import SeqChunk, build_step, ordered_inputs

LOGITS_TOL = 1e-4


@dataclass
class StepResult:
    step: int
    tokens: int
    max_abs: float
    max_rel: float
    ok: bool


@dataclass
class CacheResult:
    name: str
    dtype: str
    max_abs: float
    bytes_differing: int
    bytes_written: int
    ok: bool


@dataclass
class ParityReport:
    steps: list[StepResult] = field(default_factory=list)
    caches: list[CacheResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps) and all(c.ok for c in self.caches)


def _compare_logits(i, ref, got) -> StepResult:
    diff = (ref - got).abs()
    rel = diff / ref.abs().clamp_min(1e-6)
    ok = bool(torch.isclose(got, ref, atol=LOGITS_TOL, rtol=LOGITS_TOL).all())
    return StepResult(i, ref.shape[0], float(diff.max()), float(rel.max()), ok)


def _compare_cache(name, ref, got, written_rows, max_code_flips) -> CacheResult:
    if ref.dtype == torch.uint8:
        differ = int((ref != got).sum())
        written = int(written_rows * ref[0, 0].numel())
        ok = differ <= max_code_flips * max(written, 1)
        return CacheResult(
            name, "uint8", float((ref.int() - got.int()).abs().max()), differ, written, ok
        )
    # K/V from different matmuls may round to neighbouring values of a 16-bit cache dtype
    rtol = max(LOGITS_TOL, torch.finfo(ref.dtype).eps)
    ok = bool(torch.isclose(got.float(), ref.float(), atol=LOGITS_TOL, rtol=rtol).all())
    return CacheResult(
        name, str(ref.dtype)[6:], float((ref.float() - got.float()).abs().max()), 0, 0, ok
    )


def run_parity(
    artifact: Artifact,
    steps: int = 4,
    prompt_len: int = 24,
    batch: int = 3,
    seed: int = 0,
    max_code_flips: float = 1e-3,
) -> ParityReport:
    spec = artifact.spec
    if prompt_len < 1 or batch < 1 or steps < 0:
        raise TQExportError("--prompt-len and --batch must be >= 1, --steps >= 0")
    runner = OrtRunner(artifact)
    lm = load_model(spec.model["path"], spec.dtype)
    if lm.description.config_digest != spec.model["config_digest"]:
        raise TQExportError(
            f"the source model at {spec.model['path']} is not the one this artifact was built "
            "from (config digest differs)"
        )
    reference = PagedCausalLM(lm.model, spec, mode="functional")
    g = torch.Generator().manual_seed(seed)
    vocab = int(spec.model["vocab_size"])
    lengths = [max(1, prompt_len - 5 * i) for i in range(batch)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    bs = spec.block_size
    per_seq = [-(-(n + steps) // bs) for n in lengths]
    starts = [1 + sum(per_seq[:i]) for i in range(batch)]
    tables = [
        [list(range(s, s + n)) for _ in spec.groups] for s, n in zip(starts, per_seq, strict=True)
    ]
    ref_caches = allocate_caches(spec, 1 + sum(per_seq))
    ort_caches = {k: v.clone() for k, v in ref_caches.items()}
    report = ParityReport()
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    pos = list(lengths)
    for i in range(steps + 1):
        step = build_step(spec, chunks)
        with torch.no_grad():
            out = reference(*ordered_inputs(spec, step, ref_caches))
        ref_logits = out[0]
        names = [x["name"] for x in spec.graph_io()["inputs"] if x["name"].startswith("cache.")]
        ref_caches = dict(zip(names, out[1:], strict=True))
        got_logits, ort_caches = runner.run(step, ort_caches)
        report.steps.append(_compare_logits(i, ref_logits, got_logits))
        nxt = ref_logits.argmax(-1).tolist()
        chunks = [SeqChunk([t], p, tb) for t, p, tb in zip(nxt, pos, tables, strict=True)]
        pos = [p + 1 for p in pos]
    rows = sum(n + steps for n in lengths)
    for name, ref in ref_caches.items():
        report.caches.append(_compare_cache(name, ref, ort_caches[name], rows, max_code_flips))
    return report
