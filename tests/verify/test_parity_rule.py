"""The parity rule for quantized caches: bytes may differ only at a rounding threshold."""

import torch

from tqexport.kvquant.codecs import make_codec
from tqexport.ops.reference import write_cache
from tqexport.verify.parity import compare_write


def _fp8_write():
    codec = make_codec("fp8", 64, model_dtype="float32")
    k = torch.ones(2, 1, 64)
    k[0, 0, 5] = 1.0625  # halfway between e4m3's 1.0 and 1.125: ties to even give 1.0
    v = torch.full((2, 1, 64), 0.5)
    cache = [torch.zeros(t.shape(3, 4, 1), dtype=getattr(torch, t.dtype)) for t in codec.tensors]
    slots = torch.tensor([4, 5])  # block 1, offsets 0 and 1
    return codec, cache, k, v, slots, write_cache(codec, cache, k, v, slots)


def test_identical_bytes_agree():
    codec, cache, k, v, slots, ref = _fp8_write()
    ok, _, details = compare_write(codec, cache, k, v, slots, ref, 1e-4)
    assert ok and details == ["k: 0 token-heads differ", "v: 0 token-heads differ"]


def test_a_code_flipped_at_a_threshold_is_allowed():
    codec, cache, k, v, slots, ref = _fp8_write()
    got = [t.clone() for t in ref]
    assert got[0][1, 0, 0, 5] == got[0][1, 0, 0, 4]  # 1.0625 was stored as 1.0
    got[0][1, 0, 0, 5] += 1  # the next e4m3 code, 1.125: what a last-bit-larger input gives
    ok, _, details = compare_write(codec, cache, k, v, slots, got, 1e-4)
    assert ok and details[0] == "k: 1 token-heads differ, 1 at a threshold"


def test_a_byte_away_from_any_threshold_is_a_mismatch():
    codec, cache, k, v, slots, ref = _fp8_write()
    got = [t.clone() for t in ref]
    got[0][1, 1, 0, 5] += 1  # token 1 holds exactly 1.0: no perturbation moves its code
    ok, _, details = compare_write(codec, cache, k, v, slots, got, 1e-4)
    assert not ok and details[0] == "k: 1 token-heads differ, 0 at a threshold"
    got = [t.clone() for t in ref]
    got[1][1, 0, 0, 0] += 1  # values (all 0.5) are nowhere near a threshold either
    assert not compare_write(codec, cache, k, v, slots, got, 1e-4)[0]


def _runs(flip_at):
    """Two one-layer fp8 'runs' of the same k/v whose logits differ; run b's cache has one
    byte moved by one code at token-head ``flip_at``."""
    from helpers import Run, dense

    from tqexport.contract.caches import allocate_caches
    from tqexport.kvplan.resolve import resolve
    from tqexport.spec import BuildRequest

    spec = resolve(dense(1, head_size=64, kv_heads=1, dtype="float32"), BuildRequest("fp8")).spec
    codec, _, k, v, _, _ = _fp8_write()
    slots = torch.tensor([16, 17])
    caches = allocate_caches(spec, 3)
    names = [spec.layers[0].onnx_input(t.role) for t in codec.tensors]
    written = write_cache(codec, [caches[n] for n in names], k, v, slots)
    a = dict(zip(names, written))
    b = {n: t.clone() for n, t in a.items()}
    b[names[0]][1, flip_at, 0, 5] += 1
    logits = torch.zeros(2, 8)
    return spec, Run(logits, a, {0: (k, v)}, slots), Run(logits + 1, b, {0: (k, v)}, slots)


def test_runs_that_differ_by_a_code_flipped_at_a_threshold_agree():
    from helpers import assert_same_run, first_cache_difference

    spec, a, b = _runs(flip_at=0)
    assert first_cache_difference(spec, a, b)[:2] == (0, True)
    assert_same_run(spec, a, b)


def test_runs_that_differ_away_from_thresholds_do_not():
    import pytest
    from helpers import assert_same_run

    spec, a, b = _runs(flip_at=1)
    with pytest.raises(AssertionError, match="layer 0 bytes differ away from thresholds"):
        assert_same_run(spec, a, b)
    b.caches = a.caches  # same bytes everywhere, yet different logits: not explained either
    with pytest.raises(AssertionError, match="every cache holds the same bytes"):
        assert_same_run(spec, a, b)
