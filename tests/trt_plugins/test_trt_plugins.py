"""TensorRT plugins without TensorRT: plugin contract (names, attributes, argument order, grids,
int32 scalars, aliasing), sm_90 PTX of every variant checked against the launch, the TRT-order
kernels in Triton's interpreter, the engine build's graph rewrite, profile and error paths."""

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tqexport.errors import TQExportError
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import make_codec
from tqexport.ops.attributes import CACHE_WRITE, PAGED_ATTENTION, node_attrs
from trt_plugins import contract
from trt_plugins.ptx import (
    HIDDEN_PARAMS,
    ContractError,
    check_contract,
    compile_plan,
    entry_params,
    params_read,
)

NAMES = ["auto", "fp8", "fp8_e5m2", "turboquant_4bit_nc", "turboquant_k3v4_nc",
         "turboquant_3bit_nc", "turboquant_k8v4", "tqx_k4v4_g32", "tqx_k4v3_g32",
         "tqx_k4v3_mse", "tqx_k4v2_mse", "tqx_k3v2_mse"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]
#: the TurboQuant formats, also run at Gemma 3's head size 256 (one kv head, four query heads)
TURBOQUANT = [n for n in NAMES if n.startswith(("turboquant", "tqx"))]


def attrs(name, d=64, kvh=2, heads=4, dtype="float32", **kw):
    """Node attributes as the exporter writes them (minus the routing namespace)."""
    base = dict(kv_cache_dtype=name, quant_mode="m", model_dtype=dtype, num_kv_heads=kvh,
                head_size=d, block_size=4, k_scale=0.5, v_scale=2.0, num_heads=heads,
                scale=d**-0.5, softcap=0.0, window=0, variant="v", layer=3)  # fmt: skip
    return {**base, **kw}


def plans(name, **kw):
    a = attrs(name, **kw)
    return (contract.launch_plan(contract.plugin_for(CACHE_WRITE, a), a),
            contract.launch_plan(contract.plugin_for(PAGED_ATTENTION, a), a))  # fmt: skip


@pytest.mark.parametrize("recent,sink", [(0, 0), (8, 0), (8, 2)])
def test_declared_attributes_are_exactly_what_the_nodes_carry(recent, sink):
    from tqexport.kvplan.resolve import resolve
    from tqexport.models.config import describe_model
    from tqexport.spec import BuildRequest

    spec = resolve(
        describe_model("tiny-llama"),
        BuildRequest(
            "turboquant_4bit_nc", ["0"], boundary=False, recent_window=recent, sink_tokens=sink
        ),
    ).spec
    layer = spec.layers[1]
    nodes = [(CACHE_WRITE, False), (PAGED_ATTENTION, False)] + [(CACHE_WRITE, True)] * bool(recent)
    for op, into_recent in nodes:
        carried = node_attrs(op, layer, 4, binding=int(into_recent))
        assert carried.pop("plugin_namespace") == contract.NAMESPACE == "tqexport"
        declared = contract.attrs_of(contract.plugin_for(op, carried))
        assert list(declared) == sorted(declared, key=list(carried).index)
        assert {k: type(v) for k, v in carried.items()} == declared
    assert contract.plugin_for(PAGED_ATTENTION, node_attrs(PAGED_ATTENTION, layer, 4)) == (
        "PagedAttentionSlot" + ("RecentSink" if sink else "Recent" if recent else "")
    )
    if recent:  # the write into the recent cache is a plain model-dtype write
        assert contract.plugin_for(CACHE_WRITE, node_attrs(CACHE_WRITE, layer, 4, True)) == (
            "CacheWriteKV")  # fmt: skip


def test_one_plugin_per_op_cache_arity_and_recent_window():
    assert contract.PLUGINS == {
        "CacheWriteSlot": ("CacheWrite", 1, ""), "CacheWriteKV": ("CacheWrite", 2, ""),
        "PagedAttentionSlot": ("PagedAttention", 1, ""),
        "PagedAttentionKV": ("PagedAttention", 2, ""),
        "PagedAttentionSlotRecent": ("PagedAttention", 1, "Recent"),
        "PagedAttentionSlotRecentSink": ("PagedAttention", 1, "RecentSink"),
        "PagedAttentionKVRecent": ("PagedAttention", 2, "Recent"),
        "PagedAttentionKVRecentSink": ("PagedAttention", 2, "RecentSink"),
    }  # fmt: skip
    assert [contract.num_cache_tensors(attrs(n)) for n in NAMES] == [2, 2, 2] + [1] * 9
    assert list(contract.attrs_of("PagedAttentionKVRecent"))[-3:] == [
        "recent_window", "variant", "layer"]  # fmt: skip
    assert list(contract.attrs_of("PagedAttentionKVRecentSink"))[-4:] == [
        "recent_window", "sink_tokens", "variant", "layer"]  # fmt: skip


def test_argument_order_is_inputs_then_int32_scalars_then_outputs():
    w1, a1 = plans("turboquant_3bit_nc")
    w2, a2 = plans("fp8")
    assert w1.arg_names == ("cache_in_ptr", "k_ptr", "v_ptr", "slot_ptr", "cache_ptr")
    assert (w1.inputs, w1.scalars, w1.outputs) == (
        ("cache", "k", "v", "slot_mapping"), (), ("cache_out",))  # fmt: skip
    assert w2.arg_names == ("k_cache_in_ptr", "v_cache_in_ptr", "k_ptr", "v_ptr", "slot_ptr",
                            "k_cache_ptr", "v_cache_ptr")  # fmt: skip
    assert a1.arg_names == ("q_ptr", "cache_ptr", "block_tables_ptr", "seq_lens_ptr", "qsl_ptr",
                            "pos_ptr", "num_seqs", "max_blocks", "out_ptr")  # fmt: skip
    assert a2.arg_names[:3] == ("q_ptr", "k_cache_ptr", "v_cache_ptr")
    assert a2.scalars == ("num_seqs", "max_blocks") and a2.outputs == ("out",)
    assert (w1.aliases, w2.aliases, a2.aliases) == ({0: 0}, {0: 0, 1: 1}, {})
    assert a1.signature["num_seqs"] == a1.signature["max_blocks"] == "i32"
    _, r1 = plans("turboquant_3bit_nc", recent_window=16)
    _, r2 = plans("fp8", recent_window=16, dtype="float16")
    assert r1.arg_names == ("q_ptr", "cache_ptr", "block_tables_ptr", "seq_lens_ptr", "qsl_ptr",
                            "pos_ptr", "recent_k_ptr", "recent_v_ptr", "recent_tables_ptr",
                            "num_seqs", "max_blocks", "max_recent_blocks", "out_ptr")  # fmt: skip
    assert r2.inputs[-3:] == ("recent_k_cache", "recent_v_cache", "recent_block_tables")
    assert r2.scalars == ("num_seqs", "max_blocks", "max_recent_blocks")
    assert r2.signature["recent_k_ptr"] == "*fp16" and r2.constexprs["RECENT_WINDOW"] == 16
    # without a window the recent parameters are constexpr None: absent from the launch
    assert a1.constexprs["recent_k_ptr"] is None and a1.constexprs["RECENT_WINDOW"] == 0


def test_grid_scalars_and_output_shapes_from_input_shapes():
    w, a = plans("fp8", kvh=2, heads=6)
    k = (13, 2, 64)
    cache = (9, 4, 2, 64)
    assert w.grid([cache, cache, k, k, (13,)]) == (26, 1, 1)
    assert contract.output_shapes(w.plugin, [cache, cache, k, k, (13,)]) == [cache, cache]
    shapes = [(5, 6, 64), cache, cache, (3, 7), (3,), (4,), (5,)]
    assert a.grid(shapes) == (5, 2, 1)
    assert a.scalar_values(shapes) == (3, 7)
    assert contract.output_shapes(a.plugin, shapes) == [(5, 6, 64)]
    _, r = plans("fp8", kvh=2, heads=6, recent_window=8)
    recent = (6, 4, 2, 64)
    shapes += [recent, recent, (3, 4)]
    assert (r.grid(shapes), r.scalar_values(shapes)) == ((5, 2, 1), (3, 7, 4))
    assert contract.output_shapes(r.plugin, shapes) == [(5, 6, 64)]


class Sym:
    """Stands in for TensorRT's symbolic shape expressions: records the arithmetic."""

    def __init__(self, e):
        self.e = e

    def __mul__(self, other):
        return Sym(f"({self.e}*{other})")


def test_launch_arithmetic_is_symbolic_friendly():
    w, a = plans("turboquant_4bit_nc", kvh=8, heads=32)
    x = [Sym(f"in{i}") for i in range(7)]
    grid = w.grid([[x[0]], [x[1], x[2]], [x[3]], [x[4]]])
    assert grid[0].e == "(in1*8)" and grid[1:] == (1, 1)
    shapes = [[x[0]], [x[1]], [x[2], x[3]], [x[4]], [x[5]], [x[6]]]
    assert a.grid(shapes)[0].e == "in0" and a.grid(shapes)[1:] == (8, 1)
    assert [s.e for s in a.scalar_values(shapes)] == ["in2", "in3"]


def test_constexprs_come_from_the_node_attributes():
    _, a = plans("fp8_e5m2", k_scale=0.37, scale=0.1, softcap=30.0, window=5)
    c = a.constexprs
    f32 = torch.tensor([0.37, 2.0, 0.1], dtype=torch.float32).tolist()
    assert (c["K_SCALE"], c["V_SCALE"], c["SM_SCALE"]) == tuple(f32)
    assert (c["SOFTCAP"], c["WINDOW"], c["E5M2"], c["MODE"]) == (30.0, 5, True, 1)
    w, a = plans("turboquant_k3v4_nc", d=128)
    assert a.constexprs["CENT"] == tuple(tq.centroids(128, 3).tolist())
    assert w.constexprs["TH"] == tuple(tq.thresholds(tq.centroids(128, 3)).tolist())
    assert w.constexprs["INV_SQRT"] == a.constexprs["INV_SQRT"] == tq.hadamard(128)[0, 0].item()
    assert len(a.constexprs["CENT"]) == 8 and a.constexprs["NC"] is True
    w, _ = plans("auto", dtype="bfloat16")
    assert w.signature["k_ptr"] == w.signature["k_cache_ptr"] == "*bf16"


@pytest.mark.parametrize("name", ["int8_per_token_head", "fp8_per_token_head", "nvfp4"])
def test_layers_without_a_kernel_are_refused_naming_the_dtype(name):
    with pytest.raises(contract.UnsupportedLayerError, match=f"layer 3: kv-cache dtype {name}"):
        contract.launch_plan("CacheWriteKV", attrs(name))


def test_wrong_arity_and_engine_check_refuse_in_one_line():
    with pytest.raises(TQExportError, match="use CacheWriteKV"):
        contract.launch_plan("CacheWriteSlot", attrs("fp8"))
    with pytest.raises(TQExportError, match="recent window 4.*use PagedAttentionKVRecent"):
        contract.launch_plan("PagedAttentionKV", attrs("fp8", recent_window=4))
    with pytest.raises(TQExportError, match="recent window 0.*use PagedAttentionSlot$"):
        contract.launch_plan("PagedAttentionSlotRecent", attrs("turboquant_4bit_nc"))
    from tqexport.export.tensorrt_engine import check_layers
    from tqexport.kvplan.resolve import resolve
    from tqexport.models.config import describe_model
    from tqexport.spec import BuildRequest

    spec = resolve(
        describe_model("tiny-llama", None), BuildRequest("int4_per_token_head", ["0"])
    ).spec
    with pytest.raises(TQExportError) as e:
        check_layers(spec)
    assert "layer 1: kv-cache dtype int4_per_token_head" in str(e.value)
    assert "\n" not in str(e.value)


def test_register_signature_is_inputs_then_attributes():
    class Desc:
        pass

    sig = contract.register_signature("CacheWriteKV", Desc)
    names = list(sig.parameters)
    assert names[:5] == ["k_cache", "v_cache", "k", "v", "slot_mapping"]
    assert names[5:] == list(contract.CACHE_WRITE_ATTRS)
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    assert sig.parameters["k"].annotation is Desc and sig.parameters["layer"].annotation is int
    assert sig.return_annotation == tuple[Desc, Desc]
    assert contract.register_signature("PagedAttentionSlot", Desc).return_annotation is Desc


@pytest.mark.parametrize("name", NAMES)
def test_every_variant_compiles_to_sm90_ptx_matching_the_launch(name):
    kw = dict(kvh=8, heads=32, dtype="float16", window=4, softcap=20.0)
    recent = [plans(name, d=128, recent_window=32, **kw)[1]]  # the recent-window attention
    if name in ("fp8", "turboquant_4bit_nc"):  # and with sink tokens, once per entry point
        recent.append(plans(name, d=128, recent_window=32, sink_tokens=4, **kw)[1])
    d256 = plans(name, d=256, **dict(kw, kvh=1, heads=4)) if name in TURBOQUANT else ()
    for plan in [*plans(name, d=64, **kw), *plans(name, d=128, **kw), *d256, *recent]:
        kernel = compile_plan(plan)
        assert ".target sm_90" in kernel.ptx and kernel.name == plan.kernel.__name__
        assert kernel.block_x == 128 and kernel.global_scratch_size == 0
        check_contract(plan, kernel)
        # the .entry: the plan's args, then exactly two trailing scratch pointers
        _, params = entry_params(kernel.ptx)
        assert HIDDEN_PARAMS == ("global_scratch", "profile_scratch")
        assert len(params) == len(plan.arg_names) + 2
        assert not params_read(kernel.ptx) & {n for _, n in params[-2:]}


def test_contract_check_catches_a_wrong_order():
    w, a = plans("turboquant_4bit_nc")
    kernel = compile_plan(a)
    with pytest.raises(ContractError, match="9 kernel args for 8 TensorRT args"):
        check_contract(dataclasses.replace(a, scalars=("num_seqs",)), kernel)
    with pytest.raises(ContractError, match="param 6"):
        check_contract(dataclasses.replace(a, scalars=(), inputs=a.inputs + ("x", "y")), kernel)


# The TRT-order kernels, launched as TensorRT would, in Triton's interpreter (set before import).
CHILD = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.ops import reference
from tqexport.ops.triton.cache_write import write_cache_
from trt_plugins import contract, emulate
results = {}
for case in sys.argv[2:]:  # NAME@HEAD_SIZE
    name, d = case.split("@")
    d, kvh, heads = int(d), 2, 6
    ks, vs = (0.5, 2.0) if name.startswith("fp8") else (1.0, 1.0)
    codec = make_codec(name, d, model_dtype="float32", k_scale=ks, v_scale=vs)
    a = dict(kv_cache_dtype=name, quant_mode="m", model_dtype="float32", num_kv_heads=kvh,
             head_size=d, block_size=4, k_scale=ks, v_scale=vs, num_heads=heads,
             scale=d**-0.5, softcap=20.0, window=3, variant="v", layer=0)
    n = len(codec.tensors)
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4, kvh) + ((t.width,) if t.width else ()) for t in codec.tensors]
    cache = [torch.zeros(s, dtype=torch_dtype(t.dtype)) for s, t in zip(shapes, codec.tensors)]
    k, v = torch.randn(13, kvh, d, generator=g) * 2, torch.randn(13, kvh, d, generator=g)
    slots = torch.tensor(list(range(4, 13)) + [20, 21, 22, -1])
    torch_entry = [c.clone() for c in cache]
    write_cache_(codec, torch_entry, k, v, slots)
    trt = [c.clone() for c in cache]
    emulate.launch(contract.launch_plan(contract.plugin_name("CacheWrite", n), a),
                   [*trt, k, v, slots])
    q = torch.randn(6, heads, d, generator=g)
    steps = (torch.tensor([[1, 2, 3], [5, 0, 0]], dtype=torch.int32),
             torch.tensor([9, 4], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32),
             torch.tensor([6, 7, 8, 3, 0, 0]))
    ref = reference.paged_attention(codec, q, trt, *steps, scale=d**-0.5, softcap=20.0, window=3)
    (got,) = emulate.launch(contract.launch_plan(contract.plugin_name("PagedAttention", n), a),
                            [q, *trt, *steps])
    # recent window 2 (inside the sliding window 3): its model-dtype cache written through the
    # CacheWriteKV plugin (as the recent CacheWrite node is), logical block 0 of seq 0 recycled
    plain = dict(a, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    recent = [torch.zeros(8, 4, kvh, d) for _ in range(2)]
    emulate.launch(contract.launch_plan(contract.plugin_for("CacheWrite", plain), plain),
                   [*recent, k, v, slots])
    rt = torch.tensor([[0, 2, 3], [5, 0, 0]], dtype=torch.int32)
    ra = dict(a, recent_window=2)
    rref = reference.paged_attention(codec, q, trt, *steps, scale=d**-0.5, softcap=20.0,
                                     window=3, recent_cache=recent, recent_block_tables=rt,
                                     recent_window=2)
    (rgot,) = emulate.launch(contract.launch_plan(contract.plugin_for("PagedAttention", ra), ra),
                             [q, *trt, *steps, *recent, rt])
    # 2 sink tokens with the recent window, full attention: seq 0 keeps its logical block 0
    sa = dict(a, window=0, recent_window=2, sink_tokens=2)
    st = torch.tensor([[1, 2, 3], [5, 0, 0]], dtype=torch.int32)
    skw = dict(scale=d**-0.5, softcap=20.0, recent_cache=recent, recent_block_tables=st,
               recent_window=2)
    sref = reference.paged_attention(codec, q, trt, *steps, **skw, sink_tokens=2)
    no_sink = reference.paged_attention(codec, q, trt, *steps, **skw)
    (sgot,) = emulate.launch(contract.launch_plan(contract.plugin_for("PagedAttention", sa), sa),
                             [q, *trt, *steps, *recent, st])
    results[case] = {"torch_entry": torch_entry, "trt": trt, "ref": ref, "got": got,
                     "recent_ref": rref, "recent_got": rgot, "sink_ref": sref,
                     "sink_got": sgot, "no_sink": no_sink}
torch.save(results, sys.argv[1])
"""


def test_trt_order_kernels_in_the_interpreter_match(tmp_path):
    out = tmp_path / "r.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cases = [f"{n}@64" for n in NAMES] + ["turboquant_4bit_nc@256", "tqx_k4v3_mse@256"]
    r = subprocess.run([sys.executable, "-c", CHILD, str(out), *cases], env=env,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = torch.load(out)
    assert sorted(res) == sorted(cases)
    for name in cases:
        x = res[name]
        # in-kernel tables (Hadamard signs, thresholds) give the very bytes of the table kernels
        assert all(torch.equal(a, b) for a, b in zip(x["trt"], x["torch_entry"])), name
        torch.testing.assert_close(x["got"], x["ref"], atol=1e-5, rtol=1e-3, msg=name)
        assert torch.equal(x["got"][4:], torch.zeros_like(x["got"][4:]))  # padding rows
        torch.testing.assert_close(x["recent_got"], x["recent_ref"], atol=1e-5, rtol=1e-3,
                                   msg=name)  # fmt: skip
        assert torch.equal(x["recent_got"][4:], torch.zeros_like(x["got"][4:]))
        if not name.startswith("auto@"):  # the window read model-dtype keys, not quantized ones
            assert (x["recent_ref"][:4] - x["ref"][:4]).abs().max() > 1e-4, name
        torch.testing.assert_close(x["sink_got"], x["sink_ref"], atol=1e-5, rtol=1e-3,
                                   msg=name)  # fmt: skip
        if not name.startswith("auto@"):  # the sink tokens, too
            assert (x["sink_ref"][:3] - x["no_sink"][:3]).abs().max() > 1e-4, name


def test_engine_graph_uses_the_plugins_and_profile(artifacts):
    import onnx

    from tqexport.contract.artifact import open_artifact
    from tqexport.export.tensorrt_engine import check_layers, profile_shapes, unfuse, use_plugins

    art = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc", ["0"]))
    model = onnx.load(str(art.model_file), load_external_data=False)
    assert sum(n.op_type == "RotateHalf" for n in model.graph.node) == 12  # 6 layers: q, k
    assert sum(n.op_type == "FusedAddRMSNorm" for n in model.graph.node) == 12  # 2 per layer
    model = unfuse(model)  # as their standard ops: no plugin implements them
    assert not any(n.op_type in ("RotateHalf", "FusedAddRMSNorm") for n in model.graph.node)
    assert use_plugins(model) == {"CacheWriteKV": 1, "PagedAttentionKV": 1,
                                  "CacheWriteSlot": 5, "PagedAttentionSlot": 5}  # fmt: skip
    assert not any(n.domain == "tqexport" and n.overload for n in model.graph.node)
    recent = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc", ["0"], recent_window=8))
    model = unfuse(onnx.load(str(recent.model_file), load_external_data=False))
    assert use_plugins(model) == {"CacheWriteKV": 6, "PagedAttentionKV": 1,
                                  "CacheWriteSlot": 5, "PagedAttentionSlotRecent": 5}  # fmt: skip
    check_layers(recent.spec)  # a recent window is no longer refused
    rshapes = profile_shapes(recent.spec, max_batch=8, max_tokens=256, max_blocks=100)
    assert set(rshapes) == set(recent.spec.input_names)
    assert rshapes["cache.1.recent_k"] == ((2, 16, 2, 64), (100, 16, 2, 64), (100, 16, 2, 64))
    shapes = profile_shapes(art.spec, max_batch=8, max_tokens=256, max_blocks=100)
    assert shapes["input_ids"] == ((1,), (8,), (256,))
    assert shapes["query_start_loc"] == ((2,), (9,), (9,))
    assert shapes["logits_indices"] == ((0,), (8,), (256,))
    assert shapes["block_tables_0"] == ((1, 1), (8, 99), (8, 99))
    la = art.spec.layers[1]
    role = la.cache.tensors[0].role
    lo, hi = la.cache.tensor_shapes(2)[role], la.cache.tensor_shapes(100)[role]
    assert lo == (2, 16, la.cache.num_kv_heads, 70)  # a TurboQuant 4-bit slot at D=64
    assert shapes[la.onnx_input(role)] == (lo, hi, hi)
    assert set(shapes) == set(art.spec.input_names)
    with pytest.raises(TQExportError, match="--max-batch"):
        profile_shapes(art.spec, 8, 4, 100)


def test_engine_without_tensorrt_is_one_line_exit_2(artifacts):
    path = artifacts("tiny-llama", "turboquant_4bit_nc", ["0"])
    code = ("import sys; sys.modules['tensorrt'] = None; from tqexport.cli import main; "
            f"sys.argv = ['tqexport', 'engine', {str(path)!r}]; main()")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'tensorrt>=10.9'" in lines[0], r.stderr
    assert not (path / "engine.plan").exists()


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_engine_refuses_block_weights_in_one_line_before_tensorrt(artifacts, capsys, weights):
    """Blocks are refused before TensorRT is looked for, naming the rebuild that works;
    float16 weights pass the check."""
    from helpers import main_inproc

    from tqexport.contract.artifact import open_artifact
    from tqexport.export.tensorrt_engine import check_weights

    path = artifacts("tiny-llama", "fp8", weights=weights)
    code, _, err = main_inproc(capsys, "engine", str(path))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: engine: this artifact stores 44 matrices in integer blocks (")
    assert err.rstrip().endswith("rebuild with --weights fp16 (or fp32)")
    assert not (path / "engine.plan").exists()
    check_weights(open_artifact(artifacts("tiny-llama", "fp8", weights="fp16")).spec)


def test_the_engine_graph_inlines_every_fusion(artifacts):
    """RotateHalf, FusedAddRMSNorm and SiluAndMul (a 4-bit build's packed SwiGLUs) all go back
    to their standard ops: no plugin implements them."""
    import collections

    import onnx

    from tqexport.export.tensorrt_engine import unfuse
    from tqexport.ops.attributes import FUSIONS

    path = artifacts("tiny-llama", "auto", weights="int4")
    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert [ops[op] for op in FUSIONS] == [12, 12, 6]  # 6 layers
    ops = collections.Counter(n.op_type for n in unfuse(model).graph.node)
    assert [ops[op] for op in FUSIONS] == [0, 0, 0] and ops["Sigmoid"] == 6


def test_trt_backend_needs_an_engine(artifacts):
    from tqexport.contract.artifact import open_artifact
    from tqexport.runtime.backends.trt import torch_dtype_of
    from tqexport.runtime.executor import Executor

    art = open_artifact(artifacts("tiny-llama", "turboquant_4bit_nc", ["0"]))
    with pytest.raises(TQExportError, match="no engine.plan; run `tqexport engine` first"):
        Executor(art, backend="trt", num_blocks=8)
    assert torch_dtype_of("DataType.HALF") is torch.float16
    assert torch_dtype_of("DataType.UINT8") is torch.uint8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_trt_order_kernels_match_reference(name):
    from tqexport.kvquant.codecs import torch_dtype
    from tqexport.ops import reference
    from trt_plugins import emulate

    codec = make_codec(name, 128, model_dtype="float32")
    w, a = plans(name, d=128, kvh=8, heads=32, k_scale=1.0, v_scale=1.0, block_size=16)
    cache = [torch.zeros((64, 16, 8) + ((t.width,) if t.width else ()), dtype=torch_dtype(t.dtype))
             for t in codec.tensors]  # fmt: skip
    k, v, slots = torch.randn(500, 8, 128), torch.randn(500, 8, 128), torch.arange(500) + 16
    ref_cache = reference.write_cache(codec, cache, k, v, slots)
    mine = emulate.launch(w, [c.cuda() for c in cache] + [k.cuda(), v.cuda(), slots.cuda()])
    for r, m in zip(ref_cache, mine):
        assert (r != m.cpu()).float().mean() < 1e-3
    steps = (torch.arange(1, 33, dtype=torch.int32).reshape(1, 32),
             torch.tensor([500], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
             torch.arange(496, 500))  # fmt: skip
    q = torch.randn(4, 32, 128)
    ref = reference.paged_attention(codec, q, ref_cache, *steps, scale=128**-0.5)
    (got,) = emulate.launch(a, [q.cuda(), *[c.cuda() for c in ref_cache],
                                *[s.cuda() for s in steps]])  # fmt: skip
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-3)
    # a recent window of 64: logical blocks before it recycled to the null block
    plain = make_codec("auto", 128, model_dtype="float32")
    recent = reference.write_cache(plain, [torch.zeros(64, 16, 8, 128) for _ in range(2)], k, v,
                                   slots)  # fmt: skip
    rt = steps[0] * (torch.arange(32) >= (496 - 63) // 16).to(torch.int32)
    _, r = plans(name, d=128, kvh=8, heads=32, k_scale=1.0, v_scale=1.0, block_size=16,
                 recent_window=64)  # fmt: skip
    ref = reference.paged_attention(
        codec,
        q,
        ref_cache,
        *steps,
        scale=128**-0.5,
        recent_cache=recent,
        recent_block_tables=rt,
        recent_window=64,
    )
    ins = [q, *ref_cache, *steps, *recent, rt]
    (got,) = emulate.launch(r, [x.cuda() for x in ins])
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-3)


class _FakePluginAPI:
    """Records what ``trt_plugins.plugins`` hands to ``tensorrt.plugin`` (test double only:
    it exercises our glue's argument binding, not TensorRT)."""

    class TensorDesc:
        def __init__(self, shape_expr=None):
            self.shape_expr = shape_expr

        def aliased(self):
            return ("aliased", self)

        def like(self):
            return ("like", self)

    class KernelLaunchParams:
        pass

    class SymIntExprs(tuple):
        @classmethod
        def from_tuple(cls, items):
            return cls(items)

        def __new__(cls, items=()):
            return super().__new__(cls, () if isinstance(items, int) else items)

    class SymInt32:
        def __init__(self, e):
            self.e = e

    def __init__(self):
        self.defs = {}

    def _decorator(self, kind):
        def make(op_id):
            def keep(fn):
                self.defs[(kind, op_id)] = fn
                return fn

            return keep

        return make

    def __getattr__(self, kind):
        if kind in ("register", "aot_impl", "impl"):
            return self._decorator(kind)
        raise AttributeError(kind)


@pytest.fixture
def fake_trt(monkeypatch):
    """``trt_plugins.plugins`` imported against :class:`_FakePluginAPI`, removed afterwards so
    no later test (or engine build) sees the fake-bound module."""
    import types

    import trt_plugins

    api = _FakePluginAPI()
    pkg = types.ModuleType("tensorrt")
    pkg.plugin = api
    monkeypatch.setitem(sys.modules, "tensorrt", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", api)
    saved = sys.modules.pop("trt_plugins.plugins", None)
    try:
        import trt_plugins.plugins as glue

        monkeypatch.setattr(glue, "_gpu_arch", lambda: 90)
        yield api
    finally:
        sys.modules.pop("trt_plugins.plugins", None)
        vars(trt_plugins).pop("plugins", None)
        if saved is not None:
            sys.modules["trt_plugins.plugins"] = trt_plugins.plugins = saved


def test_plugin_glue_binds_what_tensorrt_passes(fake_trt):
    api = fake_trt
    assert len(api.defs) == 24  # eight plugins x (register, aot_impl, impl)
    a = attrs("turboquant_4bit_nc", kvh=2, heads=4)
    names = list(contract.PAGED_ATTENTION_ATTRS)
    reg = api.defs[("register", "tqexport::PagedAttentionSlot")]
    aot = api.defs[("aot_impl", "tqexport::PagedAttentionSlot")]
    impl = api.defs[("impl", "tqexport::PagedAttentionSlot")]
    ins = ["q", "cache", "block_tables", "seq_lens", "query_start_loc", "positions"]
    # the schemas tensorrt.plugin validates: inputs, attributes, then outputs and tactic/stream
    assert list(inspect.signature(aot).parameters) == ins + names + ["outputs", "tactic"]
    assert list(inspect.signature(impl).parameters) == ins + names + ["outputs", "stream"]
    descs = [api.TensorDesc([Sym(f"{n}{j}") for j in range(3)]) for n in ins]
    vals = [a[n] for n in names]
    assert reg(*descs, **{n: a[n] for n in names}) == ("like", descs[0])  # TensorRT's call
    name, ptx, launch, extra = aot(*descs, *vals, (api.TensorDesc(),), 0)  # TensorRT's call
    assert name == "trt_paged_attention_tq_kernel" and ".entry " + name in ptx
    assert (launch.grid_x.e, launch.grid_y, launch.grid_z) == ("q0", 2, 1)
    assert launch.block_x == 128 and launch.shared_mem >= 0
    assert [x.e.e for x in extra] == ["block_tables0", "block_tables1"]
    reg = api.defs[("register", "tqexport::CacheWriteKV")]
    descs = [api.TensorDesc() for _ in range(5)]
    cw = attrs("fp8")
    outs = reg(*descs, **{n: cw[n] for n in contract.CACHE_WRITE_ATTRS})
    assert outs == (("aliased", descs[0]), ("aliased", descs[1]))
    with pytest.raises(contract.UnsupportedLayerError, match="nvfp4"):
        reg(*descs, **{n: attrs("nvfp4")[n] for n in contract.CACHE_WRITE_ATTRS})
    # a recent window: three more inputs, a third int32 scalar from the recent table's width
    ra = attrs("fp8", recent_window=8)
    ins = contract.inputs_of("PagedAttentionKVRecent")
    descs = [api.TensorDesc([Sym(f"{n}{j}") for j in range(3)]) for n in ins]
    aot = api.defs[("aot_impl", "tqexport::PagedAttentionKVRecent")]
    vals = [ra[n] for n in contract.PAGED_ATTENTION_RECENT_ATTRS]
    name, _, _, extra = aot(*descs, *vals, (api.TensorDesc(),), 0)
    assert name == "trt_paged_attention_kernel"
    assert [x.e.e for x in extra] == ["block_tables0", "block_tables1", "recent_block_tables1"]


def test_jit_impl_runs_the_torch_ops_on_what_tensorrt_passes(fake_trt):
    """The JIT ``impl``'s call of the torch ops (on CPU tensors here: the reference path)."""
    import trt_plugins.plugins as glue
    from tqexport.ops import reference

    codec = make_codec("turboquant_4bit_nc", 64, model_dtype="float32")
    plain = make_codec("auto", 64, model_dtype="float32")
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(12, 2, 64, generator=g), torch.randn(12, 2, 64, generator=g)
    slots = torch.arange(12) + 4
    cache, out = (
        [torch.zeros(5, 4, 2, 70, dtype=torch.uint8)],
        [torch.empty(5, 4, 2, 70, dtype=torch.uint8)],
    )
    glue._run_torch_op("CacheWriteSlot", attrs("turboquant_4bit_nc", k_scale=1.0, v_scale=1.0),
                       [*cache, k, v, slots], out)  # fmt: skip
    assert torch.equal(out[0], reference.write_cache(codec, cache, k, v, slots)[0])
    recent = reference.write_cache(plain, [torch.zeros(5, 4, 2, 64) for _ in range(2)], k, v, slots)
    steps = (torch.tensor([[1, 2, 3]], dtype=torch.int32), torch.tensor([12], dtype=torch.int32),
             torch.tensor([0, 2], dtype=torch.int32), torch.tensor([10, 11]))  # fmt: skip
    rt = torch.tensor([[0, 2, 3]], dtype=torch.int32)
    a = attrs("turboquant_4bit_nc", k_scale=1.0, v_scale=1.0, recent_window=3)
    q, got = torch.randn(2, 4, 64, generator=g), [torch.empty(2, 4, 64)]
    glue._run_torch_op("PagedAttentionSlotRecent", a, [q, *out, *steps, *recent, rt], got)
    want = reference.paged_attention(codec, q, out, *steps, scale=a["scale"], recent_cache=recent,
                                     recent_block_tables=rt, recent_window=3)  # fmt: skip
    assert torch.equal(got[0], want)
    plain_out = [torch.empty(2, 4, 64)]
    glue._run_torch_op("PagedAttentionSlot", a, [q, *out, *steps], plain_out)
    assert torch.equal(plain_out[0], reference.paged_attention(codec, q, out, *steps,
                                                               scale=a["scale"]))  # fmt: skip
