"""Triton CacheWrite kernels against the reference (TRITON_INTERPRET=1 on CPU) and sm_90 PTX."""

import os
import subprocess
import sys

import pytest
import torch

from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.kvquant.packing import unpack_codes

NAMES = ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4",
         "fp8", "fp8_e5m2", "auto", "tqx_k4v4_g32", "tqx_k4v3_g32",
         "tqx_k4v3_mse", "tqx_k4v2_mse", "tqx_k3v2_mse"]  # fmt: skip
#: every format at head sizes 64 and 128; at Gemma 3's 256 one TurboQuant format per codec path
#: (fp8 keys, uniform values, grouped values, MSE values)
CASES = [(n, d) for n in NAMES for d in (64, 128)] + [
    (n, 256) for n in ("turboquant_k8v4", "turboquant_4bit_nc", "tqx_k4v3_g32", "tqx_k4v3_mse")
]

# The interpreter must be chosen before triton is imported, so the comparison runs in a child.
CHILD = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.ops import reference
from tqexport.ops.triton.cache_write import write_cache_
name, d = sys.argv[1], int(sys.argv[2])
codec = make_codec(name, d, model_dtype="float32", k_scale=0.37 if name.startswith("fp8") else 1.0,
                   v_scale=2.5 if name.startswith("fp8") else 1.0)
g = torch.Generator().manual_seed(d)
shapes = [(5, 4, 2) + ((t.width,) if t.width else ()) for t in codec.tensors]
cache = [torch.randint(0, 255, s, generator=g).to(torch_dtype(t.dtype))
         for s, t in zip(shapes, codec.tensors)]
k = torch.randn(9, 2, d, generator=g) * 3
v = torch.randn(9, 2, d, generator=g)
if getattr(codec, "preset", None) is not None:  # NaN/inf rule of the TurboQuant store (vLLM's)
    nan, inf = float("nan"), float("inf")
    k[1, 0, 3], k[4, 0, 5], k[5, 1, 0], k[8, 0] = nan, inf, -inf, 0.0
    k[2, 1], v[2, 0] = nan, nan  # all-NaN key and value heads
    v[1, 1, 2], v[6, 0, 7], v[8, 1] = nan, inf, inf
    v[7, 1, :2] = torch.tensor([inf, -inf])
slots = torch.tensor([4, 5, 6, -1, 9, 17, 18, 19, 7])
ref = reference.write_cache(codec, cache, k, v, slots)
mine = [t.clone() for t in cache]
write_cache_(codec, mine, k, v, slots)
torch.save({"ref": ref, "mine": mine, "k": k, "v": v}, sys.argv[3])
"""


@pytest.mark.parametrize("name,d", CASES)
def test_interpreted_kernel_writes_reference_bytes(tmp_path, name, d):
    out = tmp_path / "r.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, name, str(d), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = torch.load(out)
    codec = make_codec(name, d, model_dtype="float32")
    for ref, mine in zip(res["ref"], res["mine"]):
        if getattr(codec, "preset", None) is None or codec.preset.key_fp8:
            assert torch.equal(ref, mine)
            continue
        # REFERENCE rule: a key code (and an MSE value code) may differ only where its float64
        # input is within 1e-5 of a threshold (sums in another order); every other byte must
        # be identical.
        lay = codec.layout
        codes = [(0, lay.key_code_bytes, codec.key_book, res["k"])]
        if codec.preset.value_mse:
            codes.append((lay.value_offset, lay.value_params_offset, codec.value_book, res["v"]))
        rest = torch.ones(ref.shape[-1], dtype=torch.bool)
        for lo, hi, book, x in codes:
            rest[lo:hi] = False
            a = unpack_codes(ref[..., lo:hi], book.bits, d)
            b = unpack_codes(mine[..., lo:hi], book.bits, d)
            if not torch.equal(a, b):
                x = x.double()
                y = (x / (x.norm(dim=-1, keepdim=True) + 1e-8)) @ tq.hadamard(d).double()
                near = ((y[..., None] - book.thresholds.double()).abs() < 1e-5).any(-1)
                assert int((a != b).sum()) <= int(near.sum())
        assert torch.equal(ref[..., rest], mine[..., rest])


@pytest.mark.parametrize("name", NAMES)
def test_kernels_compile_to_sm90_ptx(name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tqexport.ops.triton.cache_write import kernel_variants

    for d in (64, 128, 256):
        for fn, sig, consts in kernel_variants(make_codec(name, d, model_dtype="float32"), heads=8):
            compiled = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"enable_fp_fusion": False},
            )
            assert ".target sm_90" in compiled.asm["ptx"]
            assert fn.__name__ in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_kernel_writes_reference_bytes(name):
    from tqexport.ops import reference
    from tqexport.ops.triton.cache_write import write_cache_

    codec = make_codec(name, 128, model_dtype="float32")
    cache = [torch.zeros((8, 16, 4) + ((t.width,) if t.width else ()), dtype=torch_dtype(t.dtype))
             for t in codec.tensors]  # fmt: skip
    k, v = torch.randn(33, 4, 128), torch.randn(33, 4, 128)
    slots = torch.arange(33) + 16
    ref = reference.write_cache(codec, cache, k, v, slots)
    mine = [t.cuda() for t in cache]
    write_cache_(codec, mine, k.cuda(), v.cuda(), slots.cuda())
    for r, m in zip(ref, mine):
        assert (r != m.cpu()).float().mean() < 1e-3
