"""The native ONNX Runtime kernels (``plugins/``) on single-node models against the torch
reference ops: CacheWrite bytes, PagedAttention outputs over every cache format and attention
feature, AddBlockOffsets and RotateHalf against their function bodies, bad input answered
with an error status naming it, the same tests under
AddressSanitizer + UBSan, and ORT running the kernels rather than the function bodies."""

import ctypes
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from filelock import FileLock
from helpers import MATRIX_DTYPES, ONNX_TYPES, layer_for, single_node_model

from tqexport.export.block_fusions import fused_add_rms_norm_function, silu_and_mul_function
from tqexport.export.fusable import rotate_half_function
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.kvquant.modes import KV_CACHE_DTYPES, KVQuantMode
from tqexport.kvquant.turboquant import PRESETS
from tqexport.native import build as native_build
from tqexport.ops import reference
from tqexport.ops.attributes import (
    ADD_BLOCK_OFFSETS,
    CACHE_WRITE,
    DOMAIN,
    DOMAIN_VERSION,
    FUSED_ADD_RMS_NORM,
    PAGED_ATTENTION,
    ROTATE_HALF,
    SILU_AND_MUL,
    cache_write_attrs,
    node_attrs,
)
from tqexport.spec import KVCacheSpec
from tqexport.verify.parity import near_threshold, tolerance
from tqexport.weights.graph import block_offsets_function

#: "1" in the sanitizer test's subprocess: the tests register the ASan + UBSan build of the
#: library and run a subset of their matrices (every format once, every bad input)
SANITIZE_ENV = "TQEXPORT_NATIVE_SANITIZE"
SANITIZED = os.environ.get(SANITIZE_ENV) == "1"
#: caps the attention kernel's instruction set (avx2, base): the narrower kernels' test runs
ISA_ENV = "TQEXPORT_NATIVE_ISA"

#: every format the matrices run, with the native twins of vLLM's TurboQuant layouts
DTYPES = [*MATRIX_DTYPES, "tqx_k4v4", "tqx_k3v3"]
#: formats whose encoding rotates (fp32 sums the kernel orders its own way): their bytes may
#: differ from the reference's at a rounding threshold (the product's parity rule)
ROTATED = {n for n, p in PRESETS.items() if p.key_bits != 8 or p.value_mse}
ATTENTION_ATOL = 1e-5  # float32 models
InvalidArgument = ort.capi.onnxruntime_pybind11_state.InvalidArgument


def _native_library(sanitize: bool) -> Path:
    if native_build.find_ort_headers() is None:
        pytest.skip(
            "ONNX Runtime C/C++ API headers not found: set ORT_INCLUDE_DIR to test the native "
            "kernels"
        )
    out = native_build.library_path(sanitize)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{out.parent}.lock"):  # pytest-xdist workers and the sanitizer's subprocess
        return native_build.build(sanitize=sanitize).library


@pytest.fixture(scope="session")
def library() -> Path:
    """The kernel library built from this checkout (once per test run; cached by source hash):
    the ASan + UBSan build under :data:`SANITIZE_ENV`."""
    return _native_library(SANITIZED)


def cache_spec(dtype, d=64, model_dtype="float32", block_size=4, kv_heads=2) -> KVCacheSpec:
    scales = (0.5, 2.0) if KV_CACHE_DTYPES[dtype].mode.uses_layer_scales else (1.0, 1.0)
    return KVCacheSpec(kv_cache_dtype=dtype, num_kv_heads=kv_heads, head_size=d,
                       block_size=block_size, model_dtype=model_dtype, k_scale=scales[0],
                       v_scale=scales[1])  # fmt: skip


def with_outliers(g, shape, dtype=torch.float32, scale=1.0):
    """Normal values with about 2% outliers 20x larger (what real keys and values hold)."""
    x = torch.randn(shape, generator=g) * scale
    spikes = torch.rand(shape, generator=g) < 0.02
    return torch.where(spikes, 20 * x, x).to(dtype)


def random_cache(spec: KVCacheSpec, num_blocks: int, g) -> list[torch.Tensor]:
    """Cache tensors as recycled blocks hold them: random bytes (float tensors random values);
    the null block 0 zero but its row 0 (where padding tokens land)."""
    out = []
    for t, shape in zip(spec.tensors, spec.tensor_shapes(num_blocks).values()):
        if t.dtype == "uint8":
            x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        else:
            x = torch.randn(shape, generator=g).to(torch_dtype(t.dtype))
        x[0, 1:] = 0
        out.append(x)
    return out


def native_session(library, op, attrs, inputs, out_types, threads=2, quiet=False):
    """A session of one tqexport node that only the library serves (no function bodies)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.enable_cpu_mem_arena = False  # a buffer per tensor: AddressSanitizer sees its bounds
    if quiet:  # expected errors: ORT would log each one
        opts.log_severity_level = 4
    return single_node_model(
        op, attrs, inputs, out_types, bodies=False, library=library, options=opts
    )


def feed(inputs) -> dict[str, np.ndarray]:
    return {f"in{i}": x.numpy() for i, x in enumerate(inputs)}


def cache_outputs(spec: KVCacheSpec) -> list[tuple[str, int]]:
    return [(t.dtype, 3 if t.width is None else 4) for t in spec.tensors]


# -- CacheWrite ---------------------------------------------------------------------------------
def head_sizes(dtype) -> tuple[int, ...]:
    """64 and 128; also 256 (Gemma's) for TurboQuant and auto caches."""
    big = dtype == "auto" or KV_CACHE_DTYPES[dtype].mode is KVQuantMode.TURBOQUANT
    return (64, 128, 256) if big else (64, 128)


def _cache_write_params():
    if SANITIZED:  # every format at its largest head size, and once from a float16 model
        return [(dt, max(head_sizes(dt)), "float32") for dt in DTYPES] + [
            (dt, 64, "float16") for dt in DTYPES
        ]
    return [(dt, d, md) for dt in DTYPES for d in head_sizes(dt) for md in ("float32", "float16")]


CACHE_WRITE_CASES = [pytest.param(*c, id="{}-D{}-{}".format(*c)) for c in _cache_write_params()]


def write_case(spec: KVCacheSpec, seed: int):
    """(cache of 10 blocks, k, v, slot_mapping): 20 tokens scattered over blocks 2-7 in no
    order and 3 padding tokens (slot < 0) among them; blocks 1, 8 and 9 untouched."""
    g = torch.Generator().manual_seed(seed)
    cache = random_cache(spec, 10, g)
    bs = spec.block_size
    real = 2 * bs + torch.randperm(6 * bs, generator=g)[:20]
    slots = torch.cat([real, torch.tensor([-1, -7, -1])])[torch.randperm(23, generator=g)]
    dt = torch_dtype(spec.model_dtype)
    shape = (23, spec.num_kv_heads, spec.head_size)
    return cache, with_outliers(g, shape, dt, 3.0), with_outliers(g, shape, dt), slots


def last_padding_wins(k, v, slots):
    """The tokens whose writes a step leaves: the kernel writes padding tokens into the null
    block's row 0 in order, so the last one's bytes stay there (the reference, one
    ``index_put`` with repeated indices, leaves any one of them)."""
    pad = torch.nonzero(slots < 0).flatten()
    keep = torch.cat([torch.nonzero(slots >= 0).flatten(), pad[-1:]])
    return k[keep], v[keep], slots[keep]


def differing_token_heads(ref: torch.Tensor, got: np.ndarray) -> torch.Tensor:
    """``[blocks, block_size, kv_heads]``: where any byte of the two tensors differs."""
    a = np.ascontiguousarray(ref.numpy()).view(np.uint8).reshape(*ref.shape[:3], -1)
    b = np.ascontiguousarray(got).view(np.uint8).reshape(*ref.shape[:3], -1)
    return torch.from_numpy((a != b).any(-1))


def assert_written(spec, cache, k, v, slots, ref, got):
    """``got`` holds the reference's bytes; for rotated TurboQuant formats a token-head may
    differ only where the product's parity rule finds a rounding threshold."""
    codec = spec.codec
    differ = [differing_token_heads(r, o) for r, o in zip(ref, got)]
    counts = {t.role: int(d.sum()) for t, d in zip(codec.tensors, differ)}
    if not any(counts.values()):
        return
    assert spec.kv_cache_dtype in ROTATED, f"token-heads differ from the reference: {counts}"
    unstable = near_threshold(codec, cache, k, v, slots, ref)
    away = {t.role: int((d & ~u).sum()) for t, d, u in zip(codec.tensors, differ, unstable)}
    assert not any(away.values()), f"differ away from a rounding threshold: {away} of {counts}"


@pytest.mark.parametrize("dtype,d,model_dtype", CACHE_WRITE_CASES)
def test_cache_write_writes_the_reference_codecs_bytes(library, dtype, d, model_dtype):
    spec = cache_spec(dtype, d, model_dtype)
    cache, k, v, slots = write_case(spec, seed=d)
    written = last_padding_wins(k, v, slots)
    ref = reference.write_cache(spec.codec, cache, *written)
    attrs = {**cache_write_attrs(spec), "layer": 0}
    inputs = [*cache, k, v, slots]
    for threads in (1, 2):
        sess = native_session(library, CACHE_WRITE, attrs, inputs, cache_outputs(spec), threads)
        assert_written(spec, cache, *written, ref, sess.run(None, feed(inputs)))


@pytest.mark.parametrize("dtype", ["auto", "int4_per_token_head", "turboquant_4bit_nc"])
def test_cache_write_copies_into_a_new_output_and_updates_a_bound_one_in_place(library, dtype):
    """Output in a buffer of its own: the input is left as it was and the untouched blocks
    are copied; output bound onto the input (as OrtBackend binds caches): written there."""
    spec = cache_spec(dtype)
    cache, k, v, slots = write_case(spec, seed=3)
    written = last_padding_wins(k, v, slots)
    ref = reference.write_cache(spec.codec, cache, *written)
    attrs = {**cache_write_attrs(spec), "layer": 0}
    inputs = [*cache, k, v, slots]
    sess = native_session(library, CACHE_WRITE, attrs, inputs, cache_outputs(spec))
    arrays = [c.numpy().copy() for c in cache]
    got = sess.run(None, {**feed(inputs), **{f"in{i}": a for i, a in enumerate(arrays)}})
    assert_written(spec, cache, *written, ref, got)
    for c, a, o in zip(cache, arrays, got):
        assert np.array_equal(a, c.numpy())  # the input is not written
        assert np.array_equal(o[[1, 8, 9]], c.numpy()[[1, 8, 9]])  # nor are these blocks

    binding = sess.io_binding()
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
    for i, value in enumerate(values):
        binding.bind_ortvalue_input(f"in{i}", value)
        binding.bind_ortvalue_output(f"out{i}", value)
    for i, x in enumerate([k, v, slots], start=len(cache)):
        binding.bind_cpu_input(f"in{i}", x.numpy())
    sess.run_with_iobinding(binding)
    outputs = binding.get_outputs()
    assert [o.data_ptr() for o in outputs] == [a.ctypes.data for a in arrays]
    assert_written(spec, cache, *written, ref, arrays)


# -- PagedAttention -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Seq:
    """One sequence of a step: ``seq_len`` keys cached after the step's write, ``queries``
    queries at positions ``start, start + 1, ...`` (default: the last ``queries`` keys')."""

    seq_len: int
    queries: int
    start: int | None = None

    @property
    def positions(self) -> list[int]:
        first = self.seq_len - self.queries if self.start is None else self.start
        return list(range(first, first + self.queries))


#: chunked prefill: chunks continuing a prompt (one longer than a query block of the kernel),
#: a whole prompt, a sequence with no queries, a query that sees nothing (no cached key) and
#: two padding tokens of no sequence
PREFILL = ([Seq(37, 5), Seq(9, 9), Seq(60, 21), Seq(20, 0), Seq(0, 1, start=0)], 2)
#: decode: one query per sequence, contexts long enough for the kernel to split them (> 512)
DECODE = ([Seq(1500, 1), Seq(700, 1), Seq(33, 1), Seq(300, 0), Seq(0, 1, start=0)], 1)


@dataclass(frozen=True)
class Features:
    groups: int = 3  # query heads per kv head
    block_size: int = 16
    window: int = 0
    softcap: float = 0.0
    recent_window: int = 0
    sink_tokens: int = 0


FEATURES = {
    "mha": Features(groups=1),
    "gqa": Features(),
    "window": Features(window=40),
    "softcap": Features(softcap=5.0),
    "recent": Features(recent_window=24),
    "recent-sinks": Features(recent_window=24, sink_tokens=5),
    "block1": Features(block_size=1, window=40),
    "block1-recent-sinks": Features(block_size=1, recent_window=24, sink_tokens=5),
    "everything": Features(window=300, softcap=5.0, recent_window=24, sink_tokens=5),
}


def block_tables(seqs, bs, g, keep=None):
    """``[S, width]`` int32 tables over scattered blocks (a null column of padding), and the
    number of blocks. ``keep(seq, column)``: whether a sequence still holds that block (the
    recent window's group frees the blocks no query reads any more)."""
    need = [-(-s.seq_len // bs) for s in seqs]
    num_blocks = 1 + sum(need) + 2  # two blocks nobody uses
    ids = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    tables = torch.zeros(len(seqs), max(need) + 1, dtype=torch.int32)
    for i, (s, n) in enumerate(zip(seqs, need)):
        row, ids = ids[:n], ids[n:]
        tables[i, :n] = torch.tensor([b if keep is None or keep(s, c) else 0
                                      for c, b in enumerate(row)], dtype=torch.int32)  # fmt: skip
    return tables, num_blocks


def fill(codec, cache, seqs, tables, bs, g, dtype):
    """Every cached key and value of the sequences (in blocks they hold) written through the
    reference codec. Unit normal, no outliers: scores stay of order 1 (a softmax of large
    logits amplifies their last-bit differences: with 20x outlier keys the float32 reference
    itself is 1.6e-5 from the float64 result, the kernel closer)."""
    slots = []
    for row, s in zip(tables.long(), seqs):
        p = torch.arange(s.seq_len)
        block = row[p // bs]
        slots.append((block * bs + p % bs)[block != 0])
    slots = torch.cat(slots)
    kvh, d = cache[0].shape[2], codec.head_size
    k, v = (torch.randn((len(slots), kvh, d), generator=g).to(dtype) for _ in "kv")
    return reference.write_cache(codec, cache, k, v, slots)


def attention_case(spec: KVCacheSpec, f: Features, seqs, pad_tokens, seed):
    """(inputs of the node, reference output, rows that must be zero)."""
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d = spec.block_size, spec.num_kv_heads, spec.head_size
    dt = torch_dtype(spec.model_dtype)
    tables, num_blocks = block_tables(seqs, bs, g)
    cache = fill(spec.codec, random_cache(spec, num_blocks, g), seqs, tables, bs, g, dt)
    positions = [p for s in seqs for p in s.positions] + [0] * pad_tokens
    counts = torch.tensor([0] + [s.queries for s in seqs])
    q = torch.randn((len(positions), kvh * f.groups, d), generator=g).to(dt)
    step = [
        tables,
        torch.tensor([s.seq_len for s in seqs], dtype=torch.int32),
        counts.cumsum(0).to(torch.int32),
        torch.tensor(positions, dtype=torch.int64),
    ]
    recent = {}
    inputs = [q, *cache, *step]
    if f.recent_window:
        plain = make_codec("auto", d, model_dtype=spec.model_dtype)
        rspec = cache_spec("auto", d, spec.model_dtype, bs, kvh)

        def keep(s, col):  # sink tokens, keys a query of s reads from the recent window
            first = min(s.positions, default=s.seq_len) - f.recent_window + 1
            return col * bs < f.sink_tokens or (col + 1) * bs > first

        rtables, rblocks = block_tables(seqs, bs, g, keep)
        rcache = fill(plain, random_cache(rspec, rblocks, g), seqs, rtables, bs, g, dt)
        recent = {
            "recent_cache": rcache,
            "recent_block_tables": rtables,
            "recent_window": f.recent_window,
            "sink_tokens": f.sink_tokens,
        }
        inputs += [*rcache, rtables]
    ref = reference.paged_attention(
        spec.codec, q, cache, *step, scale=d**-0.5, softcap=f.softcap or None,
        window=f.window or None, **recent,
    )  # fmt: skip
    sees_nothing = [i for i, p in enumerate(positions) if i >= sum(s.queries for s in seqs)]
    at = 0
    for s in seqs:
        if s.seq_len == 0:
            sees_nothing += range(at, at + s.queries)
        at += s.queries
    return inputs, ref, sees_nothing


def attention_attrs(spec: KVCacheSpec, f: Features) -> dict:
    return (
        {**cache_write_attrs(spec), "num_heads": spec.num_kv_heads * f.groups,
         "scale": spec.head_size**-0.5, "softcap": f.softcap, "window": f.window, "layer": 0}
        | ({"recent_window": f.recent_window} if f.recent_window else {})
        | ({"sink_tokens": f.sink_tokens} if f.sink_tokens else {})
    )  # fmt: skip


def _attention_params():
    if SANITIZED:  # every format once; every feature on a rotated and a plain codec
        cases = [(dt, "everything", 64, "float32") for dt in DTYPES]
        cases += [(dt, name, 64, "float32") for dt in ("turboquant_4bit_nc",
                  "int4_per_token_head") for name in FEATURES if name != "everything"]  # fmt: skip
        cases += [(dt, "gqa", 256, "float32") for dt in ("auto", "tqx_k4v2_mse")]
        return cases + [(dt, "everything", 64, "float16") for dt in ("auto", "fp8", "tqx_k4v4")]
    cases = [(dt, name, 64, "float32") for dt in DTYPES for name in FEATURES]
    cases += [(dt, "everything", 64, "float16") for dt in DTYPES]
    cases += [(dt, "gqa", d, "float32") for dt in DTYPES for d in head_sizes(dt) if d > 64]
    return cases


@pytest.mark.parametrize(
    "dtype,feature,d,model_dtype",
    [pytest.param(*c, id="-".join(map(str, c))) for c in _attention_params()],
)
def test_paged_attention_matches_the_reference(library, dtype, feature, d, model_dtype):
    """Chunked prefill and long-context decode steps (one session) within 1e-5 of the
    reference for float32 models (the product's parity tolerance for float16); padding tokens
    and queries that see nothing are zeros."""
    f = FEATURES[feature]
    spec = cache_spec(dtype, d, model_dtype, f.block_size)
    attrs = attention_attrs(spec, f)
    sess = None
    for seed, (seqs, pad_tokens) in enumerate((PREFILL, DECODE)):
        inputs, ref, zero_rows = attention_case(spec, f, seqs, pad_tokens, seed)
        if sess is None:
            sess = native_session(library, PAGED_ATTENTION, attrs, inputs, [(model_dtype, 3)])
        (got,) = sess.run(None, feed(inputs))
        tol = ATTENTION_ATOL if model_dtype == "float32" else tolerance(model_dtype)
        rtol = 0 if model_dtype == "float32" else tol
        np.testing.assert_allclose(got.astype(np.float32), ref.float().numpy(), atol=tol,
                                   rtol=rtol, err_msg=f"seqs {seqs}")  # fmt: skip
        assert not got[zero_rows].any()


@pytest.mark.parametrize("dtype", ["fp8", "fp8_per_token_head"])
def test_every_e4m3_byte_decodes_exactly_as_the_reference(library, dtype):
    """Four one-token sequences whose values hold all 256 e4m3 bytes (subnormals, both zeros,
    the largest, NaN at 0x7f/0xff) and whose keys are zero: each output row is its value's
    decoding times its scale, bit for bit the reference's (NaN where the byte is NaN)."""
    spec = cache_spec(dtype, d=64, block_size=4, kv_heads=1)
    g = torch.Generator().manual_seed(0)
    cache = random_cache(spec, 5, g)
    roles = [t.role for t in spec.tensors]
    cache[roles.index("k")].zero_()
    cache[roles.index("v")][1:, 0, 0] = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    step = [torch.arange(1, 5, dtype=torch.int32).reshape(4, 1), torch.ones(4, dtype=torch.int32),
            torch.arange(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)]  # fmt: skip
    q = torch.randn((4, 1, 64), generator=g)
    ref = reference.paged_attention(spec.codec, q, cache, *step, scale=spec.head_size**-0.5)
    attrs = attention_attrs(spec, Features(groups=1))
    sess = native_session(library, PAGED_ATTENTION, attrs, [q, *cache, *step], [("float32", 3)])
    (got,) = sess.run(None, feed([q, *cache, *step]))
    assert np.isnan(got).sum() == 2
    np.testing.assert_array_equal(got, ref.numpy())


#: decode items over every kv head: a sequence of one token, windows, sinks and recent windows
#: that cross the kernel's splits (1030 keys: 3 splits of 344)
DECODE_ALL_HEADS = ([Seq(1, 1), Seq(1030, 1), Seq(513, 1), Seq(0, 1, start=0)], 1)


@pytest.mark.parametrize("dtype", ["auto", "fp8", "turboquant_4bit_nc", "tqx_k4v2_mse"])
@pytest.mark.parametrize("feature", ["window", "recent-sinks", "everything"])
def test_decode_items_over_every_kv_head_match_the_reference(library, dtype, feature):
    """Four kv heads of two query heads each (a decode item's rows span every kv head) within
    1e-5 of the reference at 1 and 2 threads."""
    f = replace(FEATURES[feature], groups=2, block_size=16)
    spec = cache_spec(dtype, 64, "float32", f.block_size, kv_heads=4)
    inputs, ref, zero_rows = attention_case(spec, f, *DECODE_ALL_HEADS, seed=9)
    for threads in (1, 2):
        sess = native_session(library, PAGED_ATTENTION, attention_attrs(spec, f), inputs,
                              [("float32", 3)], threads)  # fmt: skip
        (got,) = sess.run(None, feed(inputs))
        np.testing.assert_allclose(got, ref.numpy(), atol=ATTENTION_ATOL, rtol=0)
        assert len(zero_rows) == 2 and not got[zero_rows].any()


# -- bad input ----------------------------------------------------------------------------------
def _set(x: torch.Tensor, index, value) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


def write_inputs(dtype="int4_per_token_head"):
    spec = cache_spec(dtype)
    cache, k, v, slots = write_case(spec, seed=5)
    names = [f"cache {t.role}" for t in spec.tensors] + ["k", "v", "slot_mapping"]
    return spec, dict(zip(names, [*cache, k, v, slots]))


def attention_inputs(recent=False):
    """A valid step of an fp8 layer (8 blocks of 4, 2 kv heads, 4 heads): 2 sequences, keys
    and values below 8 in magnitude."""
    spec = cache_spec("fp8")
    g = torch.Generator().manual_seed(6)
    cache = [torch.randint(0, 64, s, generator=g, dtype=torch.uint8) for s in
             spec.tensor_shapes(8).values()]  # fmt: skip
    x = {
        "q": torch.randn(4, 4, 64, generator=g),
        **{f"cache {t.role}": c for t, c in zip(spec.tensors, cache)},
        "block_tables": torch.tensor([[1, 2, 3], [5, 6, 0]], dtype=torch.int32),
        "seq_lens": torch.tensor([9, 6], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32),
        "positions": torch.tensor([6, 7, 8, 5], dtype=torch.int64),
    }
    if recent:
        x["recent k"] = torch.randn(6, 4, 2, 64, generator=g)
        x["recent v"] = torch.randn(6, 4, 2, 64, generator=g)
        x["recent_block_tables"] = torch.tensor([[0, 2, 3], [4, 1, 0]], dtype=torch.int32)
    f = Features(groups=2, recent_window=5 if recent else 0)
    return attention_attrs(spec, f), x


def run_bad(library, op, attrs, inputs: dict, outs) -> str:
    values = list(inputs.values())
    sess = native_session(library, op, attrs, values, outs, quiet=True)
    with pytest.raises(InvalidArgument) as e:
        sess.run(None, feed(values))
    return str(e.value)


BAD_WRITES = {
    "slot past the cache": (
        "slot_mapping", lambda x: _set(x, 4, 40),
        "slot_mapping[4] = 40 is outside the cache (10 blocks of 4)",
    ),
    "k tokens": (
        "k", lambda x: x[:-1],
        "k has shape [22, 2, 64], expected [23, 2, 64] (-1: any)",
    ),
    "v tokens": (
        "v", lambda x: torch.cat([x, x[:1]]),
        "v has shape [24, 2, 64], expected [23, 2, 64] (-1: any)",
    ),
    "k dtype": (
        "k", lambda x: x.half(),
        "k has element type float16, expected float32",
    ),
    "cache head size": (
        "cache k", lambda x: x[..., :16],
        "cache k has shape [10, 4, 2, 16], expected [-1, 4, 2, 32] (-1: any)",
    ),
    "cache block counts": (
        "cache v_zero", lambda x: x[:9],
        "cache v_zero has shape [9, 4, 2], expected [10, 4, 2] (-1: any)",
    ),
    "cache kv heads": (
        "cache k_scale", lambda x: x[:, :, :1],
        "cache k_scale has shape [10, 4, 1], expected [10, 4, 2] (-1: any)",
    ),
    "slot_mapping dtype": (
        "slot_mapping", lambda x: x.int(),
        "slot_mapping has element type int32, expected int64",
    ),
    "input count": (
        "slot_mapping", None,
        "expected 9 inputs (6 cache tensors, k, v, slot_mapping) for int4_per_token_head, got 8",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_WRITES)
def test_cache_write_answers_bad_input_with_an_error_naming_it(library, case):
    name, change, message = BAD_WRITES[case]
    spec, inputs = write_inputs()
    if change is None:
        del inputs[name]
    else:
        inputs[name] = change(inputs[name])
    attrs = {**cache_write_attrs(spec), "layer": 0}
    got = run_bad(library, CACHE_WRITE, attrs, inputs, cache_outputs(spec))
    assert got.endswith(f"tqexport CacheWrite (layer 0): {message}"), got


def test_cache_write_with_fewer_outputs_than_cache_tensors_is_an_error(library):
    spec, inputs = write_inputs()
    attrs = {**cache_write_attrs(spec), "layer": 0}
    got = run_bad(library, CACHE_WRITE, attrs, inputs, cache_outputs(spec)[:5])
    assert got.endswith(
        "tqexport CacheWrite (layer 0): expected 6 outputs (the cache tensors of "
        "int4_per_token_head), got 5"
    ), got


BAD_ATTENTION = {
    "block table entry negative": (
        False, "block_tables", lambda x: _set(x, (0, 1), -1),
        "block_tables[0][1] = -1 is outside the cache's 8 blocks",
    ),
    "block table entry past the cache": (
        False, "block_tables", lambda x: _set(x, (1, 2), 99),
        "block_tables[1][2] = 99 is outside the cache's 8 blocks",
    ),
    "block table entry equal to the block count": (
        False, "block_tables", lambda x: _set(x, (1, 0), 8),
        "block_tables[1][0] = 8 is outside the cache's 8 blocks",
    ),
    "recent block table entry past the recent cache": (
        True, "recent_block_tables", lambda x: _set(x, (1, 1), 6),
        "recent_block_tables[1][1] = 6 is outside the cache's 6 blocks",
    ),
    "recent block table entry negative": (
        True, "recent_block_tables", lambda x: _set(x, (0, 2), -3),
        "recent_block_tables[0][2] = -3 is outside the cache's 6 blocks",
    ),
    "seq_lens beyond the table": (
        False, "seq_lens", lambda x: _set(x, 1, 13),
        "seq_lens[1] = 13 is beyond its block table (3 blocks of 4)",
    ),
    "seq_lens negative": (
        False, "seq_lens", lambda x: _set(x, 0, -1),
        "seq_lens[0] = -1 is beyond its block table (3 blocks of 4)",
    ),
    "query_start_loc decreasing": (
        False, "query_start_loc", lambda x: torch.tensor([0, 3, 2], dtype=torch.int32),
        "query_start_loc[2] = 2 is not in [3, 4]",
    ),
    "query_start_loc past the tokens": (
        False, "query_start_loc", lambda x: torch.tensor([0, 3, 5], dtype=torch.int32),
        "query_start_loc[2] = 5 is not in [3, 4]",
    ),
    "query_start_loc negative": (
        False, "query_start_loc", lambda x: torch.tensor([-1, 3, 4], dtype=torch.int32),
        "query_start_loc[0] = -1 is not in [0, 4]",
    ),
    "query_start_loc length": (
        False, "query_start_loc", lambda x: x[:2],
        "query_start_loc has shape [2], expected [3] (-1: any)",
    ),
    "q heads": (
        False, "q", lambda x: x[:, :3],
        "q has shape [4, 3, 64], expected [-1, 4, 64] (-1: any)",
    ),
    "q dtype": (
        False, "q", lambda x: x.half(),
        "q has element type float16, expected float32",
    ),
    "cache head size": (
        False, "cache v", lambda x: x[..., :32],
        "cache v has shape [8, 4, 2, 32], expected [8, 4, 2, 64] (-1: any)",
    ),
    "recent cache head size": (
        True, "recent k", lambda x: x[..., :32],
        "recent cache k has shape [6, 4, 2, 32], expected [-1, 4, 2, 64] (-1: any)",
    ),
    "recent cache dtype": (
        True, "recent v", lambda x: x.half(),
        "recent cache v has element type float16, expected float32",
    ),
    "positions length": (
        False, "positions", lambda x: x[:3],
        "positions has shape [3], expected [4] (-1: any)",
    ),
    "positions negative": (
        False, "positions", lambda x: _set(x, 2, -(2**63)),
        "positions[2] = -9223372036854775808 is negative",
    ),
    "block_tables dtype": (
        False, "block_tables", lambda x: x.long(),
        "block_tables has element type int64, expected int32",
    ),
    "block_tables rows": (
        False, "block_tables", lambda x: x[:1],
        "block_tables has shape [1, 3], expected [2, -1] (-1: any)",
    ),
    "seq_lens dtype": (
        False, "seq_lens", lambda x: x.long(),
        "seq_lens has element type int64, expected int32",
    ),
    "input count": (
        False, "positions", None,
        "expected 7 inputs for fp8, got 6",
    ),
    "recent inputs missing": (
        True, "recent_block_tables", None,
        "expected 10 inputs for fp8 with a recent window, got 9",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_ATTENTION)
def test_paged_attention_answers_bad_input_with_an_error_naming_it(library, case):
    recent, name, change, message = BAD_ATTENTION[case]
    attrs, inputs = attention_inputs(recent)
    if change is None:
        del inputs[name]
    else:
        inputs[name] = change(inputs[name])
    got = run_bad(library, PAGED_ATTENTION, attrs, inputs, [("float32", 3)])
    assert got.endswith(f"tqexport PagedAttention (layer 0): {message}"), got


@pytest.mark.parametrize("window", [0, 4])
def test_paged_attention_at_the_largest_position_matches_the_reference(library, window):
    """A query at position 2^63 - 1 (no overflow in the kernel's window arithmetic) sees every
    key of its sequence, or with a window none."""
    attrs, x = attention_inputs()
    attrs["window"] = window
    x["positions"] = _set(x["positions"], 2, 2**63 - 1)
    values = list(x.values())
    sess = native_session(library, PAGED_ATTENTION, attrs, values, [("float32", 3)])
    (got,) = sess.run(None, feed(values))
    ref = reference.paged_attention(cache_spec("fp8").codec, values[0], values[1:3],
                                    *values[3:], scale=attrs["scale"],
                                    window=window or None)  # fmt: skip
    np.testing.assert_allclose(got, ref.numpy(), atol=ATTENTION_ATOL, rtol=0)
    assert bool(got[2].any()) == (window == 0)


@pytest.mark.parametrize("recent", [False, True])
def test_the_bad_attention_inputs_start_from_a_valid_step(library, recent):
    """Each case above breaks one thing of a step that runs."""
    attrs, inputs = attention_inputs(recent)
    values = list(inputs.values())
    sess = native_session(library, PAGED_ATTENTION, attrs, values, [("float32", 3)])
    (got,) = sess.run(None, feed(values))
    assert got.shape == (4, 4, 64) and np.isfinite(got).all() and got.any()


def test_the_bad_write_inputs_start_from_a_valid_step(library):
    spec, inputs = write_inputs()
    attrs = {**cache_write_attrs(spec), "layer": 0}
    values = list(inputs.values())
    sess = native_session(library, CACHE_WRITE, attrs, values, cache_outputs(spec))
    assert len(sess.run(None, feed(values))) == 6


# -- the sanitizers -----------------------------------------------------------------------------
def _runtime(name: str) -> str:
    out = subprocess.run(["g++", "-print-file-name=" + name], capture_output=True, text=True)
    path = out.stdout.strip()
    if not os.path.isabs(path):
        pytest.fail(f"g++ has no {name} (install the compiler's sanitizer runtime)")
    return path


@pytest.mark.skipif(SANITIZED, reason="already under the sanitizers")
def test_sanitizer_finds_nothing_in_the_native_kernel_tests(library):
    """The tests of this file (a subset of the matrices: every format once; every bad input)
    on the ASan + UBSan build, Python and torch unchanged (the runtimes preloaded): any
    invalid read or write, or undefined behaviour, aborts the run."""
    _native_library(True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        LD_PRELOAD=f"{_runtime('libasan.so')}:{_runtime('libubsan.so')}",
        ASAN_OPTIONS="detect_leaks=0",
        UBSAN_OPTIONS="print_stacktrace=1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(native_build.ROOT), env.get("PYTHONPATH")])),
        **{SANITIZE_ENV: "1"},
    )
    # -s: a sanitizer's report goes to stderr, which pytest would capture and lose in the abort
    cmd = [sys.executable, "-u", "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider",
           "-p", "no:xdist", "-k",
           "not sanitizer and not function_body and not narrower"]  # fmt: skip
    res = subprocess.run(cmd, cwd=native_build.ROOT, env=env, capture_output=True, text=True,
                         timeout=540)  # fmt: skip
    out = res.stdout + res.stderr
    # the sanitizer's first report where there is one (its stack can be long), else the end
    found = [i for i in (out.find("runtime error"), out.find("ERROR: AddressSanitizer")) if i >= 0]
    first = min(found) if found else max(0, len(out) - 6000)
    tail = out[max(0, first - 200) : first + 6000]
    assert res.returncode == 0, tail
    summary = re.search(r"(\d+) passed", res.stdout)
    assert summary and int(summary.group(1)) > 50 and "skipped" not in res.stdout, tail


def _attention_kernel(library: Path) -> str:
    fn = ctypes.CDLL(str(library)).tqx_attention_kernel
    fn.restype = ctypes.c_char_p
    return fn().decode()


def test_the_attention_kernel_runs_as_the_cpu_allows(library):
    """The kernel is the widest this CPU runs, no wider than TQEXPORT_NATIVE_ISA asks."""
    want = os.environ.get(ISA_ENV) or ("avx512" if _cpu_has("avx512") else "avx2")
    assert _attention_kernel(library) == (want if _cpu_has(want) else "base")


def _cpu_has(isa: str) -> bool:
    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    have = set(flags.group(1).split()) if flags else set()
    need = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
            "avx2": {"avx2", "fma"}, "base": set()}  # fmt: skip
    return need[isa] <= have


@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_the_narrower_attention_kernels_match_the_reference(library, isa):
    """The attention tests (every format with every feature at once, float32 and float16; GQA
    at head sizes past 64) with the kernel capped at ``isa``: the library picks its kernel
    once per process, so in a subprocess."""
    if isa != "base" and not _cpu_has(isa):
        pytest.skip(f"this CPU has no {isa}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(native_build.ROOT), env.get("PYTHONPATH")])),
        **{ISA_ENV: isa},
    )
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p",
           "no:xdist", "-k", "runs_as_the_cpu or every_e4m3_byte or (matches_the_reference and "
           "(everything or gqa-128 or gqa-256))"]  # fmt: skip
    res = subprocess.run(cmd, cwd=native_build.ROOT, env=env, capture_output=True, text=True,
                         timeout=540)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    summary = re.search(r"(\d+) passed", res.stdout)
    assert summary and int(summary.group(1)) > 30 and "skipped" not in res.stdout, res.stdout


def test_without_headers_the_native_tests_skip_saying_why(monkeypatch):
    monkeypatch.setattr(native_build, "find_ort_headers", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="headers not found: set ORT_INCLUDE_DIR"):
        _native_library(False)


# -- which kernels ORT runs ---------------------------------------------------------------------
def _profiled_ops(op, attrs, inputs, outs, library, prefix) -> set[str]:
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = str(prefix)
    sess = single_node_model(op, attrs, inputs, outs, bodies=True, library=library, options=opts)
    sess.run(None, feed(inputs))
    events = json.loads(Path(sess.end_profiling()).read_text())
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node"}


@pytest.mark.parametrize("op", [CACHE_WRITE, PAGED_ATTENTION])
def test_ort_runs_the_native_kernel_not_the_function_body(library, tmp_path, op):
    """With the library registered ORT runs the kernel even though the model carries the
    function body; without it, the body's standard ops run."""
    layer = layer_for("turboquant_4bit_nc")
    attrs = node_attrs(op, layer, num_heads=4)
    spec = layer.cache
    if op == CACHE_WRITE:
        cache, k, v, slots = write_case(spec, seed=7)
        inputs, outs = [*cache, k, v, slots], cache_outputs(spec)
        body_ops = {"ScatterND", "GatherElements"}
    else:
        inputs, _, _ = attention_case(spec, Features(groups=2), *PREFILL, seed=7)
        outs, body_ops = [("float32", 3)], {"MatMul", "Softmax", "Gather"}
    assert _profiled_ops(op, attrs, inputs, outs, library, tmp_path / "native") == {op}
    ops = _profiled_ops(op, attrs, inputs, outs, None, tmp_path / "bodies")
    assert op not in ops and body_ops <= ops, ops


#: nm's letters for code: a global or weak function
_CODE = set("TWi")


def _code_symbols(obj: Path) -> set[str]:
    out = subprocess.run(["nm", "--defined-only", "-C", str(obj)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return {
        name for _, kind, name in (ln.split(" ", 2) for ln in out.splitlines()) if kind in _CODE
    }


def test_no_code_is_shared_between_the_instruction_set_kernels(tmp_path):
    """The kernel's helpers live in its instruction set's namespace, so no tqexport function
    is defined in two of the per-ISA objects and no linker can hand AVX-512 code to the
    baseline path; what they still share (standard library templates) resolves to the
    baseline copy, linked first. Compiled as the sanitizer build (-O1: little is inlined, so
    every helper is a symbol), where a shared helper once ran AVX-512 code on an AVX2 CPU."""
    include = native_build.find_ort_headers()
    if include is None:
        pytest.skip("ONNX Runtime headers not found (set ORT_INCLUDE_DIR)")
    objects = native_build.compile_objects(tmp_path, include, sanitize=True)
    kernels = [o for o in objects if o.stem.startswith(f"{native_build.ATTENTION_SOURCE}_")]
    assert [o.stem.rpartition("_")[2] for o in kernels] == ["base", "avx2", "avx512"]
    assert objects.index(kernels[0]) < objects.index(kernels[1])  # the baseline links first
    symbols = [_code_symbols(o) for o in kernels]
    shared = set.union(*(a & b for i, a in enumerate(symbols) for b in symbols[i + 1 :]))
    assert sorted(s for s in shared if not s.startswith("std::")) == []
    assert all(any(s.startswith(f"tqx::{isa}::") for s in syms)
               for isa, syms in zip(("base", "avx2", "avx512"), symbols))  # fmt: skip


def one_node_session(library, op, names, types, body=None, outputs=("out",), **attrs):
    """One ``op`` node over inputs ``names`` of element ``types`` (names), ``outputs`` typed
    as the first: served by the library, or by its function ``body`` where given."""
    import onnx

    elem = [ONNX_TYPES[t] for t in types]
    node = onnx.helper.make_node(op, names, list(outputs), domain=DOMAIN, **attrs)
    if body is not None:
        node.overload = body.overload
    graph = onnx.helper.make_graph(
        [node], "g",
        [onnx.helper.make_tensor_value_info(n, e, None) for n, e in zip(names, elem, strict=True)],
        [onnx.helper.make_tensor_value_info(o, elem[0], None) for o in outputs],
    )  # fmt: skip
    model = onnx.helper.make_model(
        graph, functions=[body] if body is not None else [], ir_version=10,
        opset_imports=[onnx.helper.make_opsetid("", 21),
                       onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
    )  # fmt: skip
    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena = False
    opts.log_severity_level = 4
    if body is None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def block_offsets_session(library, block, types, body=False):
    """One AddBlockOffsets node: inputs x, y, offsets of element ``types``."""
    function = block_offsets_function(block, f"block_size_{block}") if body else None
    return one_node_session(library, ADD_BLOCK_OFFSETS, ["x", "y", "offsets"], types, function,
                            block_size=block)  # fmt: skip


@pytest.mark.parametrize("lead, n, blocks, block, dtype", [
    ((1, 1), 40, 4, 32, "float32"),  # one decode token
    ((1, 5), 3000, 18, 32, "float32"),  # columns past one 64-wide tile, odd count
    ((64,), 2100, 16, 32, "float32"),  # a prefill: work for two tasks
    ((2, 3), 96, 6, 16, "float16"),
])  # fmt: skip
def test_add_block_offsets_matches_its_body(library, lead, n, blocks, block, dtype):
    """y + (x's sums over blocks) @ offsets: the kernel equals float64 arithmetic and the
    node's own function body to float32 rounding (float16 models: to half rounding)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((*lead, blocks * block)).astype(dtype)
    y = rng.standard_normal((*lead, n)).astype(dtype)
    offsets = rng.standard_normal((blocks, n)).astype(np.float32)
    sums = x.astype(np.float64).reshape(*lead, blocks, block).sum(-1)
    want = y.astype(np.float64) + sums @ offsets.astype(np.float64)
    feed = {"x": x, "y": y, "offsets": offsets}
    types = [dtype, dtype, "float32"]
    (got,) = block_offsets_session(library, block, types).run(None, feed)
    (body,) = block_offsets_session(library, block, types, body=True).run(None, feed)
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
    tol = (1e-5 if dtype == "float32" else 4e-3) * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    np.testing.assert_allclose(got, body, rtol=0, atol=tol)


BAD_OFFSETS = {
    "x's K": (lambda f: {**f, "x": f["x"][..., :-1]},
              "x has shape [1, 3, 63], expected [..., 64] (offsets has 2 blocks of 32)"),
    "y's rows": (lambda f: {**f, "y": f["y"][:, :2]},
                 "y has shape [1, 2, 8], expected [1, 3, 8] (-1: any)"),
    "y's N": (lambda f: {**f, "y": f["y"][..., :7]},
              "y has shape [1, 3, 7], expected [1, 3, 8] (-1: any)"),
    "offsets' rank": (lambda f: {**f, "offsets": f["offsets"][None]},
                      "offsets has shape [1, 2, 8], expected [-1, -1] (-1: any)"),
    "x scalar": (lambda f: {**f, "x": np.array(1.0, np.float32)},
                 "x has shape [], expected [..., 64] (offsets has 2 blocks of 32)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_OFFSETS)
def test_add_block_offsets_answers_bad_input_with_an_error_naming_it(library, case):
    change, message = BAD_OFFSETS[case]
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((1, 3, 64)).astype(np.float32),
            "y": rng.standard_normal((1, 3, 8)).astype(np.float32),
            "offsets": rng.standard_normal((2, 8)).astype(np.float32)}  # fmt: skip
    sess = block_offsets_session(library, 32, ["float32"] * 3)
    with pytest.raises(InvalidArgument) as e:
        sess.run(None, change(feed))
    assert str(e.value).endswith(f"tqexport AddBlockOffsets: {message}"), str(e.value)


def test_add_block_offsets_refuses_a_block_size_that_is_not_positive(library):
    with pytest.raises(Exception, match="missing or bad block_size"):
        block_offsets_session(library, 0, ["float32"] * 3)


def rotate_half_session(library, types, body=False):
    """One RotateHalf node: inputs x, cos, sin of element ``types``."""
    function = rotate_half_function() if body else None
    return one_node_session(library, ROTATE_HALF, ["x", "cos", "sin"], types, function)


@pytest.mark.parametrize("x_shape, cos_shape, dtype", [
    ((1, 5, 3, 64), (1, 5, 1, 64), "float32"),  # with a batch axis: [B, T, H, D]
    ((1, 3, 5, 64), (1, 1, 5, 64), "float32"),  # heads first
    ((600, 4, 32), (600, 1, 32), "float32"),  # the export's [T, H, D], a prefill's worth
    ((2, 7, 16), (16,), "float32"),  # one row for every position
    ((1, 4, 2, 8), (1, 4, 1, 8), "float16"),
])  # fmt: skip
def test_rotate_half_equals_its_body(library, x_shape, cos_shape, dtype):
    """x * cos + rotate_half(x) * sin: float32 results are the unfused ops' bit for bit (each
    product rounded, then the sum), float16 ones to half rounding."""
    rng = np.random.default_rng(len(x_shape))
    angles = rng.uniform(0, 6.3, cos_shape)
    feed = {"x": rng.standard_normal(x_shape).astype(dtype),
            "cos": np.cos(angles).astype(dtype), "sin": np.sin(angles).astype(dtype)}  # fmt: skip
    (got,) = rotate_half_session(library, [dtype] * 3).run(None, feed)
    (body,) = rotate_half_session(library, [dtype] * 3, body=True).run(None, feed)
    h = x_shape[-1] // 2
    x = feed["x"].astype(np.float64)
    rotated = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    want = x * feed["cos"] + rotated * feed["sin"]
    assert got.dtype == np.dtype(dtype) and got.shape == x_shape
    if dtype == "float32":
        np.testing.assert_array_equal(got, body)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-3)
        np.testing.assert_allclose(got, body, rtol=0, atol=4e-3)


BAD_ROTATIONS = {
    "odd head size": ({"x": (1, 2, 7), "cos": (1, 2, 7), "sin": (1, 2, 7)},
                      "x has shape [1, 2, 7], expected [..., D] with D even"),
    "cos last axis": ({"x": (1, 2, 8), "cos": (1, 2, 4), "sin": (1, 2, 8)},
                      "cos (float32, shape [1, 2, 4]) does not broadcast to x (float32, shape "
                      "[1, 2, 8]): same type, same last axis"),
    "sin rows": ({"x": (1, 2, 8), "cos": (1, 2, 8), "sin": (1, 3, 8)},
                 "sin (float32, shape [1, 3, 8]) does not broadcast to x (float32, shape "
                 "[1, 2, 8]): same type, same last axis"),
    "cos of higher rank": ({"x": (2, 8), "cos": (1, 2, 8), "sin": (2, 8)},
                           "cos (float32, shape [1, 2, 8]) does not broadcast to x (float32, "
                           "shape [2, 8]): same type, same last axis"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_ROTATIONS)
def test_rotate_half_answers_bad_input_with_an_error_naming_it(library, case):
    shapes, message = BAD_ROTATIONS[case]
    feed = {n: np.ones(s, np.float32) for n, s in shapes.items()}
    with pytest.raises(InvalidArgument) as e:
        rotate_half_session(library, ["float32"] * 3).run(None, feed)
    assert str(e.value).endswith(f"tqexport RotateHalf: {message}"), str(e.value)


def test_rotate_half_refuses_cos_of_another_type(library):
    feed = {"x": np.ones((2, 8), np.float32), "cos": np.ones((2, 8), np.float16),
            "sin": np.ones((2, 8), np.float32)}  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"cos \(float16, shape \[2, 8\]\) does not"):
        rotate_half_session(library, ["float32", "float16", "float32"]).run(None, feed)


def test_block_offsets_and_rotate_half_take_no_rows(library):
    """No tokens: each kernel returns its empty output (nothing read, nothing written)."""
    feed = {"x": np.ones((1, 0, 64), np.float32), "y": np.ones((1, 0, 8), np.float32),
            "offsets": np.ones((2, 8), np.float32)}  # fmt: skip
    (out,) = block_offsets_session(library, 32, ["float32"] * 3).run(None, feed)
    assert out.shape == (1, 0, 8)
    feed = {"x": np.ones((0, 4, 8), np.float32), "cos": np.ones((0, 1, 8), np.float32),
            "sin": np.ones((0, 1, 8), np.float32)}  # fmt: skip
    (out,) = rotate_half_session(library, ["float32"] * 3).run(None, feed)
    assert out.shape == (0, 4, 8)


def add_rms_norm_session(library, types, body=False, **attrs):
    """One FusedAddRMSNorm node: inputs x, residual, weight of element ``types``; outputs out
    and sum (epsilon 1e-5 unless given)."""
    attrs.setdefault("epsilon", 1e-5)
    function = fused_add_rms_norm_function() if body else None
    return one_node_session(library, FUSED_ADD_RMS_NORM, ["x", "residual", "weight"], types,
                            function, outputs=("out", "sum"), **attrs)  # fmt: skip


@pytest.mark.parametrize("shape, dtype", [
    ((1, 5, 576), "float32"),  # HF's [B, T, D]
    ((1, 576), "float32"),  # one decode step's row
    ((300, 960), "float32"),  # a prefill's worth: rows over threads
    ((3, 7), "float32"),  # a width no vector divides
    ((2, 3, 64), "float16"),
])  # fmt: skip
def test_fused_add_rms_norm_equals_its_body(library, shape, dtype):
    """sum = x + residual, bit for bit the Add's; out = the RMS norm of sum times weight: the
    body's within float32 rounding of the mean's order (float16: normed in float32, the body in
    float16, so within half rounding)."""
    rng = np.random.default_rng(shape[-1])
    feed = {"x": rng.standard_normal(shape).astype(dtype),
            "residual": rng.standard_normal(shape).astype(dtype),
            "weight": rng.standard_normal(shape[-1]).astype(dtype)}  # fmt: skip
    got, total = add_rms_norm_session(library, [dtype] * 3).run(None, feed)
    body, body_total = add_rms_norm_session(library, [dtype] * 3, body=True).run(None, feed)
    s = feed["x"].astype(np.float64) + feed["residual"]
    want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * feed["weight"]
    assert got.dtype == total.dtype == np.dtype(dtype) and got.shape == total.shape == shape
    np.testing.assert_array_equal(total, body_total)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, body, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)
        np.testing.assert_allclose(got, body, rtol=0, atol=2e-2)


BAD_NORMS = {
    "residual shape": ({"x": (2, 8), "residual": (1, 8), "weight": (8,)},
                       "residual has shape [1, 8], expected [2, 8] (-1: any)"),
    "weight length": ({"x": (2, 8), "residual": (2, 8), "weight": (4,)},
                      "weight has shape [4], expected [8] (-1: any)"),
    "weight rank": ({"x": (2, 8), "residual": (2, 8), "weight": (1, 8)},
                    "weight has shape [1, 8], expected [8] (-1: any)"),
    "scalar x": ({"x": (), "residual": (), "weight": (1,)},
                 "x has shape [], expected [..., D] with D >= 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_NORMS)
def test_fused_add_rms_norm_answers_bad_input_with_an_error_naming_it(library, case):
    shapes, message = BAD_NORMS[case]
    feed = {n: np.ones(s, np.float32) for n, s in shapes.items()}
    with pytest.raises(InvalidArgument) as e:
        add_rms_norm_session(library, ["float32"] * 3).run(None, feed)
    assert str(e.value).endswith(f"tqexport FusedAddRMSNorm: {message}"), str(e.value)


def test_fused_add_rms_norm_refuses_a_residual_of_another_type(library):
    feed = {"x": np.ones((2, 8), np.float32), "residual": np.ones((2, 8), np.float16),
            "weight": np.ones(8, np.float32)}  # fmt: skip
    with pytest.raises(InvalidArgument, match="residual has element type float16, expected"):
        add_rms_norm_session(library, ["float32", "float16", "float32"]).run(None, feed)


def test_fused_add_rms_norm_refuses_a_missing_or_negative_epsilon(library):
    for attrs in ({"epsilon": -1.0}, {"epsilon": None}):
        with pytest.raises(Exception, match="missing or bad epsilon"):
            if attrs["epsilon"] is None:
                one_node_session(library, FUSED_ADD_RMS_NORM, ["x", "residual", "weight"],
                                 ["float32"] * 3, outputs=("out", "sum"))  # fmt: skip
            else:
                add_rms_norm_session(library, ["float32"] * 3, **attrs)


def test_fused_add_rms_norm_takes_no_rows(library):
    feed = {"x": np.ones((0, 8), np.float32), "residual": np.ones((0, 8), np.float32),
            "weight": np.ones(8, np.float32)}  # fmt: skip
    out, total = add_rms_norm_session(library, ["float32"] * 3).run(None, feed)
    assert out.shape == total.shape == (0, 8)


def silu_and_mul_session(library, dtype, body=False):
    """One SiluAndMul node: input x of element ``dtype``."""
    function = silu_and_mul_function() if body else None
    return one_node_session(library, SILU_AND_MUL, ["x"], [dtype], function)


@pytest.mark.parametrize("shape, dtype", [
    ((1, 5, 3072), "float32"),  # HF's [B, T, 2F]
    ((1, 1536), "float32"),  # one decode step's row
    ((200, 1024), "float32"),  # a prefill's worth: rows over threads
    ((3, 2), "float32"),  # one element of each half
    ((2, 3, 64), "float16"),
])  # fmt: skip
def test_silu_and_mul_is_silu_of_the_gate_half_times_the_up_half(library, shape, dtype):
    """out = silu(x[..., :F]) * x[..., F:]: float32 within a few roundings of the exact values
    over the whole range (exp's clamped ends included), float16 rounded once more; the body
    (ORT's Sigmoid) agrees to its own accuracy."""
    rng = np.random.default_rng(shape[-1])
    x = rng.normal(0, 6, shape).astype(dtype)
    x.reshape(-1)[:3] = [-120.0, 95.0, 0.0]
    (got,) = silu_and_mul_session(library, dtype).run(None, {"x": x})
    (body,) = silu_and_mul_session(library, dtype, body=True).run(None, {"x": x})
    f = shape[-1] // 2
    gate, up = x[..., :f].astype(np.float64), x[..., f:]
    exact = gate / (1 + np.exp(-gate)) * up
    assert got.dtype == np.dtype(dtype) and got.shape == (*shape[:-1], f)
    if dtype == "float32":
        np.testing.assert_allclose(got, exact, rtol=5e-7, atol=1e-35)
    else:
        np.testing.assert_allclose(got, exact, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(got, body, rtol=0.6, atol=0.05)


@pytest.mark.parametrize(("shape", "message"), [
    ((2, 7), "x has shape [2, 7], expected [..., 2F] (gate, up)"),
    ((), "x has shape [], expected [..., 2F] (gate, up)"),
])  # fmt: skip
def test_silu_and_mul_answers_bad_input_with_an_error_naming_it(library, shape, message):
    with pytest.raises(InvalidArgument) as e:
        silu_and_mul_session(library, "float32").run(None, {"x": np.ones(shape, np.float32)})
    assert str(e.value).endswith(f"tqexport SiluAndMul: {message}"), str(e.value)


def test_silu_and_mul_takes_no_rows(library):
    (out,) = silu_and_mul_session(library, "float32").run(None, {"x": np.ones((0, 8), np.float32)})
    assert out.shape == (0, 4)
