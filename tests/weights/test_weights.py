"""Stored weights: every GGUF block type decodes as gguf does, the graph ONNX Runtime runs
equals x times the dequantized matrix, the reference reads the artifact's own weights back,
and builds store what ``--weights`` asks (or refuse it in one line, before any work)."""

import json
import re
from collections import Counter

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gguf import quants
from helpers import main_inproc
from onnx import TensorProto, helper
from tiny_gguf import TYPES, random_blocks, write_tiny_gguf

from tqexport.contract.artifact import open_artifact
from tqexport.errors import TQExportError
from tqexport.ops.attributes import ADD_BLOCK_OFFSETS, DOMAIN
from tqexport.runtime.backends.ort import WEIGHTS_ACCURACY_ENTRY
from tqexport.spec.limits import SpecError
from tqexport.spec.weights import StoredTensor, WeightsSpec, weights_from_dict
from tqexport.weights import gguf_source
from tqexport.weights.blocks import GGUF_DECODERS, decode_gguf, quantize_rtn
from tqexport.weights.graph import INTERNAL, members, read_stored, store_weights, weight_bytes
from tqexport.weights.placeholders import GATHER, MATMUL, PLACEHOLDER_DOMAIN


def blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return random_blocks(type_name, rows, cols, np.random.default_rng(seed), scale=1.0)


@pytest.mark.parametrize("type_name", sorted(GGUF_DECODERS))
def test_every_block_type_decodes_as_gguf_does(type_name):
    raw = blocks(type_name, 6, 512)
    want = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(6, 512)
    w = decode_gguf(raw, type_name, 6, 512)
    bits = GGUF_DECODERS[type_name][2]
    assert (w.bits, w.source) == (bits, type_name)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert lo <= int(w.codes.min()) and int(w.codes.max()) <= hi
    np.testing.assert_allclose(w.dequantize(), want, rtol=0, atol=1e-6 * np.abs(want).max())


def _stand_in_model(k: int, n: int, readers: list[str]) -> onnx.ModelProto:
    """A graph whose outputs are stand-in nodes reading weight ``w`` (``MatMul`` of ``x [M,
    K]``, ``Gather`` of ``ids [M]``), as an export leaves them."""
    nodes, outputs = [], []
    for i, op in enumerate(readers):
        inp = "x" if op == MATMUL else "ids"
        width = n if op == MATMUL else k
        nodes.append(helper.make_node(op, [inp], [f"y{i}"], domain=PLACEHOLDER_DOMAIN, weight="w"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", width]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])] * (MATMUL in readers)
    inputs += [helper.make_tensor_value_info("ids", TensorProto.INT64, ["M"])] * (GATHER in readers)
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(PLACEHOLDER_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _run(model: onnx.ModelProto, feed: dict, level: int = 0) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.add_session_config_entry(WEIGHTS_ACCURACY_ENTRY, str(level))
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(
        None, {k: v for k, v in feed.items() if k in {i.name for i in sess.get_inputs()}}
    )


@pytest.mark.parametrize("type_name", sorted(GGUF_DECODERS))
def test_the_stored_matmul_equals_x_times_the_dequantized_matrix(type_name):
    """DequantizeLinear -> MatMul as ONNX Runtime fuses it (MatMulNBits, accuracy level 0:
    float32 inputs), a block offset added by one AddBlockOffsets node (the tqexport domain,
    its function body in the model: what ORT runs here): x @ W.T, float32 rounding apart;
    nothing of the stand-in domain is left."""
    n, k = 40, 512
    w = decode_gguf(blocks(type_name, n, k, seed=1), type_name, n, k)
    model = _stand_in_model(k, n, [MATMUL])
    (record,) = store_weights(model, {"w": lambda: w})
    assert record == StoredTensor("w", f"int{w.bits}", w.block, type_name)
    offsets = w.offset is not None
    ops = [("", "DequantizeLinear"), ("", "MatMul")] + [(DOMAIN, ADD_BLOCK_OFFSETS)] * offsets
    assert [(n.domain, n.op_type) for n in model.graph.node] == ops
    assert [o.domain for o in model.opset_import] == ["", DOMAIN][: 1 + offsets]
    assert len(model.functions) == offsets
    x = np.random.default_rng(2).standard_normal((3, k)).astype(np.float32)
    (y,) = _run(model, {"x": x})
    want = x.astype(np.float64) @ w.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_table_gathered_and_read_by_a_tied_head_is_stored_once():
    """An embedding table read by Gather and by an output head: one set of initializers (4-bit
    codes widened to 8 for Gather), the head through Transposes; offsets added to rows too."""
    n, k = 64, 256
    w = decode_gguf(blocks("Q4_1", n, k), "Q4_1", n, k)
    model = _stand_in_model(k, n, [GATHER, MATMUL])
    (record,) = store_weights(model, {"w": lambda: w})
    assert (record.precision, record.source) == ("int8", "Q4_1")
    assert sorted(t.name for t in model.graph.initializer if not t.name.startswith("tq")) == [
        "w.codes", "w.offset", "w.scale"]  # fmt: skip
    ids = np.array([3, 0, 63], np.int64)
    x = np.random.default_rng(3).standard_normal((3, k)).astype(np.float32)
    rows, y = _run(model, {"x": x, "ids": ids})
    np.testing.assert_allclose(rows, w.dequantize()[ids], rtol=0, atol=1e-6)
    want = x.astype(np.float64) @ w.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_ort_rtn_quantizer_keeps_each_value_within_one_step():
    """Symmetric round-to-nearest in blocks of 32 (ORT maps the block's largest magnitude to
    the code -2**(bits-1), so the other sign can clamp by up to one step)."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((16, 96)).astype(np.float32)
    for bits in (4, 8):
        q = quantize_rtn(weight, bits)
        assert (q.bits, q.block, q.source) == (bits, 32, f"rtn{bits}")
        step = np.abs(np.repeat(q.scale, 32, axis=1))
        err = np.abs(q.dequantize() - weight)
        assert np.all(err <= step + 1e-6) and float((err / step).mean()) < 0.3
    with pytest.raises(TQExportError, match="not whole blocks of 32"):
        quantize_rtn(weight[:, :40], 4)


def test_the_reference_reads_back_exactly_what_was_stored():
    n, k = 32, 256
    weights = {"a": decode_gguf(blocks("Q4_K", n, k), "Q4_K", n, k),
               "b": decode_gguf(blocks("Q6_K", n, k), "Q6_K", n, k)}  # fmt: skip
    nodes = [
        helper.make_node(MATMUL, ["x"], ["ya"], domain=PLACEHOLDER_DOMAIN, weight="a"),
        helper.make_node(GATHER, ["ids"], ["yb"], domain=PLACEHOLDER_DOMAIN, weight="b"),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    store_weights(model, {name: (lambda w=w: w) for name, w in weights.items()})
    back = read_stored(model)
    assert sorted(back) == ["a", "b"]
    for name, w in weights.items():
        np.testing.assert_array_equal(back[name], w.dequantize())
    sizes = weight_bytes(model)
    assert sizes["int4"] == n * k // 2 + 2 * 4 * n * (k // 32)  # codes, scales, offsets
    assert sizes["int8"] == n * k + 4 * n * (k // 16)


def _readers_model(readers: dict[str, tuple[str, int, int]],
                   shapes: bool = True) -> onnx.ModelProto:  # fmt: skip
    """A graph of MatMul stand-ins, one per weight: ``readers[weight] = (input, K, N)``
    (``shapes``: the inputs' shapes, hence ranks, are known)."""
    nodes, outputs, inputs = [], [], {}
    for name, (inp, k, n) in readers.items():
        nodes.append(helper.make_node(MATMUL, [inp], [f"y.{name}"], domain=PLACEHOLDER_DOMAIN,
                                      weight=name))  # fmt: skip
        outputs.append(helper.make_tensor_value_info(f"y.{name}", TensorProto.FLOAT, ["M", n]))
        inputs[inp] = helper.make_tensor_value_info(inp, TensorProto.FLOAT,
                                                    ["M", k] if shapes else None)  # fmt: skip
    graph = helper.make_graph(nodes, "g", list(inputs.values()), outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(PLACEHOLDER_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _optimized_ops(model: onnx.ModelProto, tmp_path) -> list[str]:
    """The op types of the graph ONNX Runtime runs (all optimizations, MatMulNBits fused)."""
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sorted(n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node)


#: a layer's matrices: q, k, v read ``x`` (with ``o``, an 8-bit one that reads it too); gate
#: and up read ``h``, down ``a``
_LAYER = {"q": ("x", 256, 64, "Q4_1"), "k": ("x", 256, 32, "Q4_1"), "v": ("x", 256, 32, "Q4_1"),
          "o": ("x", 256, 48, "Q8_0"), "gate": ("h", 256, 96, "Q4_K"),
          "up": ("h", 256, 96, "Q4_K"), "down": ("a", 96, 256, "Q4_0")}  # fmt: skip


@pytest.mark.parametrize("shapes", [True, False])
def test_matrices_reading_one_input_are_packed_into_one_product(tmp_path, shapes):
    """q, k, v (one input, one block form) are one DequantizeLinear -> MatMul over their codes
    concatenated along N, one AddBlockOffsets (their offsets) and one Split; gate and up
    likewise; a matrix of another form stays alone. Whether the inputs' ranks are known or not,
    each output equals x times its dequantized matrix (ORT running AddBlockOffsets' function
    body), the reference reads each matrix back exactly, one record per matrix, and ORT runs
    one MatMulNBits per product."""
    weights = {name: decode_gguf(blocks(t, n, k, seed=i), t, n, k)
               for i, (name, (_, k, n, t)) in enumerate(_LAYER.items())}  # fmt: skip
    model = _readers_model({name: (x, k, n) for name, (x, k, n, _) in _LAYER.items()}, shapes)
    records = store_weights(model, {name: (lambda w=w: w) for name, w in weights.items()})
    assert [(r.name, r.precision, r.block_size, r.source) for r in records] == [
        (name, f"int{weights[name].bits}", weights[name].block, t)
        for name, (_, _, _, t) in _LAYER.items()]  # fmt: skip
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops == {"DequantizeLinear": 4, "MatMul": 4, ADD_BLOCK_OFFSETS: 2, "Split": 2}, ops
    offsets = [n for n in model.graph.node if n.op_type == ADD_BLOCK_OFFSETS]
    assert [(n.input[2], n.overload) for n in offsets] == [
        ("q+k+v.offset", "block_size_32"), ("gate+up.offset", "block_size_32")]  # fmt: skip
    assert [(f.name, f.overload) for f in model.functions] == [(ADD_BLOCK_OFFSETS,
                                                                 "block_size_32")]  # fmt: skip
    names = {t.name for t in model.graph.initializer}
    assert {"q+k+v.codes", "q+k+v.offset", "q+k+v.widths", "gate+up.codes", "o.codes",
            "down.codes"} <= names  # fmt: skip
    rng = np.random.default_rng(5)
    feed = {x: rng.standard_normal((3, k)).astype(np.float32) for x, k, _, _ in _LAYER.values()}
    outs = _run(model, feed)
    for (name, (x, _, _, _)), y in zip(_LAYER.items(), outs, strict=True):
        want = feed[x].astype(np.float64) @ weights[name].dequantize().T.astype(np.float64)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    back = read_stored(model)
    assert sorted(back) == sorted(_LAYER)
    for name, w in weights.items():
        np.testing.assert_array_equal(back[name], w.dequantize())
    sizes = weight_bytes(model)
    assert sizes == {p: sum(w.storage_bytes() for w in weights.values() if w.bits == b)
                     for p, b in (("int4", 4), ("int8", 8))}  # fmt: skip
    ops = _optimized_ops(model, tmp_path)
    assert ops.count("MatMulNBits") == 4 and ops.count("Split") == 2, ops


def test_weights_section_round_trips_and_refuses_what_does_not_fit():
    tensors = (StoredTensor("a.weight", "int4", 32, "Q4_1"),
               StoredTensor("b.weight", "int4", 32, "Q4_1"),
               StoredTensor("e.weight", "int8", 32, "Q8_0"),
               StoredTensor("f.weight", "fp32", None, "Q3_K"))  # fmt: skip
    spec = WeightsSpec(tensors, 4)
    d = spec.to_dict()
    assert d["default"] == {"precision": "int4", "block_size": 32, "source": "Q4_1",
                            "tensors": ["a.weight", "b.weight"]}  # fmt: skip
    assert sorted(d["differs"]) == ["e.weight", "f.weight"]
    assert weights_from_dict(json.loads(json.dumps(d))) == spec
    bad = json.loads(json.dumps(d))
    bad["differs"]["g.weight"] = bad["differs"]["e.weight"] | {"precision": "int3"}
    with pytest.raises(SpecError, match="precision' must be one of int4, int8, fp16, fp32"):
        weights_from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["differs"]["f.weight"]["block_size"] = 32
    with pytest.raises(SpecError, match="a float tensor has no block_size"):
        weights_from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["differs"]["c.weight"] = {"precision": "int4", "block_size": 32, "source": "Q4_1"}
    with pytest.raises(SpecError, match="'default' is not the precision most tensors have"):
        weights_from_dict(bad)


def test_a_block_count_that_disagrees_with_the_shape_is_refused():
    class Tensor:  # a Q4_0 matrix of 2 rows whose bytes hold one 32-element block per row
        name, nbytes = "blk.0.attn_q.weight", 36

    with pytest.raises(
        TQExportError, match=r"holds 36 bytes, but Q4_0 blocks of that shape take 72"
    ):
        gguf_source._check_blocks(Tensor, "Q4_0", 2, 64)
    with pytest.raises(TQExportError, match="not whole"):
        gguf_source._check_blocks(Tensor, "Q4_0", 2, 40)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tqexport.models.builtins import builtin_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", builtin_gguf("smollm2"))


def test_a_gguf_with_every_block_type_builds_and_passes_parity(tiny_gguf, tmp_path, capsys):
    """A GGUF of every block type builds (Q3_K stored as float, with a warning), packs q and k,
    adds every product's offsets by one node, passes parity, and its weights floor adds the
    offsets too."""
    from tqexport.bench import weights_floor
    from tqexport.verify.parity import run_parity

    out = tmp_path / "art"
    code, _, err = main_inproc(capsys, "build", str(tiny_gguf), "-o", str(out))
    assert code == 0, err
    assert "warning: blk.1.ffn_gate.weight (Q3_K) is stored as float: Q3_K has no block " in err
    art = open_artifact(out)
    w = art.spec.weights
    assert art.spec.request.weights == "auto" and w.accuracy_level == 4
    by_name = {t.name: t for t in w.tensors}
    assert by_name["model.embed_tokens.weight"] == StoredTensor(
        "model.embed_tokens.weight", "int8", 32, "Q4_0"
    )  # gathered: 8-bit container
    assert by_name["model.layers.1.mlp.gate_proj.weight"].precision == "fp32"
    assert by_name["model.layers.0.mlp.down_proj.weight"] == StoredTensor(
        "model.layers.0.mlp.down_proj.weight", "int8", 16, "Q6_K")  # fmt: skip
    sources = {t.source for t in w.tensors}
    assert sources == set(TYPES.values())
    graph = onnx.load(str(art.model_file), load_external_data=False).graph
    floats = [t for t in graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) == 2
              and not t.name.endswith((".scale", ".offset"))
              and not t.name.startswith(INTERNAL)]  # fmt: skip
    assert [list(t.dims) for t in floats] == [[256, 256]]  # the Q3_K matrix alone
    packed = [members(t.name.removesuffix(".codes")) for t in graph.initializer
              if t.name.endswith(".codes") and len(members(t.name)) > 1]  # fmt: skip
    q_k = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"]
    assert packed == [q_k]  # Q4_K and Q4_1: 4 bits, blocks of 32, offsets
    offsets = sorted(t.name for t in graph.initializer if t.name.endswith(".offset"))
    added = sorted(n.input[2] for n in graph.node if n.op_type == ADD_BLOCK_OFFSETS)
    assert len(offsets) == 6 and added == offsets  # every product with offsets: one node each
    report = run_parity(art, steps=2, prompt_len=12, batch=2)
    assert report.ok and report.logits_judged
    # the peers run's weights floor adds each product's offsets as the artifact does
    floor = weights_floor.WeightsFloor(art, batch=2, threads=1)
    products = weights_floor.weight_products(graph_model := onnx.load(str(art.model_file)))
    assert sorted(p.offsets_initializer.name for p in products if p.offsets) == offsets
    floor_inits = {t.name for t in weights_floor.floor_model(art).graph.initializer}
    assert set(offsets) <= floor_inits
    dense = read_stored(graph_model)
    for p, y in zip(products, floor.step(), strict=True):
        if p.offsets is not None:
            name = p.initializers[0].name.removesuffix(".codes")
            ref = floor.feed[f"rows_{p.k}"] @ np.concatenate([dense[m] for m in members(name)]).T
            assert np.linalg.norm(y - ref) <= 0.02 * np.linalg.norm(ref), name


@pytest.mark.parametrize(("weights", "message"), [
    ("int4", "--weights int4: GGUF Q5_0 codes are wider than 4 bits"),
    ("int8", "--weights int8: GGUF block type Q3_K has no mapping in tqexport"),
])  # fmt: skip
def test_a_width_the_gguf_cannot_be_stored_at_is_refused_before_any_work(
    tiny_gguf, tmp_path, capsys, weights, message
):
    code, out, err = main_inproc(capsys, "build", str(tiny_gguf), "-o", str(tmp_path / "a"),
                                 "--weights", weights)  # fmt: skip
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("weights", "precisions"), [
    ("int4", {"int4", "int8"}), ("int8", {"int8"}), ("fp16", {"fp16"}),
])  # fmt: skip
def test_a_float_checkpoint_is_quantized_by_ort_and_its_reference_reads_it(
    artifacts, capsys, weights, precisions
):
    from tqexport.verify.parity import run_parity

    art = open_artifact(artifacts("tiny-llama", "auto", weights=weights))
    assert {t.precision for t in art.spec.weights.tensors} == precisions
    assert art.spec.request.weights == weights
    report = run_parity(art, steps=2, prompt_len=12, batch=2)
    assert report.ok and report.logits_judged
    code, out, _ = main_inproc(capsys, "inspect", str(art.path), "--json")
    sizes = json.loads(out)["weights"]["bytes"]
    assert set(sizes) == precisions | {"fp32"}


def test_smollm2_greedy_follows_the_reference_on_its_own_blocks(artifacts):
    """SmolLM2 ``--weights auto`` (its Q4_1 and Q8_0 blocks): at accuracy level 0 ONNX Runtime
    decides as the reference on the same dequantized weights wherever that is decisive; at
    the served level 4 (8-bit inputs) it generates as level 0 up to a split at a near tie of
    that level's noise, and after it follows the reference wherever that is decisive beyond it.
    (On a CPU with VNNI level 4 split at a gap of 0.08 where another CPU did not.)"""
    from helpers import (
        BLOCK_WEIGHTS_NEAR_TIE,
        assert_greedy,
        assert_same_generation,
        at_accuracy,
        teacher_forced,
    )
    from transformers import AutoTokenizer

    from tqexport.models.paged import PagedCausalLM
    from tqexport.runtime.backends.torch import load_source_model
    from tqexport.runtime.executor import Executor
    from tqexport.runtime.sequence import SamplingParams

    art = open_artifact(artifacts("smollm2", "auto"))
    assert art.spec.weights.default.source == "Q4_1"
    tok = AutoTokenizer.from_pretrained(art.path)
    ids = tok("The Python statement `with` is used to", add_special_tokens=False)["input_ids"]
    lm = load_source_model(art)
    module = PagedCausalLM(lm.model, art.spec, mode="functional")

    def greedy(level):
        out = Executor(at_accuracy(art, level), "ort", num_blocks=16).generate(
            [ids], SamplingParams(max_tokens=32, ignore_stop=True))[0].output  # fmt: skip
        with torch.no_grad():
            return out, teacher_forced(module, art.spec, ids, out)

    exact, exact_logits = greedy(0)
    assert assert_greedy(exact_logits, exact) >= 16  # of 32: the reference's own decisions
    served, served_logits = greedy(4)
    assert_same_generation(exact_logits, exact, served, BLOCK_WEIGHTS_NEAR_TIE)
    assert_greedy(served_logits, served, BLOCK_WEIGHTS_NEAR_TIE)


@pytest.mark.parametrize("source", ["gguf", "tiny-llama"])
def test_bench_quality_on_a_model_computes_with_the_weights_a_build_stores(
    tiny_gguf, artifacts, tmp_path, source
):
    """``bench quality MODEL --weights W`` scores the matrices ``build --weights W`` stores:
    every parameter equals what the artifact's reference reads back."""
    from tqexport.bench.quality import source_model
    from tqexport.export.artifact_build import build_artifact
    from tqexport.runtime.backends.torch import load_source_model
    from tqexport.spec import BuildRequest

    if source == "gguf":
        target, weights, label = str(tiny_gguf), "auto", "GGUF blocks"
        build_artifact(target, tmp_path / "a", BuildRequest(weights=weights))
        art = open_artifact(tmp_path / "a")
    else:
        target, weights, label = source, "int4", "int4 (RTN)"
        art = open_artifact(artifacts(source, "auto", weights=weights))
    lm, got_label = source_model(target, weights)
    assert got_label == label
    want = dict(load_source_model(art).model.named_parameters())
    got = dict(lm.model.named_parameters())
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    if source == "tiny-llama":
        assert source_model(art)[1] == "int4 (rtn4)"


def test_bench_speed_reuses_a_folder_only_for_the_same_build(tmp_path, monkeypatch):
    """The same request by the same tqexport version reuses the folder; another request or an
    artifact of another version is refused, not silently measured."""
    from tqexport.bench import speed
    from tqexport.bench.speed import artifact_for

    art = artifact_for("tiny-llama", "fp8", tmp_path, weights="fp16")
    assert art.path.name == "tiny-llama-fp8-fp16" and art.spec.request.weights == "fp16"
    assert artifact_for("tiny-llama", "fp8", tmp_path, weights="fp16").path == art.path
    (art.path.parent / "tiny-llama-fp8-int8").symlink_to(art.path)
    with pytest.raises(TQExportError, match="holds another build of tiny-llama than this run"):
        artifact_for("tiny-llama", "fp8", tmp_path, weights="int8")
    built_by = art.spec.tqexport_version
    monkeypatch.setattr(speed, "__version__", "9.9.9")
    refused = rf"built by tqexport {re.escape(built_by)}, not this 9\.9\.9"
    with pytest.raises(TQExportError, match=refused):
        artifact_for("tiny-llama", "fp8", tmp_path, weights="fp16")


def test_bench_quality_refuses_weights_for_an_artifact(artifacts, capsys):
    code, _, err = main_inproc(capsys, "bench", "quality", str(artifacts("tiny-llama", "auto")),
                               "--weights", "int4")  # fmt: skip
    assert code == 2
    assert err.startswith("error: --weights has no effect when TARGET is an artifact")


def test_the_weights_floor_multiplies_by_the_stored_blocks(artifacts):
    """The peers run's floor on a 4-bit artifact: each weight made as the model makes it
    (DequantizeLinear of the stored codes and scales), its bytes the packed ones, and each
    output the rows times the dequantized matrix (ONNX Runtime's level-4 noise aside)."""
    from tqexport.bench import weights_floor

    art = open_artifact(artifacts("tiny-llama", "auto", weights="int4"))
    floor = weights_floor.WeightsFloor(art, batch=2, threads=1)
    products = weights_floor.weight_products(onnx.load(str(art.model_file),
                                                       load_external_data=False))  # fmt: skip
    assert len(products) == 25  # 6 layers x (q+k+v, o, gate+up, down) + lm_head
    assert {tuple(n.op_type for n in p.nodes) for p in products} == {("DequantizeLinear",)}
    kinds = {tuple(t.data_type for t in p.initializers) for p in products}
    assert kinds == {(TensorProto.INT4, TensorProto.FLOAT)}
    want_bytes = sum(p.k * p.n // 2 + 4 * p.k * p.n // 32 for p in products)
    assert weights_floor.weights_bytes(weights_floor.floor_model(art)) == want_bytes
    dense = read_stored(onnx.load(str(art.model_file)))
    outs = floor.step()
    names = [p.initializers[0].name.removesuffix(".codes") for p in products]
    assert sum(len(members(n)) for n in names) == 43  # 6 layers x 7 projections + lm_head
    for name, p, y in zip(names, products, outs, strict=True):
        x = floor.feed[f"rows_{p.k}"]
        ref = x @ np.concatenate([dense[m] for m in members(name)]).T
        assert np.linalg.norm(y - ref) <= 0.02 * np.linalg.norm(ref), name


@pytest.mark.parametrize(("source", "weights"), [
    ("gguf", "auto"), ("tiny-llama", "int4"), ("tiny-llama", "int8"),
])  # fmt: skip
def test_plan_predicts_the_block_bytes_inspect_reads_from_the_build(
    tiny_gguf, artifacts, tmp_path, capsys, source, weights
):
    """``plan --weights`` (tensor index or shapes alone) says what the built artifact's blocks
    take, to the byte; its float bytes count every float parameter."""
    from tqexport.export.artifact_build import build_artifact
    from tqexport.spec import BuildRequest

    if source == "gguf":
        target = str(tiny_gguf)
        build_artifact(target, tmp_path / "a", BuildRequest(weights=weights))
        art = tmp_path / "a"
    else:
        target, art = source, artifacts(source, "auto", weights=weights)
    code, out, err = main_inproc(capsys, "plan", target, "--weights", weights, "--json")
    assert code == 0, err
    if source == "gguf":  # a width it cannot be stored at: the build's own refusal
        code, _, refused = main_inproc(capsys, "plan", target, "--weights", "int8")
        assert code == 2 and refused.startswith("error: --weights int8: GGUF block type Q3_K")
    planned = json.loads(out)["weights_bytes"]
    code, out, _ = main_inproc(capsys, "inspect", str(art), "--json")
    built = json.loads(out)["weights"]["bytes"]
    blocks = {p: n for p, n in built.items() if p.startswith("int")}
    assert {p: n for p, n in planned.items() if p.startswith("int")} == blocks
    assert planned["fp32"] > 0  # norms and biases (an exporter shares equal ones: not exact)
    code, out, _ = main_inproc(capsys, "plan", target, "--weights", weights)
    assert f"weights (--weights {weights}): " in out


def test_build_refuses_a_disk_short_of_the_planned_weights_and_writes_nothing(
    tiny_gguf, tmp_path, monkeypatch
):
    """The free-space check asks for the plan's exact weight bytes (and 64 MiB for the rest):
    one byte short is refused before the export, naming what it needs."""
    import shutil

    from tqexport.export import outdir
    from tqexport.export.artifact_build import build_artifact
    from tqexport.export.source import BuildSource
    from tqexport.spec import BuildRequest

    request = BuildRequest(weights="auto")
    need = sum(BuildSource(str(tiny_gguf), request).planned_weight_bytes().values()) + (64 << 20)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: usage._replace(free=need - 1))
    with pytest.raises(TQExportError, match=f"needs about {need / 2**20:.0f} MiB;"):
        build_artifact(str(tiny_gguf), tmp_path / "a", request)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(outdir.shutil, "disk_usage", lambda p: usage._replace(free=need))
    build_artifact(str(tiny_gguf), tmp_path / "a", request)
    assert (tmp_path / "a" / "tqexport.json").is_file()
