"""The exported graph's RMS norms take the form ONNX Runtime fuses into one node each."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tqexport.contract.artifact import open_artifact
from tqexport.export.fusable import divide_by_roots

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
