"""The exported graph's RMS norms take the form ONNX Runtime fuses into one node each; its
rotate-half rotaries become one RotateHalf node each, computing what they computed."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tqexport.contract.artifact import open_artifact
from tqexport.export.fusable import divide_by_roots, rotate_halves
from tqexport.ops.attributes import ROTATE_HALF

D = 16


def rms_norm_model() -> onnx.ModelProto:
    """``w * (x * Reciprocal(Sqrt(mean(x^2) + eps)))``, as torch exports an RMS norm."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "w")]  # fmt: skip
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"]),
        helper.make_node("Add", ["m", "eps"], ["a"]),
        helper.make_node("Sqrt", ["a"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["y"]),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, D]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def optimized_ops(model: onnx.ModelProto, tmp_path) -> collections.Counter:
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    opts.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return collections.Counter(
        n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node
    )


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_a_reciprocal_root_becomes_a_division_that_ort_fuses(tmp_path):
    model = rms_norm_model()
    x = np.random.default_rng(1).standard_normal((2, D)).astype(np.float32)
    before = run(model, x)
    assert optimized_ops(model, tmp_path)["SimplifiedLayerNormalization"] == 0
    assert divide_by_roots(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]
    assert list(model.graph.node[4].input) == ["x", "root"]
    np.testing.assert_allclose(run(model, x), before, rtol=1e-6, atol=1e-7)
    assert optimized_ops(model, tmp_path) == {"SimplifiedLayerNormalization": 1}


def test_a_reciprocal_read_by_anything_but_a_mul_stays():
    model = rms_norm_model()
    model.graph.node.append(helper.make_node("Neg", ["inv"], ["z"]))
    assert divide_by_roots(model) == 0
    assert "Reciprocal" in [n.op_type for n in model.graph.node]


def test_an_exported_model_has_no_reciprocal_of_a_root(artifacts):
    art = open_artifact(artifacts("tiny-llama", "auto"))
    ops = collections.Counter(n.op_type for n in onnx.load(str(art.model_file)).graph.node)
    assert ops["Reciprocal"] == 0 and ops["Div"] >= ops["ReduceMean"] > 0


T, H, HD = 3, 2, 8  # tokens, heads, head size of the rotary graphs


def rotary_model(transposed: bool = True, extra_reader: bool = False) -> onnx.ModelProto:
    """HF's rotary as torch exports it: ``v [1, T, H, D]`` transposed to ``[1, H, T, D]``,
    ``x * cos + concat(-x[..., h:], x[..., :h]) * sin`` with cos and sin ``[1, T, D]``
    unsqueezed at axis 1, then transposed back (``transposed``: else x is the graph input
    itself); ``extra_reader``: the Concat is read by another output too."""
    half = HD // 2
    ints = {"zero": [0], "half": [half], "big": [2**62], "last": [-1], "one": [1]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    x = "v"
    nodes = []
    if transposed:
        nodes.append(helper.make_node("Transpose", ["v"], ["x"], perm=[0, 2, 1, 3]))
        x = "x"
    nodes += [
        helper.make_node("Unsqueeze", ["cos", "one"], ["cos_u"]),
        helper.make_node("Unsqueeze", ["sin", "one"], ["sin_u"]),
        helper.make_node("Mul", [x, "cos_u"], ["a"]),
        helper.make_node("Slice", [x, "zero", "half", "last", "one"], ["x1"]),
        helper.make_node("Slice", [x, "half", "big", "last", "one"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["n"]),
        helper.make_node("Concat", ["n", "x1"], ["cat"], axis=-1),
        helper.make_node("Mul", ["cat", "sin_u"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
    ]
    inputs = [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, T, H, HD])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, T, HD])
               for n in ("cos", "sin")]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, None))
    infos = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, H, T, HD])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits, value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def rotary_feed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    angles = rng.uniform(0, 6.3, (1, T, HD)).astype(np.float32)
    return {"v": rng.standard_normal((1, T, H, HD)).astype(np.float32),
            "cos": np.cos(angles), "sin": np.sin(angles)}  # fmt: skip


def run_all(model: onnx.ModelProto, feed: dict, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            library=None) -> list[np.ndarray]:  # fmt: skip
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    if library is not None:
        opts.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def test_a_rotate_half_rotary_becomes_one_node_with_the_same_values():
    """One RotateHalf on the untransposed projection (cos and sin unsqueezed at its heads
    axis), then the same Transpose; the original Transpose and Unsqueezes are gone. Its
    function body gives the rotary's values bit for bit, optimized by ORT or not."""
    model = rotary_model()
    feed = rotary_feed()
    (before,) = run_all(model, feed)
    assert rotate_halves(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Unsqueeze", "Unsqueeze", ROTATE_HALF, "Transpose", "Transpose"]
    rotate = model.graph.node[2]
    assert list(rotate.input) == ["v", "cos.heads_axis", "sin.heads_axis"]
    assert [(f.name, f.overload) for f in model.functions] == [(ROTATE_HALF, "")]
    (after,) = run_all(model, feed)
    np.testing.assert_array_equal(after, before)
    (optimized,) = run_all(model, feed, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    np.testing.assert_array_equal(optimized, before)


def test_a_rotary_not_on_a_transposed_projection_or_read_elsewhere_stays():
    """Only the exact form is replaced: x not a Transpose of the projection (a norm between,
    as Gemma 3's q_norm puts it), or an inner value read by another node, keeps the graph."""
    for model in (rotary_model(transposed=False), rotary_model(extra_reader=True)):
        before = [n.op_type for n in model.graph.node]
        assert rotate_halves(model) == 0
        assert [n.op_type for n in model.graph.node] == before and not model.functions


def test_an_exported_model_rotates_every_query_and_key_in_one_node(artifacts):
    art = open_artifact(artifacts("tiny-llama", "auto"))
    ops = collections.Counter(n.op_type for n in onnx.load(str(art.model_file)).graph.node)
    assert ops[ROTATE_HALF] == 2 * len(art.spec.layers) and ops["Neg"] == 0
