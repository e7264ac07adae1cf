"""Triton PagedAttention + merge kernels against the reference (interpreter) and sm_90 PTX."""

import os
import subprocess
import sys

import pytest
import torch

from tqexport.kvquant.codecs import make_codec, torch_dtype

NAMES = ["auto", "fp8", "fp8_e5m2", "turboquant_4bit_nc", "turboquant_k3v4_nc",
         "turboquant_3bit_nc", "turboquant_k8v4", "tqx_k4v4_g32", "tqx_k4v3_g32",
         "tqx_k4v3_mse", "tqx_k4v2_mse", "tqx_k3v2_mse"]  # fmt: skip

# TRITON_INTERPRET must be set before triton is imported: the comparison runs in a child.
CHILD = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.ops import reference
from tqexport.ops.triton.paged_attention import paged_attention
name, d, heads, kvh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
window, softcap, splits = int(sys.argv[5]) or None, float(sys.argv[6]) or None, int(sys.argv[7])
fp8 = name.startswith("fp8")
codec = make_codec(name, d, model_dtype="float32", k_scale=0.5 if fp8 else 1.0,
                   v_scale=2.0 if fp8 else 1.0)
g = torch.Generator().manual_seed(d + heads)
shapes = [(8, 4, kvh) + ((t.width,) if t.width else ()) for t in codec.tensors]
cache = [torch.zeros(s, dtype=torch_dtype(t.dtype)) for s, t in zip(shapes, codec.tensors)]
k, v = torch.randn(13, kvh, d, generator=g), torch.randn(13, kvh, d, generator=g)
slots = torch.tensor(list(range(4, 13)) + [20, 21, 22, 23])
cache = reference.write_cache(codec, cache, k, v, slots)
q = torch.randn(6, heads, d, generator=g)
tables = torch.tensor([[1, 2, 3], [5, 0, 0]], dtype=torch.int32)  # null-padded
seq_lens = torch.tensor([9, 4], dtype=torch.int32)
qsl = torch.tensor([0, 3, 4], dtype=torch.int32)  # 3 prefill rows, 1 decode row, 2 padding
positions = torch.tensor([6, 7, 8, 3, 0, 0], dtype=torch.int64)
args = (codec, q, cache, tables, seq_lens, qsl, positions)
kw = dict(scale=d**-0.5, softcap=softcap, window=window)
ref = reference.paged_attention(*args, **kw)
got = paged_attention(*args, **kw, splits=splits)
torch.save({"ref": ref, "got": got}, sys.argv[8])
"""


def run_child(tmp_path, *args):
    out = tmp_path / "r.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, *map(str, args), str(out)], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(out)


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_attention_matches_reference(tmp_path, name):
    res = run_child(tmp_path, name, 64, 4, 2, 0, 0, 2)
    torch.testing.assert_close(res["got"], res["ref"], atol=1e-5, rtol=1e-3)
    assert torch.equal(res["got"][4:], torch.zeros_like(res["got"][4:]))  # padding rows


@pytest.mark.parametrize(
    "name,d,heads,kvh,window,softcap,splits",
    [("turboquant_4bit_nc", 64, 4, 2, 3, 20.0, 4), ("auto", 128, 6, 2, 0, 0, 1),
     ("turboquant_3bit_nc", 128, 3, 3, 5, 0, 8), ("fp8", 64, 8, 1, 2, 30.0, 2),
     ("turboquant_4bit_nc", 256, 4, 1, 5, 0, 2), ("tqx_k4v3_mse", 256, 4, 1, 0, 0, 1)],
)  # fmt: skip
def test_interpreted_attention_windows_softcap_gqa_splits(
    tmp_path, name, d, heads, kvh, window, softcap, splits
):
    res = run_child(tmp_path, name, d, heads, kvh, window, softcap, splits)
    torch.testing.assert_close(res["got"], res["ref"], atol=1e-5, rtol=1e-3)


# Recent window: keys within the last N positions of each query come from a model-dtype cache
# paged by its own (sliding, null-recycled) block table; with S sink tokens, so do the first S
# (their logical block 0 kept as block 1).
RECENT_CHILD = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.ops import reference
from tqexport.ops.triton.paged_attention import paged_attention
name, n, splits, sink = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
codec = make_codec(name, 64, model_dtype="float32")
plain = make_codec("auto", 64, model_dtype="float32")
g = torch.Generator().manual_seed(n)
k, v = torch.randn(40, 2, 64, generator=g), torch.randn(40, 2, 64, generator=g)
shapes = [(6, 16, 2) + ((t.width,) if t.width else ()) for t in codec.tensors]
cache = [torch.zeros(s, dtype=torch_dtype(t.dtype)) for s, t in zip(shapes, codec.tensors)]
cache = reference.write_cache(codec, cache, k, v, torch.arange(40) + 16)  # blocks 1, 2, 3
recent = [torch.zeros(6, 16, 2, 64) for _ in range(2)]
# the recent group holds blocks 4, 5 for logical blocks 1, 2; logical block 0 was recycled
recent = reference.write_cache(plain, recent, k[16:], v[16:], torch.arange(24) + 64)
recent = reference.write_cache(plain, recent, k[:16], v[:16], torch.arange(16) + 16)
recent_tables = torch.tensor([[1 if sink else 0, 4, 5]], dtype=torch.int32)
q = torch.randn(5, 4, 64, generator=g)
args = (codec, q, cache, torch.tensor([[1, 2, 3]], dtype=torch.int32),
        torch.tensor([40], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([36, 37, 38, 39, 0]))
kw = dict(scale=0.125, recent_cache=recent, recent_block_tables=recent_tables, recent_window=n,
          sink_tokens=sink)
ref = reference.paged_attention(*args, **kw)
got = paged_attention(*args, **kw, splits=splits)
plain_ref = reference.paged_attention(*args, scale=0.125)
no_sink = reference.paged_attention(*args, **{**kw, "sink_tokens": 0})
torch.save({"ref": ref, "got": got, "plain": plain_ref, "no_sink": no_sink}, sys.argv[5])
"""


@pytest.mark.parametrize(
    "name,n,splits,sink",
    [("turboquant_4bit_nc", 8, 2, 0), ("fp8", 16, 1, 3), ("turboquant_k8v4", 20, 4, 0),
     ("turboquant_3bit_nc", 8, 2, 5)],
)  # fmt: skip
def test_interpreted_attention_with_recent_window(tmp_path, name, n, splits, sink):
    out = tmp_path / "r.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [name, str(n), str(splits), str(sink), str(out)]
    r = subprocess.run([sys.executable, "-c", RECENT_CHILD, *args],
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = torch.load(out)
    torch.testing.assert_close(res["got"], res["ref"], atol=1e-5, rtol=1e-3)
    assert torch.equal(res["got"][4], torch.zeros_like(res["got"][4]))  # padding row
    assert (res["ref"][:4] - res["plain"][:4]).abs().max() > 1e-3  # the window changed reads
    if sink:  # and the sink tokens did too
        assert (res["ref"][:4] - res["no_sink"][:4]).abs().max() > 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_attention_kernels_compile_to_sm90_ptx(name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tqexport.ops.triton.paged_attention import kernel_variants

    for d, heads, kvh in ((64, 9, 3), (128, 32, 8), (256, 4, 1)):  # 256: Gemma 3's heads
        codec = make_codec(name, d, model_dtype="float32")
        recent = name.startswith("turbo") and d == 64  # the recent-window variant, once
        for fn, sig, consts in kernel_variants(codec, heads, kvh, block_size=16, recent=recent):
            compiled = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
            )
            assert ".target sm_90" in compiled.asm["ptx"] and fn.__name__ in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_attention_matches_reference(name):
    from tqexport.ops import reference
    from tqexport.ops.triton.paged_attention import paged_attention

    codec = make_codec(name, 128, model_dtype="float32")
    shapes = [(64, 16, 8) + ((t.width,) if t.width else ()) for t in codec.tensors]
    cache = [torch.zeros(s, dtype=torch_dtype(t.dtype)) for s, t in zip(shapes, codec.tensors)]
    cache = reference.write_cache(codec, cache, torch.randn(500, 8, 128), torch.randn(500, 8, 128),
                                  torch.arange(500) + 16)  # fmt: skip
    tables = torch.arange(1, 33, dtype=torch.int32).reshape(1, 32)
    args = (torch.randn(4, 32, 128), cache, tables, torch.tensor([500], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32), torch.arange(496, 500))  # fmt: skip
    ref = reference.paged_attention(codec, *args, scale=128**-0.5)
    cuda_args = [a.cuda() if torch.is_tensor(a) else [c.cuda() for c in a] for a in args]
    got = paged_attention(codec, *cuda_args, scale=128**-0.5)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-3)
