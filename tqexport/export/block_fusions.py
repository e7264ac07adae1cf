"""A decoder block's residual norm and SwiGLU in one tqexport node each, with function bodies.

ORT fuses a residual Add into the RMS norm after it only where nothing else reads the sum, never
in a pre-norm decoder, whose next residual Add does: each pair becomes one ``FusedAddRMSNorm``
(vLLM's ``fused_add_rms_norm``). A SwiGLU on a packed gate and up product (a Split, Sigmoid and
two Muls) becomes one ``SiluAndMul`` (vLLM's ``silu_and_mul``).
"""

from __future__ import annotations

import onnx
from onnx import helper

from tqexport.export.graph_edit import (
    GraphIndex,
    Match,
    fuse,
    halves,
    node_attr,
)
from tqexport.ops.attributes import BODY_OPSET, DOMAIN, FUSED_ADD_RMS_NORM, SILU_AND_MUL


def fused_add_rms_norm_function() -> onnx.FunctionProto:
    """FusedAddRMSNorm's portable body: ``sum = x + residual``, ``out = sum / sqrt(mean(sum^2
    over the last axis) + epsilon) * weight``, in the ops torch exports an RMS norm as (ONNX
    Runtime fuses them back into its SimplifiedLayerNormalization)."""
    make = helper.make_node
    eps = make("Constant", [], ["eps32"])
    eps.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="epsilon",
                                             type=onnx.AttributeProto.FLOAT))  # fmt: skip
    nodes = [
        make("Constant", [], ["two32"], value_float=2.0),
        make("Constant", [], ["last"], value_ints=[-1]),
        eps,
        make("CastLike", ["two32", "x"], ["two"]),
        make("CastLike", ["eps32", "x"], ["eps"]),
        make("Add", ["x", "residual"], ["sum"]),
        make("Pow", ["sum", "two"], ["squares"]),
        make("ReduceMean", ["squares", "last"], ["mean"], keepdims=1),
        make("Add", ["mean", "eps"], ["shifted"]),
        make("Sqrt", ["shifted"], ["root"]),
        make("Div", ["sum", "root"], ["normed"]),
        make("Mul", ["normed", "weight"], ["out"]),
    ]
    return helper.make_function(DOMAIN, FUSED_ADD_RMS_NORM, ["x", "residual", "weight"],
                                ["out", "sum"], nodes, [helper.make_opsetid("", BODY_OPSET)],
                                ["epsilon"])  # fmt: skip


def _add_rms_norm(g: GraphIndex, mul: onnx.NodeProto) -> Match | None:
    """The FusedAddRMSNorm replacing ``Mul(weight, Div(s, Sqrt(Add(ReduceMean(Pow(s, 2), [-1]),
    eps))))`` at ``mul`` (either operand order; an RMS norm after ``divide_by_roots``) with
    ``s = Add(x, residual)`` of two computed tensors (a constant there is a bias, not a residual
    stream), with the nodes it replaces; else None."""
    if len(mul.input) != 2:
        return None
    for w, d in ((0, 1), (1, 0)):
        div = g.made_by(mul.input[d], "Div")
        root = div and g.made_by(div.input[1], "Sqrt")
        shift = root and g.made_by(root.input[0], "Add")
        if shift is None:
            continue
        for m, e in ((0, 1), (1, 0)):
            mean = g.made_by(shift.input[m], "ReduceMean")
            eps = g.scalars.get(shift.input[e])
            square = mean and g.made_by(mean.input[0], "Pow")
            if square is None or eps is None or len(mean.input) != 2:
                continue
            total = g.made_by(div.input[0], "Add")
            if (total is None or square.input[0] != total.output[0] or len(total.input) != 2
                    or any(g.constant(i) for i in total.input)
                    or g.scalars.get(square.input[1]) != 2.0 or g.ints(mean.input[1]) != [-1]
                    or node_attr(mean, "keepdims", 1) != 1
                    or node_attr(mean, "noop_with_empty_axes", 0) != 0):  # fmt: skip
                continue
            inner = [(square.output[0], mean), (mean.output[0], shift), (shift.output[0], root),
                     (root.output[0], div), (div.output[0], mul)]  # fmt: skip
            if not all(g.only_reader(name, node) for name, node in inner):
                continue
            made = helper.make_node(FUSED_ADD_RMS_NORM, [*total.input, mul.input[w]],
                                    [mul.output[0], total.output[0]],
                                    name=mul.name or mul.output[0], domain=DOMAIN,
                                    epsilon=eps)  # fmt: skip
            return made, [total, square, mean, shift, root, div], frozenset()
    return None


def fuse_add_rms_norms(model: onnx.ModelProto) -> int:
    """Replace each residual Add and the RMS norm reading its sum (:func:`_add_rms_norm`) by one
    ``FusedAddRMSNorm`` with both results, under the norm's and the Add's output names; the
    function body added once. Returns the pairs fused."""
    return fuse(model, "Mul", _add_rms_norm, fused_add_rms_norm_function())


def silu_and_mul_function() -> onnx.FunctionProto:
    """SiluAndMul's portable body: ``gate * Sigmoid(gate) * up`` with ``gate, up`` the halves of
    ``x``'s last axis (ONNX Runtime fuses the first product into its QuickGelu)."""
    make = helper.make_node
    nodes = [
        *halves("x", "gate", "up"),
        make("Sigmoid", ["gate"], ["sigmoid"]),
        make("Mul", ["gate", "sigmoid"], ["silu"]),
        make("Mul", ["silu", "up"], ["out"]),
    ]
    return helper.make_function(DOMAIN, SILU_AND_MUL, ["x"], ["out"], nodes,
                                [helper.make_opsetid("", BODY_OPSET)])  # fmt: skip


def _silu_and_mul(g: GraphIndex, mul: onnx.NodeProto) -> Match | None:
    """The SiluAndMul replacing ``Mul(Mul(gate, Sigmoid(gate)), up)`` at ``mul`` (either
    operand order) with ``gate, up = Split(x)``, two equal parts of its last axis, with the
    nodes it replaces; else None."""
    if len(mul.input) != 2:
        return None
    for s, u in ((0, 1), (1, 0)):
        silu = g.made_by(mul.input[s], "Mul")
        split = g.made_by(mul.input[u], "Split")
        if silu is None or split is None or len(silu.input) != 2 or len(split.output) != 2:
            continue
        gate, up = split.output
        if mul.input[u] != up or gate not in silu.input:
            continue
        sigmoid = g.made_by(silu.input[1 - list(silu.input).index(gate)], "Sigmoid")
        widths = g.ints(split.input[1]) if len(split.input) == 2 else None
        if (sigmoid is None or sigmoid.input[0] != gate or node_attr(split, "axis", 0) != -1
                or widths is None or len(widths) != 2 or widths[0] != widths[1]):  # fmt: skip
            continue
        gate_readers = sorted(id(n) for n in g.readers.get(gate, []))
        if gate in g.outputs or gate_readers != sorted((id(silu), id(sigmoid))):
            continue
        inner = [(up, mul), (sigmoid.output[0], silu), (silu.output[0], mul)]
        if all(g.only_reader(name, node) for name, node in inner):
            made = helper.make_node(SILU_AND_MUL, [split.input[0]], [mul.output[0]],
                                    name=mul.name or mul.output[0], domain=DOMAIN)  # fmt: skip
            # the packed matrix's widths stay: the reference splits it by them
            return made, [split, sigmoid, silu], frozenset([split.input[1]])
    return None


def silu_and_muls(model: onnx.ModelProto) -> int:
    """Replace each SwiGLU on a packed gate and up product (:func:`_silu_and_mul`: the split of
    :mod:`tqexport.weights.graph`'s packed matrices) by one ``SiluAndMul`` under the product's
    output name; the function body added once. Returns the SwiGLUs replaced."""
    return fuse(model, "Mul", _silu_and_mul, silu_and_mul_function())
