"""The exported graph's RMS norms take the form ONNX Runtime fuses into one node each; its
rotate-half rotaries become one RotateHalf node each, computing what they computed; the
attention reads its rows without the export's batch axis of one and the nodes that took it;
each residual Add and the RMS norm of its sum become one FusedAddRMSNorm, each SwiGLU on a
packed gate and up product one SiluAndMul."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tqexport.contract.artifact import open_artifact
from tqexport.export.block_fusions import (
    fuse_add_rms_norms,
    fused_add_rms_norm_function,
    silu_and_mul_function,
    silu_and_muls,
)
from tqexport.export.fusable import (
    divide_by_roots,
    drop_batch_axis,
    rotate_half_function,
    rotate_halves,
)
from tqexport.native import build as native_build
from tqexport.ops.attributes import (
    DOMAIN,
    DOMAIN_VERSION,
    FUSED_ADD_RMS_NORM,
    ROTATE_HALF,
    SILU_AND_MUL,
)

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


def batch_axis_model(shared_view: bool = False) -> onnx.ModelProto:
    """The attention's inputs and output as the export leaves them after :func:`rotate_halves`:
    the projection p ``[1, T, H*D]`` reshaped to ``[1, T, H, D]`` (allowzero, as torch
    writes it), rotated (query) or not (value), transposed to heads first, row 0 gathered and
    transposed to ``[T, H, D]``; the output unsqueezed and reshaped back to ``[1, T, H*D]``
    (``shared_view``: the value's view is a graph output too, so it has to stay)."""
    ints = {"row": np.array(0, np.int64), "axis2": np.array([2], np.int64),
            "axis0": np.array([0], np.int64), "view": np.array([1, -1, H, HD], np.int64),
            "flat": np.array([1, -1, H * HD], np.int64)}  # fmt: skip
    inits = [numpy_helper.from_array(v, k) for k, v in ints.items()]
    make = helper.make_node
    nodes = [make("Unsqueeze", ["cos", "axis2"], ["cos4"]),
             make("Unsqueeze", ["sin", "axis2"], ["sin4"])]  # fmt: skip
    for name, rotated in (("q", True), ("v", False)):
        nodes.append(make("Reshape", ["p", "view"], [f"{name}.view"], allowzero=1))
        x = f"{name}.view"
        if rotated:
            nodes.append(make(ROTATE_HALF, [x, "cos4", "sin4"], [f"{name}.rot"], domain=DOMAIN))
            x = f"{name}.rot"
        nodes += [make("Transpose", [x], [f"{name}.heads"], perm=[0, 2, 1, 3]),
                  make("Gather", [f"{name}.heads", "row"], [f"{name}.row"], axis=0),
                  make("Transpose", [f"{name}.row"], [name], perm=[1, 0, 2])]  # fmt: skip
    nodes += [make("Add", ["q", "v"], ["a"]),
              make("Unsqueeze", ["a", "axis0"], ["a1"]),
              make("Reshape", ["a1", "flat"], ["out"])]  # fmt: skip
    inputs = [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, T, H * HD])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, T, HD])
               for n in ("cos", "sin")]  # fmt: skip
    shapes = {"out": [1, T, H * HD], "q": [T, H, HD], "v": [T, H, HD]}
    if shared_view:
        shapes["v.view"] = [1, T, H, HD]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    model.functions.append(rotate_half_function())
    return model


def batch_axis_feed() -> dict[str, np.ndarray]:
    feed = rotary_feed()
    return {"p": feed["v"].reshape(1, T, H * HD), "cos": feed["cos"], "sin": feed["sin"]}


def test_the_attention_rows_lose_the_batch_axis_with_the_same_values(tmp_path):
    """The query: one Reshape to ``[T, H, D]`` and RotateHalf with cos and sin's row 0; the
    value: one Reshape; the output: one Reshape. Every graph output keeps its name and value
    bit for bit, through the function body and the native kernel, ORT optimizing or not."""
    model = batch_axis_model()
    feed = batch_axis_feed()
    before = run_all(model, feed)
    assert drop_batch_axis(model) == 5
    ops = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert ops == [
        ("Unsqueeze", ["cos", "axis2"], ["cos4"]),
        ("Unsqueeze", ["sin", "axis2"], ["sin4"]),
        ("Reshape", ["p", "view.rows"], ["q.view.rows"]),
        ("Gather", ["cos4", "row"], ["cos4.rows"]),
        ("Gather", ["sin4", "row"], ["sin4.rows"]),
        (ROTATE_HALF, ["q.view.rows", "cos4.rows", "sin4.rows"], ["q"]),
        ("Reshape", ["p", "view.rows"], ["v"]),
        ("Add", ["q", "v"], ["a"]),
        ("Reshape", ["a", "flat"], ["out"]),
    ]
    shapes = {t.name: numpy_helper.to_array(t).tolist() for t in model.graph.initializer}
    assert shapes["view.rows"] == [-1, H, HD]
    onnx.checker.check_model(model, full_check=True)
    levels = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    library = native_build.build().library if native_build.find_ort_headers() else None
    for level in levels:
        for lib in {None, library}:
            for got, want in zip(run_all(model, feed, level, lib), before, strict=True):
                np.testing.assert_array_equal(got, want)


def test_a_view_read_elsewhere_keeps_its_axis_and_the_row_is_one_gather():
    """A view another node reads stays as it is; its row is taken by one Gather (the two
    Transposes around it, which cancel, go)."""
    model = batch_axis_model(shared_view=True)
    feed = batch_axis_feed()
    before = run_all(model, feed)
    assert drop_batch_axis(model) == 4
    ops = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert ("Reshape", ["p", "view"], ["v.view"]) in ops
    assert ("Gather", ["v.view", "row"], ["v"]) in ops
    assert [n.op_type for n in model.graph.node].count("Transpose") == 0
    for got, want in zip(run_all(model, feed), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_row_other_than_the_first_or_a_kept_axis_stays():
    """Only ``Gather(.., 0, axis=0)`` of a scalar index between the two transposes is the
    batch row; a Gather of index ``[0]`` keeps its axis, so the graph stays."""
    model = batch_axis_model()
    row = next(t for t in model.graph.initializer if t.name == "row")
    row.CopyFrom(numpy_helper.from_array(np.array([0], np.int64), "row"))
    model.graph.node[-1].input[0] = "a"  # the Unsqueeze unused: only the rows are looked at
    del model.graph.node[-2]
    before = [n.op_type for n in model.graph.node]
    assert drop_batch_axis(model) == 0
    assert [n.op_type for n in model.graph.node] == before


def test_an_exported_model_feeds_the_attention_from_the_projections_reshaped(artifacts):
    """Every PagedAttention's query and CacheWrite's key come from a RotateHalf reading a
    Reshape, every value from a Reshape; the attention's output goes to one Reshape."""
    art = open_artifact(artifacts("tiny-llama", "auto"))
    graph = onnx.load(str(art.model_file), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    made = lambda name: producer[name].op_type  # noqa: E731
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    writes = [n for n in graph.node if n.op_type == "CacheWrite"]
    assert len(attention) == len(writes) == len(art.spec.layers)
    for q in [n.input[0] for n in attention] + [n.input[-3] for n in writes]:  # query, key
        assert made(q) == ROTATE_HALF and made(producer[q].input[0]) == "Reshape"
    assert all(made(n.input[-2]) == "Reshape" for n in writes)
    outputs = [n.output[0] for n in attention]
    assert all([r.op_type for r in graph.node if o in r.input] == ["Reshape"] for o in outputs)


def residual_norm_model(weight_after: bool = False, read_inside: bool = False) -> onnx.ModelProto:
    """``s = Add(x, r)`` read by the next residual Add (``z``, placed right after it) and by an
    RMS norm in :func:`divide_by_roots`' form, ``y = Mul(w, Div(s, Sqrt(...)))``
    (``weight_after``: Gemma's ``Mul(normed, 1 + w)``, the ``1 + w`` computed just before the
    Mul; ``read_inside``: the mean is a graph output too)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "w")]  # fmt: skip
    make = helper.make_node
    nodes = [
        make("Add", ["x", "r"], ["s"]),
        make("Add", ["s", "x"], ["z"]),
        make("Pow", ["s", "two"], ["p"]),
        make("ReduceMean", ["p", "axes"], ["m"]),
        make("Add", ["m", "eps"], ["a"]),
        make("Sqrt", ["a"], ["root"]),
        make("Div", ["s", "root"], ["n"]),
    ]
    if weight_after:
        nodes += [make("Add", ["one", "w"], ["w1"]), make("Mul", ["n", "w1"], ["y"])]
    else:
        nodes.append(make("Mul", ["w", "n"], ["y"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [T, D]) for n in ("x", "r")]
    names = ["y", "z"] + (["m"] if read_inside else [])
    shapes = {"y": [T, D], "z": [T, D], "m": [T, 1]}
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in names]
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, inits if weight_after else inits[:2] + inits[3:]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def residual_feed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    return {n: rng.standard_normal((T, D)).astype(np.float32) for n in ("x", "r")}


def test_a_residual_add_and_its_norm_become_one_node_with_the_same_values(tmp_path):
    """One FusedAddRMSNorm with both results under the old names, placed where everything it
    reads is made and before the residual Add that reads its sum. The sum stays the Add's bit
    for bit and the norm the unfused ops', through the body and the native kernel (to float32
    rounding of the mean's order), ORT optimizing or not; ORT turns the body back into its
    own norm. The norm's constants no other node reads go."""
    for weight_after in (False, True):
        model = residual_norm_model(weight_after)
        feed = residual_feed()
        before = run_all(model, feed)
        assert fuse_add_rms_norms(model) == 1
        ops = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
        fused = (FUSED_ADD_RMS_NORM, ["x", "r", "w1" if weight_after else "w"], ["y", "s"])
        want = [("Add", ["one", "w"], ["w1"]), fused] if weight_after else [fused]
        assert ops == [*want, ("Add", ["s", "x"], ["z"])]
        assert [helper.get_attribute_value(a) for a in model.graph.node[len(want) - 1].attribute
                ] == [np.float32(1e-6)]  # fmt: skip
        assert [(f.name, f.overload) for f in model.functions] == [(FUSED_ADD_RMS_NORM, "")]
        kept = {t.name for t in model.graph.initializer}
        assert kept == ({"w", "one"} if weight_after else {"w"})
        onnx.checker.check_model(model, full_check=True)
        levels = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  ort.GraphOptimizationLevel.ORT_ENABLE_ALL)  # fmt: skip
        library = native_build.build().library if native_build.find_ort_headers() else None
        for level in levels:
            for lib in {None, library}:
                y, z = run_all(model, feed, level, lib)
                np.testing.assert_array_equal(z, before[1])
                if lib is None and level == levels[0]:
                    np.testing.assert_array_equal(y, before[0])
                else:
                    np.testing.assert_allclose(y, before[0], rtol=1e-5, atol=1e-6)
        # the residual Adds and ORT's own norm (1 + w folded at load)
        assert optimized_ops(model, tmp_path) == {"Add": 2, "SimplifiedLayerNormalization": 1}


def test_a_norm_read_inside_or_not_after_an_add_stays():
    """A value inside the norm read elsewhere, or a norm whose input no Add makes, keeps the
    graph as it is."""
    model = residual_norm_model(read_inside=True)
    before = [n.op_type for n in model.graph.node]
    assert fuse_add_rms_norms(model) == 0
    assert [n.op_type for n in model.graph.node] == before and not model.functions
    model = residual_norm_model()
    model.graph.node[0].op_type = "Sub"
    assert fuse_add_rms_norms(model) == 0 and not model.functions


def test_a_bias_add_before_a_norm_stays():
    """An Add of a constant (a bias, which broadcasts) is no residual stream: it stays."""
    model = residual_norm_model()
    model.graph.node[0].input[1] = "w"
    assert fuse_add_rms_norms(model) == 0 and not model.functions


def test_the_body_is_add_then_the_norm_torch_exports():
    """The function computes the reference: sum, then sum / sqrt(mean(sum^2) + eps) * w."""
    body = fused_add_rms_norm_function()
    assert [n.op_type for n in body.node if n.op_type not in ("Constant", "CastLike")] == [
        "Add", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]  # fmt: skip
    assert list(body.input) == ["x", "residual", "weight"] and list(body.output) == ["out", "sum"]


def test_an_exported_model_fuses_every_residual_norm(artifacts):
    """Each layer's two residual Adds and the norms after them (the last one's: the final
    norm) are FusedAddRMSNorm nodes; only the first layer's input norm, after the embedding,
    stays an RMS norm of its own."""
    art = open_artifact(artifacts("tiny-llama", "auto"))
    ops = collections.Counter(n.op_type for n in onnx.load(str(art.model_file)).graph.node)
    assert ops[FUSED_ADD_RMS_NORM] == 2 * len(art.spec.layers) and ops["ReduceMean"] == 1


F = 24  # the gate's (and up's) width in the SwiGLU graphs


def swiglu_model(widths=(F, F), gate_read_elsewhere: bool = False) -> onnx.ModelProto:
    """``Mul(Mul(g, Sigmoid(g)), u)`` with ``g, u = Split(p, widths, axis=-1)``, as the export
    leaves a SwiGLU on a packed gate and up product (``gate_read_elsewhere``: g is a graph
    output too)."""
    make = helper.make_node
    nodes = [
        make("Split", ["p", "p.widths"], ["g", "u"], axis=-1),
        make("Sigmoid", ["g"], ["s"]),
        make("Mul", ["g", "s"], ["silu"]),
        make("Mul", ["silu", "u"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(widths, np.int64), "p.widths")]
    inputs = [helper.make_tensor_value_info("p", TensorProto.FLOAT, [T, sum(widths)])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, widths[0]])]
    if gate_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [T, widths[0]]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_swiglu_on_a_packed_product_becomes_one_node_with_the_same_values(tmp_path):
    """One SiluAndMul reading the packed product, under the Mul's output name; the widths stay
    (the reference splits the packed matrix by them). Its body gives the unfused ops' values
    bit for bit and ORT turns it into a QuickGelu again; the native kernel is within a few
    float32 roundings of the exact values (closer than ORT's own Sigmoid, whose relative error
    reaches 1e-2 on the far negative side)."""
    model = swiglu_model()
    feed = {"p": np.random.default_rng(5).normal(0, 4, (T, 2 * F)).astype(np.float32)}
    feed["p"][0, :4] = [-100.0, 100.0, -89.0, 0.0]  # exp's clamped ends, zero
    before = run_all(model, feed)
    assert silu_and_muls(model) == 1
    ops = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert ops == [(SILU_AND_MUL, ["p"], ["y"])]
    assert [t.name for t in model.graph.initializer] == ["p.widths"]
    assert [(f.name, f.overload) for f in model.functions] == [(SILU_AND_MUL, "")]
    onnx.checker.check_model(model, full_check=True)
    levels = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    for level in levels:
        np.testing.assert_array_equal(run_all(model, feed, level)[0], before[0])
    gate, up = feed["p"][:, :F].astype(np.float64), feed["p"][:, F:]
    exact = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(before[0], exact, rtol=0.6, atol=1e-4)  # ORT's own Sigmoid
    if native_build.find_ort_headers():
        (got,) = run_all(model, feed, library=native_build.build().library)
        np.testing.assert_allclose(got, exact, rtol=5e-7, atol=1e-35)
    assert "QuickGelu" in optimized_ops(model, tmp_path)


def test_a_swiglu_of_unequal_parts_or_a_gate_read_elsewhere_stays():
    for model in (swiglu_model(widths=(F, F + 8)), swiglu_model(gate_read_elsewhere=True)):
        before = [n.op_type for n in model.graph.node]
        assert silu_and_muls(model) == 0
        assert [n.op_type for n in model.graph.node] == before and not model.functions


def test_the_silu_body_reads_the_gate_then_the_up_half():
    """The first half of the last axis is the gate (silu), the second the up product, as vLLM's
    silu_and_mul reads them and the packed matrices are concatenated."""
    body = silu_and_mul_function()
    graph = helper.make_graph(
        [helper.make_node(SILU_AND_MUL, ["x"], ["y"], domain=DOMAIN)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    model = helper.make_model(graph, functions=[body], ir_version=10, opset_imports=opsets)
    x = np.array([[1.0, -2.0, 3.0, 5.0]], np.float32)
    (y,) = run_all(model, {"x": x})
    silu = x[:, :2] / (1 + np.exp(-x[:, :2]))
    np.testing.assert_allclose(y, silu * x[:, 2:], rtol=1e-6)


def test_an_int4_build_runs_each_swiglu_as_one_node(artifacts):
    """tiny-llama with 4-bit weights packs each layer's gate and up: one SiluAndMul per layer,
    no Sigmoid left."""
    art = open_artifact(artifacts("tiny-llama", "auto", weights="int4"))
    ops = collections.Counter(n.op_type for n in onnx.load(str(art.model_file)).graph.node)
    assert ops[SILU_AND_MUL] == len(art.spec.layers) and ops["Sigmoid"] == 0
