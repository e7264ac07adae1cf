"""The weights floor of a decode step: ONNX Runtime running nothing but an artifact's weight
MatMuls, each weight once on B rows, with the artifact's own initializers (read from its data
file in place) and tqexport's session options. A decoder on these weights and this runtime
cannot step faster than this at batch B, so it bounds every system that reads the same fp32
weights through ORT's MatMul (tqexport, ONNX Runtime GenAI): the peers run measures it beside
them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from tqexport.contract.artifact import Artifact
from tqexport.runtime.backends.ort import EXTERNAL_FOLDER_ENTRY, session_options

#: the floor's system name in a peers run (its tokens/s: batch over the fastest step)
SYSTEM = "ORT weight MatMuls only"


def weight_matmuls(model: onnx.ModelProto) -> list[tuple[onnx.TensorProto, bool]]:
    """The weights ``model``'s top-level MatMuls multiply by, once each, in graph order: (the
    initializer, whether the MatMul reads it through a 2-D Transpose, as a tied embedding's
    lm_head does). These are the weights a decode step reads in full."""
    inits = {t.name: t for t in model.graph.initializer}
    transposed = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Transpose"
        and n.input[0] in inits
        and len(inits[n.input[0]].dims) == 2
        and [list(a.ints) for a in n.attribute if a.name == "perm"] in ([], [[1, 0]])
    }
    seen: dict[str, tuple[onnx.TensorProto, bool]] = {}
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        b = node.input[1]
        if b in inits and len(inits[b].dims) == 2:
            seen.setdefault(b, (inits[b], False))
        elif b in transposed:
            seen.setdefault(transposed[b], (inits[transposed[b]], True))
    return list(seen.values())


def floor_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A graph of one MatMul per weight of ``model`` (input ``rows_K`` of shape [batch, K] for
    each weight of K rows as multiplied, output ``y<i>``; a transposed weight through the same
    Transpose, which ORT folds at load as it does in the model), the initializers as stored
    (external data stays external: nothing is copied)."""
    weights = weight_matmuls(model)
    if not weights:
        raise ValueError("the model has no weight MatMul")
    elem = weights[0][0].data_type
    nodes, outputs, widths = [], [], set()
    for i, (w, transposed) in enumerate(weights):
        k, n = reversed(w.dims) if transposed else w.dims
        b = w.name
        if transposed:
            b = f"{w.name}_t"
            nodes.append(onnx.helper.make_node("Transpose", [w.name], [b], perm=[1, 0]))
        nodes.append(onnx.helper.make_node("MatMul", [f"rows_{k}", b], [f"y{i}"]))
        outputs.append(onnx.helper.make_tensor_value_info(f"y{i}", elem, ["batch", n]))
        widths.add(k)
    inputs = [
        onnx.helper.make_tensor_value_info(f"rows_{k}", elem, ["batch", k]) for k in sorted(widths)
    ]
    graph = onnx.helper.make_graph(nodes, "weights_floor", inputs, outputs, [w for w, _ in weights])
    opset = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return onnx.helper.make_model(graph, opset_imports=opset, ir_version=model.ir_version)


def floor_model(artifact: Artifact) -> onnx.ModelProto:
    """:func:`floor_graph` of ``artifact``'s model (its weights left in the data file)."""
    return floor_graph(onnx.load(str(artifact.model_file), load_external_data=False))


def weights_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s initializers (a floor model's: every weight a step reads)."""
    return sum(
        int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in model.graph.initializer
    )


class WeightsFloor:
    """A session over :func:`floor_model` with ``batch`` rows per input (seeded values): one
    :meth:`step` reads every weight once, as a decode step of ``batch`` sequences does."""

    def __init__(self, artifact: Artifact, batch: int, threads: int | None = None):
        model = floor_model(artifact)
        opts = session_options(threads)
        opts.add_session_config_entry(EXTERNAL_FOLDER_ENTRY, str(artifact.model_file.parent))
        self.session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        rng = np.random.default_rng(0)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(model.graph.initializer[0].data_type)
        self.feed = {
            i.name: rng.standard_normal((batch, int(i.name.removeprefix("rows_")))).astype(dtype)
            for i in model.graph.input
        }

    def step(self) -> list[np.ndarray]:
        return self.session.run(None, self.feed)
