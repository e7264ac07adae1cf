"""ONNX function bodies (exported from the reference ops) against the reference, on ORT CPU."""

import numpy as np
import pytest
import torch
from helpers import MATRIX_DTYPES, OPSET, layer_for, single_node_model

from tqexport.export.functions import function_for
from tqexport.kvquant.codecs import torch_dtype
from tqexport.ops import reference
from tqexport.ops.attributes import CACHE_WRITE, PAGED_ATTENTION, node_attrs
from tqexport.ops.torch_ops import codec_for

#: every format at head size 64; at Gemma 3's 256 one TurboQuant format per codec path (fp8
#: keys, uniform values, grouped values, MSE values)
WRITE_CASES = [(dt, 64) for dt in MATRIX_DTYPES] + [
    (dt, 256) for dt in ("turboquant_k8v4", "turboquant_4bit_nc", "tqx_k4v3_g32", "tqx_k4v3_mse")
]


@pytest.mark.parametrize("dtype,d", WRITE_CASES)
def test_cache_write_body_is_byte_exact(dtype, d):
    layer = layer_for(dtype, d=d)
    attrs = node_attrs(CACHE_WRITE, layer, num_heads=4)
    c = layer.cache
    codec = codec_for(c.kv_cache_dtype, d, "float32", c.k_scale, c.v_scale)
    g = torch.Generator().manual_seed(11)
    cache = [
        torch.randint(0, 255, s, generator=g).to(torch_dtype(t.dtype))
        if t.dtype == "uint8"
        else torch.randn(s, generator=g).to(torch_dtype(t.dtype))
        for t, s in zip(c.tensors, c.tensor_shapes(6).values())
    ]
    k = torch.randn(7, 2, d, generator=g) * 3
    v = torch.randn(7, 2, d, generator=g)
    slots = torch.tensor([4, 5, 6, 7, 8, -1, 21], dtype=torch.int64)
    ref = reference.write_cache(codec, cache, k, v, slots)
    sess = single_node_model(
        CACHE_WRITE,
        attrs,
        [*cache, k, v, slots],
        [(t.dtype, x.dim()) for t, x in zip(c.tensors, cache)],
    )
    got = sess.run(None, {f"in{i}": x.numpy() for i, x in enumerate([*cache, k, v, slots])})
    for r, o in zip(ref, got):
        assert np.array_equal(r.numpy(), o), dtype
    assert torch.equal(ref[0][3:5], cache[0][3:5])  # blocks nobody wrote


@pytest.mark.parametrize(
    "dtype,window,softcap,d",
    [("auto", None, None, 64), ("turboquant_3bit_nc", 3, None, 64), ("fp8", None, 20.0, 64),
     ("int4_per_token_head", 5, None, 64), ("turboquant_k8v4", None, None, 64),
     ("nvfp4", None, None, 64), ("turboquant_4bit_nc", 5, None, 256),
     ("tqx_k4v3_mse", None, None, 256)],
)  # fmt: skip
def test_paged_attention_body_matches_reference(dtype, window, softcap, d):
    layer = layer_for(dtype, window, d=d)
    if softcap:
        from dataclasses import replace

        layer = replace(layer, softcap=softcap)
    attrs = node_attrs(PAGED_ATTENTION, layer, num_heads=4)
    c = layer.cache
    codec = codec_for(c.kv_cache_dtype, d, "float32", c.k_scale, c.v_scale)
    g = torch.Generator().manual_seed(12)
    cache = [
        torch.zeros(s, dtype=torch_dtype(t.dtype))
        for t, s in zip(c.tensors, c.tensor_shapes(8).values())
    ]
    # two sequences: 9 and 4 cached tokens; block tables padded with the null block
    k = torch.randn(13, 2, d, generator=g)
    slots = torch.tensor(list(range(4, 13)) + [20, 21, 22, 23])
    cache = reference.write_cache(codec, cache, k, torch.randn(13, 2, d, generator=g), slots)
    q = torch.randn(5, 4, d, generator=g)
    tables = torch.tensor([[1, 2, 3], [5, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 4], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)  # 3 queries of seq 0, 1 of seq 1, 1 padding
    positions = torch.tensor([6, 7, 8, 3, 0], dtype=torch.int64)
    inputs = [q, *cache, tables, seq_lens, qsl, positions]
    ref = reference.paged_attention(
        codec, q, cache, tables, seq_lens, qsl, positions,
        scale=layer.scale, softcap=layer.softcap, window=layer.window,
    )  # fmt: skip
    sess = single_node_model(PAGED_ATTENTION, attrs, inputs, [("float32", 3)])
    (got,) = sess.run(None, {f"in{i}": x.numpy() for i, x in enumerate(inputs)})
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-5, rtol=1e-4)
    assert np.all(got[4] == 0)  # the padding token sees nothing


def test_a_variant_is_exported_once_and_handed_out_as_copies(monkeypatch, tmp_path):
    """Exported once per variant: kept for the process and in the cache directory (shared by
    processes), a damaged cache file exported again; each caller gets its own copy."""
    from tqexport.export import functions

    calls = []
    real = functions._export_body
    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path))
    monkeypatch.setattr(functions, "_EXPORTED", {})
    monkeypatch.setattr(functions, "_export_body", lambda *a: calls.append(a) or real(*a))
    attrs = node_attrs(CACHE_WRITE, layer_for("fp8"), num_heads=4)
    first, _ = function_for(CACHE_WRITE, attrs, OPSET)
    again, _ = function_for(CACHE_WRITE, attrs, OPSET)
    assert len(calls) == 1 and again == first and again is not first
    first.node.pop()  # a caller changing its copy changes nobody else's
    assert function_for(CACHE_WRITE, attrs, OPSET)[0] == again
    (stored,) = (tmp_path / "onnx-bodies" / CACHE_WRITE).iterdir()
    assert stored.name.startswith(attrs["variant"] + "-")
    functions._EXPORTED.clear()  # as a new process: read from the cache directory
    assert function_for(CACHE_WRITE, attrs, OPSET)[0] == again and len(calls) == 1
    for damaged, n in ((b"\xff" * 7, 2), (b"", 3)):  # unreadable; no function in it
        functions._EXPORTED.clear()
        stored.write_bytes(damaged)
        assert function_for(CACHE_WRITE, attrs, OPSET)[0] == again and len(calls) == n
    other = node_attrs(CACHE_WRITE, layer_for("fp8", heads=3), num_heads=3)
    assert function_for(CACHE_WRITE, other, OPSET)[0].overload == other["variant"]
    assert len(calls) == 4
    victim = tmp_path / "precious.txt"  # a link planted at the cache's name is replaced
    victim.write_text("precious")
    functions._EXPORTED.clear()
    stored.unlink()
    stored.symlink_to(victim)
    assert function_for(CACHE_WRITE, attrs, OPSET)[0] == again and len(calls) == 5
    assert victim.read_text() == "precious" and stored.is_file() and not stored.is_symlink()
