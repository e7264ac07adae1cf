"""The weights floor of a decode step: ONNX Runtime running nothing but an artifact's weight
MatMuls, each weight once on B rows, with the artifact's own initializers (read from its data
file in place) and tqexport's session options. A decoder on these weights and this runtime
cannot step faster than this at batch B, so it bounds every system that reads the same weights
through ORT (tqexport, ONNX Runtime GenAI on the same precision): the peers run measures it
beside them. Block-quantized weights run as the artifact runs them (DequantizeLinear into
MatMul, fused by ONNX Runtime into MatMulNBits; block offsets added by the artifact's own
AddBlockOffsets nodes, on the kernels the artifact's session would choose), so the floor is
that of the stored weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from tqexport.contract.artifact import Artifact
from tqexport.native.kernel_choice import choose as choose_kernels
from tqexport.ops.attributes import ADD_BLOCK_OFFSETS, DOMAIN
from tqexport.runtime.backends.ort import EXTERNAL_FOLDER_ENTRY, apply_weights, session_options

#: the floor's system name in a peers run (its tokens/s: batch over the fastest step)
SYSTEM = "ORT weight MatMuls only"


#: the ops that turn stored initializers into the matrix a MatMul multiplies by
_WEIGHT_OPS = ("Transpose", "DequantizeLinear", "Cast")


@dataclass
class WeightProduct:
    """One weight a MatMul multiplies by: the value ``b`` (``[K, N]``), the nodes that make it
    from the stored initializers (none for a float weight stored as it is multiplied), and
    those initializers; the AddBlockOffsets node that adds its block offsets to the product,
    if any, and their initializer."""

    b: str
    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    k: int
    n: int
    offsets: onnx.NodeProto | None = None
    offsets_initializer: onnx.TensorProto | None = None


def weight_products(model: onnx.ModelProto) -> list[WeightProduct]:
    """The weights ``model``'s top-level MatMuls multiply by, once each, in graph order: a 2-D
    initializer, or what Transposes, blocked DequantizeLinears and Casts make of initializers
    (a tied head's transposed table, 4- and 8-bit blocks, float16 storage); matrices packed
    into one (q, k, v) are one weight, as the model multiplies them, with the AddBlockOffsets
    that adds its offsets to the product. These are the bytes a decode step reads in full."""
    inits = {t.name: t for t in model.graph.initializer}
    shape = {name: list(t.dims) for name, t in inits.items()}
    maker: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        if node.op_type not in _WEIGHT_OPS or not all(i in shape for i in node.input if i):
            continue
        s = shape[node.input[0]]
        if node.op_type == "Transpose":
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            if len(s) != 2 or perm not in ([], [[1, 0]]):
                continue
            s = s[::-1]
        shape[node.output[0]], maker[node.output[0]] = s, node
    offsets = {n.input[1]: n for n in model.graph.node if n.domain == DOMAIN
               and n.op_type == ADD_BLOCK_OFFSETS and n.input[2] in inits}  # fmt: skip
    seen: dict[str, WeightProduct] = {}
    for node in model.graph.node:
        a, b = node.input[0], node.input[1] if len(node.input) > 1 else ""
        if node.op_type != "MatMul" or a in shape or b not in shape or len(shape[b]) != 2:
            continue
        if b not in seen:
            nodes, names, todo = [], [], [b]
            while todo:
                value = todo.pop()
                if value in maker:
                    nodes.insert(0, maker[value])
                    todo += [i for i in maker[value].input if i]
                elif value not in names:
                    names.append(value)
            k, n = shape[b]
            adds = offsets.get(node.output[0])
            seen[b] = WeightProduct(b, nodes, [inits[i] for i in reversed(names)], k, n, adds,
                                    adds and inits[adds.input[2]])  # fmt: skip
    return list(seen.values())


def floor_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A graph of one MatMul per weight of ``model`` (input ``rows_K`` of shape [batch, K] for
    each weight of K rows as multiplied, output ``y<i>``), each weight made as the model makes
    it (the same Transposes and DequantizeLinears, which ONNX Runtime folds or fuses at load as
    it does in the model), the initializers as stored (external data stays external)."""
    products = weight_products(model)
    if not products:
        raise ValueError("the model has no weight MatMul")
    elem = next(o.type.tensor_type.elem_type for o in model.graph.output)
    nodes, outputs, widths, inits = [], [], set(), {}
    emitted: set[str] = set()
    for i, p in enumerate(products):
        for node in p.nodes:
            if node.output[0] not in emitted:
                nodes.append(node)
                emitted.add(node.output[0])
        for t in p.initializers:
            inits.setdefault(t.name, t)
        y = f"y{i}" if p.offsets is None else f"y{i}.main"
        nodes.append(onnx.helper.make_node("MatMul", [f"rows_{p.k}", p.b], [y]))
        if p.offsets is not None:
            add = onnx.NodeProto()
            add.CopyFrom(p.offsets)
            add.input[:] = [f"rows_{p.k}", y, p.offsets.input[2]]
            add.output[:] = [f"y{i}"]
            nodes.append(add)
            inits.setdefault(p.offsets_initializer.name, p.offsets_initializer)
        outputs.append(onnx.helper.make_tensor_value_info(f"y{i}", elem, ["batch", p.n]))
        widths.add(p.k)
    inputs = [
        onnx.helper.make_tensor_value_info(f"rows_{k}", elem, ["batch", k]) for k in sorted(widths)
    ]
    graph = onnx.helper.make_graph(nodes, "weights_floor", inputs, outputs, list(inits.values()))
    used = {(n.domain, n.op_type, n.overload) for n in nodes}
    functions = [f for f in model.functions if (f.domain, f.name, f.overload) in used]
    opset = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or functions]
    return onnx.helper.make_model(graph, opset_imports=opset, ir_version=model.ir_version,
                                  functions=functions)  # fmt: skip


def floor_model(artifact: Artifact) -> onnx.ModelProto:
    """:func:`floor_graph` of ``artifact``'s model (its weights left in the data file)."""
    return floor_graph(onnx.load(str(artifact.model_file), load_external_data=False))


#: element types stored two to a byte
_NIBBLES = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


def weights_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s initializers (a floor model's: every weight a step reads)."""
    total = 0
    for t in model.graph.initializer:
        count = int(np.prod(t.dims))
        if t.data_type in _NIBBLES:
            total += (count + 1) // 2
        else:
            total += count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


class WeightsFloor:
    """A session over :func:`floor_model` with ``batch`` rows per input (seeded values): one
    :meth:`step` reads every weight once, as a decode step of ``batch`` sequences does."""

    def __init__(self, artifact: Artifact, batch: int, threads: int | None = None):
        model = floor_model(artifact)
        opts = session_options(threads)
        apply_weights(opts, artifact.spec)
        opts.add_session_config_entry(EXTERNAL_FOLDER_ENTRY, str(artifact.model_file.parent))
        library = choose_kernels(artifact.spec).library
        if library is not None:
            opts.register_custom_ops_library(str(library))
        self.session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        rng = np.random.default_rng(0)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(
            model.graph.input[0].type.tensor_type.elem_type
        )
        self.feed = {
            i.name: rng.standard_normal((batch, int(i.name.removeprefix("rows_")))).astype(dtype)
            for i in model.graph.input
        }

    def step(self) -> list[np.ndarray]:
        return self.session.run(None, self.feed)
