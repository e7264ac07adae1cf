"""Per-sequence paged attention and factored (rotated-basis) cache reads: same semantics as a
per-query loop over decoded keys, batching that changes nothing, gathers no wider than needed,
and the ORT backend's device-resident cache values."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import MATRIX_DTYPES, describe
from onnx import helper

from tqexport.export.functions import function_for
from tqexport.kvplan.resolve import resolve
from tqexport.kvquant.codecs import (
    _FP8_E4M3_TABLE,
    fp16_fields,
    make_codec,
    nibbles,
    torch_dtype,
    triplet_codes,
)
from tqexport.kvquant.float_bytes import fp8_decode, fp16_from_bytes
from tqexport.kvquant.packing import unpack_codes
from tqexport.ops import reference
from tqexport.ops.attributes import DOMAIN, DOMAIN_VERSION, PAGED_ATTENTION, node_attrs
from tqexport.ops.torch_ops import codec_for
from tqexport.spec import BuildRequest

DTYPES = MATRIX_DTYPES
ONNX_TYPES = {"float32": 1, "uint8": 2, "float16": 10, "int64": 7, "int32": 6}


def naive_attention(codec, q, cache, tables, seq_lens, qsl, positions, *, scale,
                    softcap=None, window=None, recent_cache=None, recent_tables=None,
                    recent_window=0, sink_tokens=0):  # fmt: skip
    """The op's contract, one query and one key at a time (float64), from decoded K/V."""
    bs, kvh = cache[0].shape[1], cache[0].shape[2]
    keys, values = codec.decode({f.role: t for f, t in zip(codec.tensors, cache)})
    if recent_window:
        plain = make_codec("auto", q.shape[-1], model_dtype="float32")
        r_keys, r_values = plain.decode({"k": recent_cache[0], "v": recent_cache[1]})
    out = torch.zeros(q.shape, dtype=torch.float64)
    groups = q.shape[1] // kvh
    for s in range(len(seq_lens)):
        for t in range(int(qsl[s]), int(qsl[s + 1])):
            p = int(positions[t])
            for h in range(q.shape[1]):
                scores, vals = [], []
                for j in range(int(seq_lens[s])):
                    if j > p or (window and j <= p - window):
                        continue
                    recent = recent_window and (j > p - recent_window or j < sink_tokens)
                    table = recent_tables if recent else tables
                    if j // bs >= table.shape[1] or int(table[s, j // bs]) == 0:
                        continue
                    b, o = int(table[s, j // bs]), j % bs
                    kk, vv = (r_keys, r_values) if recent else (keys, values)
                    x = float(q[t, h].double() @ kk[b, o, h // groups].double()) * scale
                    scores.append(x if softcap is None else np.tanh(x / softcap) * softcap)
                    vals.append(vv[b, o, h // groups].double())
                if scores:
                    w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                    out[t, h] = (w[:, None] * torch.stack(vals)).sum(0)
    return out


def filled_cache(codec, num_blocks, bs, kvh, d, g):
    cache = [torch.zeros(t.shape(num_blocks, bs, kvh), dtype=torch_dtype(t.dtype))
             for t in codec.tensors]  # fmt: skip
    n = num_blocks * bs
    k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    return reference.write_cache(codec, cache, k, v, torch.arange(n))


def mixed_step(g, heads=4, d=64):
    """A prefill chunk (5 queries from position 3), a decode at 12, a 2-token prompt, a row
    with no queries, and 2 padding tokens; tables padded with the null block."""
    i32 = torch.int32
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0], [0, 0, 0, 0]], dtype=i32)
    recent_tables = torch.tensor([[1, 2, 0, 0], [0, 0, 5, 6], [7, 0, 0, 0], [0, 0, 0, 0]],
                                 dtype=i32)  # fmt: skip
    seq_lens = torch.tensor([8, 13, 2, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 8, 8], dtype=torch.int32)
    positions = torch.tensor([3, 4, 5, 6, 7, 12, 0, 1, 0, 0])
    q = torch.randn(10, heads, d, generator=g)
    return q, tables, recent_tables, seq_lens, qsl, positions


CASES = [(None, None, 0, 0), (5, None, 0, 0), (None, 20.0, 0, 0), (None, None, 6, 0),
         (7, None, 6, 0), (None, None, 6, 3), (7, 20.0, 2, 5)]  # fmt: skip


@pytest.mark.parametrize("window,softcap,recent,sink", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_the_per_query_definition(dtype, window, softcap, recent, sink):
    g = torch.Generator().manual_seed(0)
    codec = make_codec(dtype, 64, model_dtype="float32")
    cache = filled_cache(codec, 10, 4, 2, 64, g)
    plain = make_codec("auto", 64, model_dtype="float32")
    recent_cache = filled_cache(plain, 10, 4, 2, 64, g) if recent else None
    q, tables, r_tables, seq_lens, qsl, positions = mixed_step(g)
    sink_blocks = -(-sink // 4)
    r_tables[1, :sink_blocks] = torch.tensor([8, 9], dtype=torch.int32)[:sink_blocks]  # kept
    kw = dict(scale=0.125, softcap=softcap, window=window)
    got = reference.paged_attention(
        codec, q, cache, tables, seq_lens, qsl, positions, **kw, recent_cache=recent_cache,
        recent_block_tables=r_tables if recent else None, recent_window=recent,
        sink_tokens=sink,
    )  # fmt: skip
    want = naive_attention(codec, q, cache, tables, seq_lens, qsl, positions, **kw,
                           recent_cache=recent_cache, recent_tables=r_tables,
                           recent_window=recent, sink_tokens=sink)  # fmt: skip
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[8:], torch.zeros_like(got[8:]))  # padding tokens


def single_node_session(codec_name, inputs, threads=1, kv_heads=3, heads=9):
    desc = describe([None], head_size=64, kv_heads=kv_heads, dtype="float32")
    layer = resolve(desc, BuildRequest(codec_name, boundary=False, block_size=16)).spec.layers[0]
    attrs = node_attrs(PAGED_ATTENTION, layer, num_heads=heads)
    fn, extra = function_for(PAGED_ATTENTION, attrs, 21)
    names = [f"in{i}" for i in range(len(inputs))]
    node = helper.make_node(PAGED_ATTENTION, names, ["out"], domain=DOMAIN,
                            overload=attrs["variant"])  # fmt: skip
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, ONNX_TYPES[str(x.dtype)[6:]], [None] * x.dim())
         for n, x in zip(names, inputs)],
        [helper.make_tensor_value_info("out", 1, [None] * 3)],
    )  # fmt: skip
    model = helper.make_model(graph, functions=[fn, *extra], ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])  # fmt: skip
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), opts)
    return lambda xs: session.run(None, {f"in{i}": x.numpy() for i, x in enumerate(xs)})[0]


def as_args(codec, xs):
    """Flat node inputs -> the reference op's positional arguments (cache as one list)."""
    n = len(codec.tensors)
    return [xs[0], list(xs[1 : 1 + n]), *xs[1 + n :]]


def decode_batch(context_lens, g, codec, bs=16, kv_heads=3, heads=9):
    """One decode step of sequences holding ``context_lens`` tokens (their last just written),
    each in its own contiguous blocks, and the same step of each sequence alone."""
    per = [-(-n // bs) for n in context_lens]
    first = np.cumsum([1] + per[:-1])
    cache = filled_cache(codec, 1 + sum(per), bs, kv_heads, 64, g)
    width = max(per) + 2  # tables wider than any sequence needs, padded with the null block
    tables = torch.zeros(len(per), width, dtype=torch.int32)
    for i, (f, n) in enumerate(zip(first, per)):
        tables[i, :n] = torch.arange(f, f + n)
    q = torch.randn(len(per), heads, 64, generator=g)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    qsl = torch.arange(len(per) + 1, dtype=torch.int32)
    pos = lens.long() - 1
    batched = [q, *cache, tables, lens, qsl, pos]
    alone = [[q[i : i + 1], *cache, tables[i : i + 1], lens[i : i + 1], qsl[:2], pos[i : i + 1]]
             for i in range(len(per))]  # fmt: skip
    return batched, alone


@pytest.mark.parametrize("dtype", ["auto", "fp8", "turboquant_4bit_nc", "tqx_k4v3_g32"])
def test_batch_of_8_decodes_equals_8_single_decodes(dtype):
    """Reference op and its ONNX body on ORT. Same context lengths: bit for bit (every
    sequence's gather, matmuls and softmax have the same shapes alone and batched). Different
    lengths: within 1e-6 (the batch gathers as wide as its longest sequence, so a shorter one
    sums extra exact zeros, which BLAS and ORT may block differently)."""
    g = torch.Generator().manual_seed(8)
    codec = codec_for(dtype, 64, "float32", 1.0, 1.0)
    run_ort = None
    for lens, exact in (([300] * 8, True), ([300, 17, 1, 64, 129, 250, 16, 33], False)):
        batched, alone = decode_batch(lens, g, codec)
        if run_ort is None:
            run_ort = single_node_session(dtype, batched)
        ref = reference.paged_attention(codec, *as_args(codec, batched), scale=0.125)
        ort_out = run_ort(batched)
        for i, xs in enumerate(alone):
            one = reference.paged_attention(codec, *as_args(codec, xs), scale=0.125)
            one_ort = run_ort(xs)
            if exact:
                assert torch.equal(ref[i : i + 1], one), (dtype, i)
                assert np.array_equal(ort_out[i : i + 1], one_ort), (dtype, i)
            else:
                torch.testing.assert_close(ref[i : i + 1], one, atol=1e-6, rtol=0)
                np.testing.assert_allclose(ort_out[i : i + 1], one_ort, atol=1e-6, rtol=0)
        np.testing.assert_allclose(ort_out, ref.numpy(), atol=1e-5, rtol=1e-4)


def test_gathers_only_what_the_step_can_see():
    """Decode: the longest sequence's blocks (not the table width); a window or the recent
    split: from the first block the sequence's query can see."""
    seq_lens = torch.tensor([40, 3], dtype=torch.int64)
    tables = torch.arange(1, 21, dtype=torch.int32).reshape(2, 10)  # 10 blocks each
    qs = reference._Queries(torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens - 1)
    full = reference._Segment(qs, tables, seq_lens, 4, 2)
    assert full.index.shape == (2, 2, 40)  # 10 blocks of 4: the longest sequence needs them
    short = reference._Segment(qs, tables, torch.tensor([9, 3]), 4, 2)
    assert short.index.shape == (2, 2, 12)  # 3 blocks, not 10
    windowed = reference._Segment(qs, tables, seq_lens, 4, 2, lookback=5, window=5)
    assert windowed.index.shape == (2, 2, 8)  # positions 35..39 lie in blocks 8 and 9
    assert windowed.seen.sum(-1).tolist() == [[5], [3]]


def test_invalid_rows_holding_nan_change_nothing():
    """Bytes beyond seq_len, in the null block's written row (padding) or past a short table
    decode to NaN/inf (0x7F fp8, 0x7F7F fp16, NaN floats): outputs are as if they were zeros,
    on ORT too. Keys that are not real read the null block's last row, which no write touches
    and allocation zeroes; only that row must stay finite (shown poisoned last)."""
    g = torch.Generator().manual_seed(5)
    for dtype in ("auto", "fp8", "turboquant_4bit_nc", "int8_per_token_head"):
        codec = codec_for(dtype, 64, "float32", 1.0, 1.0)
        batched, _ = decode_batch([20, 7], g, codec)
        cache = batched[1:-4]
        poisoned = []
        for t in cache:
            t = t.clone()
            bad = torch.full_like(t[0, 0], float("nan") if t.is_floating_point() else 0x7F)
            t[0, :-1] = bad  # the null block but its last row
            t[2, 4:] = bad  # sequence 0 holds 20 tokens: rows 4.. of its second block
            t[3, 7:] = bad  # sequence 1 holds 7
            poisoned.append(t)
        clean = reference.paged_attention(codec, *as_args(codec, batched), scale=0.125)
        dirty_in = [batched[0], *poisoned, *batched[-4:]]
        dirty = reference.paged_attention(codec, *as_args(codec, dirty_in), scale=0.125)
        assert torch.equal(clean, dirty), dtype
        got = single_node_session(dtype, dirty_in)(dirty_in)
        np.testing.assert_allclose(got, clean.numpy(), atol=1e-5, rtol=1e-4)
        for t in poisoned:
            t[0, -1] = torch.full_like(t[0, -1], float("nan") if t.is_floating_point() else 0x7F)
        broken = reference.paged_attention(codec, *as_args(codec, dirty_in), scale=0.125)
        assert not torch.equal(clean.nan_to_num(), broken.nan_to_num()), dtype


@pytest.mark.parametrize("dtype", ["auto", "fp8", "turboquant_4bit_nc"])
def test_block_size_1_zeroes_what_is_not_real(dtype):
    """With blocks of one token the null block has no row that padding never writes: keys that
    are not real are zeroed after the gather instead, so NaN there changes nothing either."""
    g = torch.Generator().manual_seed(6)
    codec = codec_for(dtype, 64, "float32", 1.0, 1.0)
    batched, _ = decode_batch([5, 3], g, codec, bs=1)
    assert batched[-4].shape == (2, 7)  # tables padded with the null block
    poisoned = []
    for t in batched[1:-4]:
        t = t.clone()
        t[0] = torch.full_like(t[0], float("nan") if t.is_floating_point() else 0x7F)
        poisoned.append(t)
    clean = reference.paged_attention(codec, *as_args(codec, batched), scale=0.125)
    dirty_in = [batched[0], *poisoned, *batched[-4:]]
    dirty = reference.paged_attention(codec, *as_args(codec, dirty_in), scale=0.125)
    assert clean.isfinite().all() and torch.equal(clean, dirty)


def test_decode_side_tables_equal_the_arithmetic_decoders():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    low, high = nibbles(every[:, None])
    assert torch.equal(torch.cat([low, high], -1), unpack_codes(every[:, None], 4, 2).float())
    stream = torch.randint(0, 256, (50, 24), dtype=torch.int32).to(torch.uint8)
    parts = torch.stack(triplet_codes(stream), -1).flatten(-2)
    assert torch.equal(parts, unpack_codes(stream, 3, 64).float())
    pairs = torch.stack([torch.arange(65536) % 256, torch.arange(65536) // 256], -1)
    got, want = fp16_fields(pairs.to(torch.uint8))[..., 0], fp16_from_bytes(pairs.to(torch.uint8))
    assert torch.equal(got, want)
    assert torch.equal(_FP8_E4M3_TABLE.nan_to_num(7.0), fp8_decode(every, _e4m3()).nan_to_num(7.0))


def _e4m3():
    from tqexport.kvquant.float_bytes import E4M3

    return E4M3


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_operands_stand_for_the_decoded_cache(dtype):
    g = torch.Generator().manual_seed(3)
    codec = make_codec(dtype, 64, model_dtype="float32")
    k, v = torch.randn(40, 3, 64, generator=g) * 2, torch.randn(40, 3, 64, generator=g)
    cache = codec.encode(k, v)
    keys, values = codec.decode(cache)
    dense_k, dense_v = codec.attention_operands(cache).dense()
    # MSE keys (and MSE values) are rotated after the sum instead of before: last-bit
    # differences only; every other value is exact
    torch.testing.assert_close(dense_k, keys, atol=1e-6 * float(keys.abs().max()), rtol=0)
    if getattr(getattr(codec, "preset", None), "value_mse", False):
        torch.testing.assert_close(dense_v, values, atol=1e-6 * float(values.abs().max()), rtol=0)
    else:
        assert torch.equal(dense_v, values)


def test_ort_backend_binds_cache_values_once_and_in_place(artifacts):
    """The binding code the CUDA provider uses, on the CPU: caches are OrtValues over the
    host buffers, bound once onto inputs and outputs; steps of changing shapes (prefill,
    decode, logits of 1 and 2 rows) update them in place, bit-identical to a copying run."""
    from tqexport.contract.artifact import open_artifact
    from tqexport.contract.steps import SeqChunk, build_step
    from tqexport.errors import TQExportError
    from tqexport.runtime.backends.ort import OrtBackend, session_options

    art = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc"))
    bound = OrtBackend(art, 10, device="cpu")
    copied = OrtBackend(art, 10, in_place=False)
    ptrs = {n: v.data_ptr() for n, v in bound.cache_values.items()}
    assert ptrs == {n: a.ctypes.data for n, a in bound.caches.items()}
    tables = [[1, 2, 3]] * len(art.spec.groups)
    other = [[4, 5]] * len(art.spec.groups)
    steps = [
        build_step(art.spec, [SeqChunk(list(range(3, 20)), 0, tables), SeqChunk([5], 0, other)]),
        build_step(art.spec, [SeqChunk([7], 17, tables)]),
        build_step(art.spec, [SeqChunk([8, 9], 18, tables, "all"), SeqChunk([6], 1, other)]),
    ]
    for step in steps:
        a, b = bound.run(step), copied.run(step)
        assert torch.equal(a, b)
        out = {n.replace("cache.", "cache_out.", 1): p for n, p in ptrs.items()}
        assert bound.last_output_ptrs == out
    for n in ptrs:
        assert np.array_equal(bound.cache_array(n), copied.caches[n])
    assert bound._binding is not None and bound.caches["cache.0.kv"][1].any()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(TQExportError, match="cuda"):
            OrtBackend(art, 4, device="cuda")
    with pytest.raises(TQExportError, match="unknown ORT session option"):
        session_options(arena=True)
