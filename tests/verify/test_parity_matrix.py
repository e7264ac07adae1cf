"""Parity of built artifacts, ORT vs the torch reference, by the product's own rule: every kv
dtype on a tiny Llama, a subset on other architectures and head sizes."""

import pytest
from helpers import MATRIX_DTYPES, TWO_THREAD_DTYPES

from tqexport.contract.artifact import open_artifact
from tqexport.verify.parity import run_parity

MATRIX = [("tiny-llama", d, []) for d in MATRIX_DTYPES] + [
    ("tiny-gemma2", "turboquant_4bit_nc", ["sw"]),
    ("tiny-gemma3", "fp8", []),
    ("tiny-mistral", "int8_per_token_head", []),
    ("tiny-qwen3", "turboquant_k8v4", []),
    ("tiny-llama-d128", "turboquant_3bit_nc", []),
    ("tiny-llama-d80", "turboquant_k8v4", []),
    ("tiny-llama-d80", "nvfp4", []),
]


#: cases also run at 2 threads (a second summation order): one per codec path
TWO_THREADS = {("tiny-llama", d) for d in TWO_THREAD_DTYPES}
TWO_THREADS.add(("tiny-gemma2", "turboquant_4bit_nc"))
PARITY_CASES = [(*case, 1) for case in MATRIX] + [
    (*case, 2) for case in MATRIX if case[:2] in TWO_THREADS
]


@pytest.mark.parametrize("model,dtype,skip,threads", PARITY_CASES, ids=lambda x: str(x))
def test_parity_ort_vs_reference(artifacts, model, dtype, skip, threads):
    """The product's rule at ORT's 1- and 2-thread summation orders: per layer and step, cache
    bytes (but at rounding thresholds) and attention on ORT's own inputs; end-to-end logits
    judged only without quantized layers (one flipped code legitimately cascades)."""
    art = open_artifact(artifacts(model, dtype, skip))
    quantized = [la for la in art.spec.layers if la.kv_cache_dtype == dtype]
    assert quantized, "some layers must use the requested dtype"
    report = run_parity(art, steps=3, prompt_len=20, batch=3, threads=threads)
    assert report.ok, [c for c in report.layers if not c.ok]
    assert report.logits_judged == (not any(la.mode.is_quantized for la in art.spec.layers))
