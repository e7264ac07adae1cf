"""Rewrites of the exported graph into fewer nodes: forms ONNX Runtime's graph optimizer fuses,
and tqexport nodes (with their function bodies) for what it does not.

torch exports ``x * rsqrt(mean(x^2) + eps)`` (every RMS norm of the models tqexport loads) as
``Sqrt -> Reciprocal -> Mul``; ORT fuses an RMS norm into one SimplifiedLayerNormalization node
only from ``Sqrt -> Div`` (ORT 1.32), so unrewritten each norm runs as seven small nodes. A
rotary embedding's rotate-half (two Slices, Neg, Concat, two Muls, Add per query and key) has no
ORT fusion outside its contrib attention ops: it becomes one ``RotateHalf``. The export's batch
axis of one (HF's ``[1, T, ...]`` around the attention, which reads ``[T, ...]``) costs a
Gather per query, key and value and an Unsqueeze per output: they fold into the Reshapes beside.
ORT fuses a residual Add into the RMS norm after it only where nothing else reads the sum, never
in a pre-norm decoder, whose next residual Add does: each pair becomes one ``FusedAddRMSNorm``.
A SwiGLU on a packed gate and up product (a Split, Sigmoid and two Muls) becomes one
``SiluAndMul``.
"""

from __future__ import annotations

import heapq

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tqexport.ops.attributes import (
    BODY_OPSET,
    DOMAIN,
    FUSED_ADD_RMS_NORM,
    ROTATE_HALF,
    SILU_AND_MUL,
    import_domain,
)


def divide_by_roots(model: onnx.ModelProto) -> int:
    """Replace each ``Mul(x, Reciprocal(Sqrt(y)))`` by ``Div(x, Sqrt(y))`` in the main graph
    (the Reciprocal dropped when only such Muls read it); returns how many Muls changed."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in set(n.input):
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    changed, dropped = 0, []
    for rec in graph.node:
        root = producer.get(rec.input[0]) if rec.op_type == "Reciprocal" else None
        if root is None or root.op_type != "Sqrt" or rec.output[0] in outputs:
            continue
        users = readers.get(rec.output[0], [])
        if not users or any(u.op_type != "Mul" or len(set(u.input)) != 2 for u in users):
            continue
        for mul in users:
            other = mul.input[1] if mul.input[0] == rec.output[0] else mul.input[0]
            mul.op_type = "Div"
            del mul.input[:]
            mul.input.extend([other, root.output[0]])
            changed += 1
        dropped.append(rec)
    for rec in dropped:
        graph.node.remove(rec)
    return changed


#: the layout swap torch exports between ``[B, T, H, D]`` projections and ``[B, H, T, D]``
_HEADS_FIRST = [0, 2, 1, 3]
#: the initializer holding Unsqueeze's axis for cos and sin in the ``[B, T, H, D]`` layout
_HEADS_AXIS = "tqexport.rotary.heads_axis"


def _halves(x: str, first: str, second: str) -> list[onnx.NodeProto]:
    """Function-body nodes slicing ``x``'s last axis into its halves ``first`` and ``second``
    (intermediate names ``two``, ``zero``, ``last``, ``end``, ``d``, ``h``)."""
    make = helper.make_node
    return [
        make("Constant", [], ["two"], value_ints=[2]),
        make("Constant", [], ["zero"], value_ints=[0]),
        make("Constant", [], ["last"], value_ints=[-1]),
        make("Constant", [], ["end"], value_ints=[np.iinfo(np.int64).max]),
        make("Shape", [x], ["d"], start=-1),
        make("Div", ["d", "two"], ["h"]),
        make("Slice", [x, "zero", "h", "last"], [first]),
        make("Slice", [x, "h", "end", "last"], [second]),
    ]


def rotate_half_function() -> onnx.FunctionProto:
    """RotateHalf's portable body: ``x * cos + concat(-x[..., h:], x[..., :h]) * sin`` over
    the last axis of ``D = 2h``, the unfused ops every ONNX runtime runs."""
    make = helper.make_node
    nodes = [
        *_halves("x", "x1", "x2"),
        make("Neg", ["x2"], ["minus_x2"]),
        make("Concat", ["minus_x2", "x1"], ["rotated"], axis=-1),
        make("Mul", ["x", "cos"], ["x_cos"]),
        make("Mul", ["rotated", "sin"], ["rotated_sin"]),
        make("Add", ["x_cos", "rotated_sin"], ["out"]),
    ]
    return helper.make_function(DOMAIN, ROTATE_HALF, ["x", "cos", "sin"], ["out"], nodes,
                                [helper.make_opsetid("", BODY_OPSET)])  # fmt: skip


class _Graph:
    """Producers, readers and constant integer values of a graph's tensors."""

    def __init__(self, graph: onnx.GraphProto):
        self.producer = {o: n for n in graph.node for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in set(n.input):
                self.readers.setdefault(i, []).append(n)
        small = [(t.name, t) for t in graph.initializer if len(t.dims) <= 1]
        small += [
            (n.output[0], n.attribute[0].t)
            for n in graph.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
        ]
        self.values: dict[str, np.ndarray] = {}  # int64 scalars and vectors
        self.scalars: dict[str, float] = {}  # float scalars (one element)
        for name, t in small:
            if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1:
                self.values[name] = numpy_helper.to_array(t)
            elif t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) == 1:
                self.scalars[name] = float(numpy_helper.to_array(t).reshape(()))
        self.outputs = {o.name for o in graph.output}
        self.initializers = {t.name for t in graph.initializer}

    def constant(self, name: str) -> bool:
        """Whether ``name`` is an initializer or a Constant node's output."""
        made = self.producer.get(name)
        return name in self.initializers or (made is not None and made.op_type == "Constant")

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op else None

    def only_reader(self, name: str, node: onnx.NodeProto) -> bool:
        readers = self.readers.get(name, [])
        return name not in self.outputs and [id(n) for n in readers] == [id(node)]

    def ints(self, name: str) -> list[int] | None:
        value = self.values.get(name)
        return None if value is None else [int(v) for v in np.atleast_1d(value)]


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _spliced(
    graph: onnx.GraphProto, new: dict[int, list[onnx.NodeProto]], drop: set[int]
) -> list[onnx.NodeProto]:
    """The graph's nodes with each of ``new``'s keys (a node's id) replaced by its list and
    each node in ``drop`` left out, in topological order (the original order where it is one):
    a rewrite may place a node before a producer of what it reads."""
    nodes = []
    for n in graph.node:
        if id(n) not in drop:
            nodes += new.get(id(n), [n])
    made_at = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waits = [{made_at[i] for i in n.input if i in made_at} - {k} for k, n in enumerate(nodes)]
    unblocks: dict[int, list[int]] = {}
    for k, before in enumerate(waits):
        for b in before:
            unblocks.setdefault(b, []).append(k)
    ready = [k for k, before in enumerate(waits) if not before]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for j in unblocks.get(k, []):
            waits[j].discard(k)
            if not waits[j]:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ValueError("a graph rewrite made a cycle")  # a bug in a rewrite, never input
    return order


def _rotary(g: _Graph, add: onnx.NodeProto) -> dict | None:
    """The parts of ``Add(Mul(x, cos), Mul(Concat(Neg(x[..., h:]), x[..., :h]), sin))`` at
    ``add`` with ``x = Transpose(v, [0, 2, 1, 3])`` and cos, sin ``Unsqueeze(c, [1])``
    (HF's rotate-half rotary on ``[B, H, T, D]``, as torch exports it), else None."""
    muls = [g.made_by(i, "Mul") for i in add.input]
    if len(add.input) != 2 or None in muls:
        return None
    for plain, turned in (muls, muls[::-1]):
        for ci, cat_in in enumerate(turned.input):
            cat = g.made_by(cat_in, "Concat")
            if cat is None or len(cat.input) != 2 or _attr(cat, "axis") not in (-1, 3):
                continue
            neg, first = g.made_by(cat.input[0], "Neg"), g.made_by(cat.input[1], "Slice")
            second = neg and g.made_by(neg.input[0], "Slice")
            if first is None or second is None or first.input[0] != second.input[0]:
                continue
            x = first.input[0]
            if x not in plain.input:
                continue
            cos, sin = plain.input[1 - list(plain.input).index(x)], turned.input[1 - ci]
            bounds = [[g.ints(i) for i in s.input[1:5]] + [None] * (5 - len(s.input))
                      for s in (first, second)]  # fmt: skip
            (s1, e1, a1, st1), (s2, e2, a2, st2) = bounds
            last = ([-1], [3])
            if not (s1 == [0] and e1 and s2 == e1 and e2 and a1 in last and a2 in last
                    and st1 in (None, [1]) and st2 in (None, [1])):  # fmt: skip
                continue
            turn = g.made_by(x, "Transpose")
            lifts = [g.made_by(t, "Unsqueeze") for t in (cos, sin)]
            if turn is None or list(_attr(turn, "perm", [])) != _HEADS_FIRST or None in lifts:
                continue
            if any(g.ints(u.input[1]) != [1] for u in lifts):
                continue
            inner = [(muls[0].output[0], add), (muls[1].output[0], add),
                     (cat.output[0], turned), (neg.output[0], cat), (second.output[0], neg),
                     (first.output[0], cat)]  # fmt: skip
            if not all(g.only_reader(name, node) for name, node in inner):
                continue
            return {"v": turn.input[0], "x": x, "cos": lifts[0].input[0],
                    "sin": lifts[1].input[0], "half": e1[0], "end": e2[0],
                    "feeds": [turn, *lifts],
                    "drop": [*muls, cat, neg, first, second]}  # fmt: skip
    return None


def rotate_halves(model: onnx.ModelProto) -> int:
    """Replace each rotate-half rotary of the main graph (:func:`_rotary`: HF's, on the
    ``[B, H, T, D]`` layout its projections are transposed into) by one ``RotateHalf`` on the
    projection's own ``[B, T, H, D]`` layout, cos and sin unsqueezed there, then the same
    Transpose; the function body added once. Six nodes fewer per rotation for ONNX Runtime,
    which still moves the transposes away. Returns the rotations replaced."""
    graph = model.graph
    g = _Graph(graph)
    shapes = {v.name: v.type.tensor_type for v in (*graph.value_info, *graph.input)}
    lifted: dict[str, str] = {}
    new: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    infos, feeds = [], {}
    for add in graph.node:
        found = _rotary(g, add) if add.op_type == "Add" else None
        if found is None:
            continue
        x_type = shapes.get(found["x"])
        dims = [d.dim_value for d in x_type.shape.dim] if x_type is not None else []
        if len(dims) != 4 or dims[3] != 2 * found["half"] or found["end"] < dims[3]:
            continue
        made = []
        for t in ("cos", "sin"):
            if found[t] not in lifted:
                name = lifted[found[t]] = f"{found[t]}.heads_axis"
                made.append(helper.make_node("Unsqueeze", [found[t], _HEADS_AXIS], [name],
                                             name=name))  # fmt: skip
        out = f"{add.output[0]}.rotated"
        operands = [found["v"], lifted[found["cos"]], lifted[found["sin"]]]
        made.append(helper.make_node(ROTATE_HALF, operands, [out], name=out, domain=DOMAIN))
        made.append(helper.make_node("Transpose", [out], [add.output[0]], name=add.name,
                                     perm=_HEADS_FIRST))  # fmt: skip
        infos.append(helper.make_tensor_value_info(out, x_type.elem_type, None))
        new[id(add)] = made
        drop.update(id(n) for n in found["drop"])
        feeds.update((id(n), n.output[0]) for n in found["feeds"])
    if not new:
        return 0
    nodes = _spliced(graph, new, drop)
    read = {i for n in nodes for i in n.input} | g.outputs
    del graph.node[:]  # the Transposes and Unsqueezes the rotations read, unless read elsewhere
    graph.node.extend(n for n in nodes if id(n) not in feeds or feeds[id(n)] in read)
    graph.value_info.extend(infos)
    graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), _HEADS_AXIS))
    model.functions.append(rotate_half_function())
    import_domain(model)
    return len(new)


#: the transposes around the attention's batch row: HF's ``[1, H, T, D]`` back to ``[T, H, D]``
_TOKENS_FIRST = [1, 0, 2]


def _first_row(g: _Graph, turn_back: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Gather at ``Transpose(Gather(Transpose(y, [0, 2, 1, 3]), 0, axis=0), [1, 0, 2])``
    ending in ``turn_back``, which is ``y[0]`` (how the attention takes its query, key and
    value from HF's layout), else None."""
    if turn_back.op_type != "Transpose" or list(_attr(turn_back, "perm", [])) != _TOKENS_FIRST:
        return None
    gather = g.made_by(turn_back.input[0], "Gather")
    if gather is None or _attr(gather, "axis", 0) != 0 or not g.only_reader(gather.output[0],
                                                                           turn_back):  # fmt: skip
        return None
    index = g.values.get(gather.input[1])
    turn = g.made_by(gather.input[0], "Transpose")
    if index is None or index.ndim != 0 or int(index) != 0 or turn is None:
        return None
    if list(_attr(turn, "perm", [])) != _HEADS_FIRST or not g.only_reader(turn.output[0], gather):
        return None
    return gather


def _row_shape(g: _Graph, reshape: onnx.NodeProto | None) -> list[int] | None:
    """The target shape of ``reshape`` without its leading 1 when it is a constant of the form
    ``[1, ...]`` with no 0 entries (whose meaning ``allowzero`` decides), else None."""
    shape = g.ints(reshape.input[1]) if reshape is not None else None
    if not shape or shape[0] != 1 or 0 in shape:
        return None
    return shape[1:]


def drop_batch_axis(model: onnx.ModelProto) -> int:
    """Take the attention's ``[T, ...]`` rows without HF's batch axis of one: each
    :func:`_first_row` chain becomes the Reshape of the projection to ``[T, H, D]`` (through
    its RotateHalf, whose cos and sin lose the axis too) or, unmatched, one Gather; each
    ``Reshape(Unsqueeze(a), shape)`` becomes ``Reshape(a, shape)``. Returns the nodes removed;
    every tensor the rest of the graph reads keeps its name and value."""
    graph = model.graph
    g = _Graph(graph)
    new: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    made_shapes: dict[str, list[int]] = {}
    rows: dict[str, str] = {}  # cos or sin [1, T, 1, D] -> its row [T, 1, D]
    before = len(graph.node)
    for turn_back in graph.node:
        gather = _first_row(g, turn_back)
        if gather is None:
            continue
        turn = g.producer[gather.input[0]]
        out, index = turn_back.output[0], gather.input[1]
        y = turn.input[0]
        rotate = g.producer.get(y)
        if rotate is not None and (rotate.op_type, rotate.domain) != (ROTATE_HALF, DOMAIN):
            rotate = None
        if rotate is not None and not g.only_reader(y, turn):
            rotate = None
        source = g.made_by(rotate.input[0] if rotate is not None else y, "Reshape")
        target = _row_shape(g, source)
        if target is None or not g.only_reader(source.output[0], rotate or turn):
            made = [helper.make_node("Gather", [y, index], [out], name=out, axis=0)]
            rotate = None
        else:
            shape = f"{source.input[1]}.rows"
            made_shapes[shape] = target
            reshaped = f"{source.output[0]}.rows" if rotate is not None else out
            made = [helper.make_node("Reshape", [source.input[0], shape], [reshaped],
                                     name=reshaped)]  # fmt: skip
            drop.add(id(source))
        if rotate is not None:
            angles = []
            for t in rotate.input[1:]:
                if t not in rows:
                    rows[t] = f"{t}.rows"
                    made.append(helper.make_node("Gather", [t, index], [rows[t]], name=rows[t],
                                                 axis=0))  # fmt: skip
                angles.append(rows[t])
            made.append(helper.make_node(ROTATE_HALF, [made[0].output[0], *angles], [out],
                                         name=out, domain=DOMAIN))  # fmt: skip
            drop.add(id(rotate))
        new[id(turn_back)] = made
        drop.update((id(gather), id(turn)))
    for reshape in graph.node:
        lift = g.made_by(reshape.input[0], "Unsqueeze") if reshape.op_type == "Reshape" else None
        shape = g.ints(reshape.input[1]) if lift is not None else None
        if shape is None or 0 in shape or not g.only_reader(lift.output[0], reshape):
            continue
        reshape.input[0] = lift.input[0]
        drop.add(id(lift))
    nodes = _spliced(graph, new, drop)
    if len(nodes) == before:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    named = {o for n in nodes for o in n.output} | {t.name for t in graph.input}
    stale = [v for v in graph.value_info if v.name not in named]
    for v in stale:
        graph.value_info.remove(v)
    for name, target in made_shapes.items():
        graph.initializer.append(numpy_helper.from_array(np.array(target, np.int64), name))
    return before - len(graph.node)


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


def _add_rms_norm(g: _Graph, mul: onnx.NodeProto) -> dict | None:
    """The parts of ``Mul(weight, Div(s, Sqrt(Add(ReduceMean(Pow(s, 2), [-1]), eps))))`` at
    ``mul`` (either operand order; an RMS norm after :func:`divide_by_roots`) with ``s =
    Add(x, residual)`` of two computed tensors (a constant there is a bias, not a residual
    stream), else None."""
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
                    or _attr(mean, "keepdims", 1) != 1
                    or _attr(mean, "noop_with_empty_axes", 0) != 0):  # fmt: skip
                continue
            inner = [(square.output[0], mean), (mean.output[0], shift), (shift.output[0], root),
                     (root.output[0], div), (div.output[0], mul)]  # fmt: skip
            if not all(g.only_reader(name, node) for name, node in inner):
                continue
            return {"add": total, "weight": mul.input[w], "epsilon": eps,
                    "drop": [square, mean, shift, root, div]}  # fmt: skip
    return None


def _element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element type of every tensor the graph declares (value infos, inputs, outputs,
    initializers)."""
    typed = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.value_info, *graph.input, *graph.output)}  # fmt: skip
    typed.update((t.name, t.data_type) for t in graph.initializer)
    return {k: v for k, v in typed.items() if v}


def _apply(model: onnx.ModelProto, new: dict[int, list[onnx.NodeProto]], drop: set[int],
           function: onnx.FunctionProto, keep: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """Splice a rewrite into the main graph (:func:`_spliced`), declare its new nodes' outputs
    (ORT infers no custom op's type), drop the value infos of tensors gone and the initializers
    only removed nodes read (but those in ``keep``), and add ``function`` with the tqexport
    domain's import."""
    graph = model.graph
    typed = _element_types(graph)
    removed = [n for n in graph.node if id(n) in drop or id(n) in new]
    made = [m for n in graph.node if id(n) in new for m in new[id(n)]]
    nodes = _spliced(graph, new, drop)
    del graph.node[:]
    graph.node.extend(nodes)
    named = {o for n in nodes for o in n.output} | {t.name for t in graph.input}
    for v in [v for v in graph.value_info if v.name not in named]:
        graph.value_info.remove(v)
    declared = {v.name for v in (*graph.value_info, *graph.output)}
    for n in made:
        elem = next(typed[t] for t in (*n.output, *n.input) if t in typed)
        graph.value_info.extend(helper.make_tensor_value_info(o, elem, None)
                                for o in n.output if o not in declared)  # fmt: skip
    read = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
    unread = {i for n in removed for i in n.input} - read - keep  # e.g. a norm's epsilon
    for t in [t for t in graph.initializer if t.name in unread]:
        graph.initializer.remove(t)
    model.functions.append(function)
    import_domain(model)


def fuse_add_rms_norms(model: onnx.ModelProto) -> int:
    """Replace each residual Add and the RMS norm reading its sum (:func:`_add_rms_norm`) by one
    ``FusedAddRMSNorm`` with both results, under the norm's and the Add's output names; the
    function body added once. A pair whose element type the graph does not declare stays.
    Returns the pairs fused."""
    g = _Graph(model.graph)
    typed = _element_types(model.graph)
    new: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for mul in model.graph.node:
        found = _add_rms_norm(g, mul) if mul.op_type == "Mul" else None
        if found is None or id(found["add"]) in drop:
            continue
        add = found["add"]
        inputs, outputs = [*add.input, found["weight"]], [mul.output[0], add.output[0]]
        if not any(t in typed for t in (*inputs, *outputs)):
            continue
        new[id(mul)] = [helper.make_node(FUSED_ADD_RMS_NORM, inputs, outputs,
                                         name=mul.name or mul.output[0], domain=DOMAIN,
                                         epsilon=found["epsilon"])]  # fmt: skip
        drop.update(id(n) for n in (add, *found["drop"]))
    if new:
        _apply(model, new, drop, fused_add_rms_norm_function())
    return len(new)


def silu_and_mul_function() -> onnx.FunctionProto:
    """SiluAndMul's portable body: ``gate * Sigmoid(gate) * up`` with ``gate, up`` the halves of
    ``x``'s last axis (ONNX Runtime fuses the first product into its QuickGelu)."""
    make = helper.make_node
    nodes = [
        *_halves("x", "gate", "up"),
        make("Sigmoid", ["gate"], ["sigmoid"]),
        make("Mul", ["gate", "sigmoid"], ["silu"]),
        make("Mul", ["silu", "up"], ["out"]),
    ]
    return helper.make_function(DOMAIN, SILU_AND_MUL, ["x"], ["out"], nodes,
                                [helper.make_opsetid("", BODY_OPSET)])  # fmt: skip


def _silu_and_mul(g: _Graph, mul: onnx.NodeProto) -> dict | None:
    """The parts of ``Mul(Mul(gate, Sigmoid(gate)), up)`` at ``mul`` (either operand order)
    with ``gate, up = Split(x)``, two equal parts of its last axis, else None."""
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
        if (sigmoid is None or sigmoid.input[0] != gate or _attr(split, "axis", 0) != -1
                or widths is None or len(widths) != 2 or widths[0] != widths[1]):  # fmt: skip
            continue
        gate_readers = sorted(id(n) for n in g.readers.get(gate, []))
        if gate in g.outputs or gate_readers != sorted((id(silu), id(sigmoid))):
            continue
        inner = [(up, mul), (sigmoid.output[0], silu), (silu.output[0], mul)]
        if all(g.only_reader(name, node) for name, node in inner):
            return {"x": split.input[0], "drop": [split, sigmoid, silu]}
    return None


def silu_and_muls(model: onnx.ModelProto) -> int:
    """Replace each SwiGLU on a packed gate and up product (:func:`_silu_and_mul`: the split of
    :mod:`tqexport.weights.graph`'s packed matrices) by one ``SiluAndMul`` under the product's
    output name; the function body added once. One whose element type the graph does not
    declare stays. Returns the SwiGLUs replaced."""
    g = _Graph(model.graph)
    typed = _element_types(model.graph)
    new: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for mul in model.graph.node:
        found = _silu_and_mul(g, mul) if mul.op_type == "Mul" else None
        if found is None or not {found["x"], mul.output[0]} & typed.keys():
            continue
        name = mul.name or mul.output[0]
        new[id(mul)] = [helper.make_node(SILU_AND_MUL, [found["x"]], [mul.output[0]], name=name,
                                         domain=DOMAIN)]  # fmt: skip
        drop.update(id(n) for n in found["drop"])
    if new:  # the packed matrices' widths stay: the reference splits them by these
        kept = {n.input[1] for n in model.graph.node if id(n) in drop and n.op_type == "Split"}
        _apply(model, new, drop, silu_and_mul_function(), frozenset(kept))
    return len(new)
