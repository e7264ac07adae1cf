"""Rewrites of the exported graph into fewer nodes: forms ONNX Runtime's graph optimizer fuses,
and tqexport nodes (with their function bodies) for what it does not.

torch exports ``x * rsqrt(mean(x^2) + eps)`` (every RMS norm of the models tqexport loads) as
``Sqrt -> Reciprocal -> Mul``; ORT fuses an RMS norm into one SimplifiedLayerNormalization node
only from ``Sqrt -> Div`` (ORT 1.32), so unrewritten each norm runs as seven small nodes. A
rotary embedding's rotate-half (two Slices, Neg, Concat, two Muls, Add per query and key) has no
ORT fusion outside its contrib attention ops: it becomes one ``RotateHalf``. The export's batch
axis of one (HF's ``[1, T, ...]`` around the attention, which reads ``[T, ...]``) costs a
Gather per query, key and value and an Unsqueeze per output: they fold into the Reshapes beside.
A decoder block's residual norms and SwiGLUs: :mod:`tqexport.export.block_fusions`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tqexport.export.graph_edit import GraphIndex, halves, node_attr, spliced
from tqexport.ops.attributes import BODY_OPSET, DOMAIN, ROTATE_HALF, import_domain


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


def rotate_half_function() -> onnx.FunctionProto:
    """RotateHalf's portable body: ``x * cos + concat(-x[..., h:], x[..., :h]) * sin`` over
    the last axis of ``D = 2h``, the unfused ops every ONNX runtime runs."""
    make = helper.make_node
    nodes = [
        *halves("x", "x1", "x2"),
        make("Neg", ["x2"], ["minus_x2"]),
        make("Concat", ["minus_x2", "x1"], ["rotated"], axis=-1),
        make("Mul", ["x", "cos"], ["x_cos"]),
        make("Mul", ["rotated", "sin"], ["rotated_sin"]),
        make("Add", ["x_cos", "rotated_sin"], ["out"]),
    ]
    return helper.make_function(DOMAIN, ROTATE_HALF, ["x", "cos", "sin"], ["out"], nodes,
                                [helper.make_opsetid("", BODY_OPSET)])  # fmt: skip


def _rotary(g: GraphIndex, add: onnx.NodeProto) -> dict | None:
    """The parts of ``Add(Mul(x, cos), Mul(Concat(Neg(x[..., h:]), x[..., :h]), sin))`` at
    ``add`` with ``x = Transpose(v, [0, 2, 1, 3])`` and cos, sin ``Unsqueeze(c, [1])``
    (HF's rotate-half rotary on ``[B, H, T, D]``, as torch exports it), else None."""
    muls = [g.made_by(i, "Mul") for i in add.input]
    if len(add.input) != 2 or None in muls:
        return None
    for plain, turned in (muls, muls[::-1]):
        for ci, cat_in in enumerate(turned.input):
            cat = g.made_by(cat_in, "Concat")
            if cat is None or len(cat.input) != 2 or node_attr(cat, "axis") not in (-1, 3):
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
            if turn is None or list(node_attr(turn, "perm", [])) != _HEADS_FIRST or None in lifts:
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
    g = GraphIndex(graph)
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
    nodes = spliced(graph, new, drop)
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


def _first_row(g: GraphIndex, turn_back: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Gather at ``Transpose(Gather(Transpose(y, [0, 2, 1, 3]), 0, axis=0), [1, 0, 2])``
    ending in ``turn_back``, which is ``y[0]`` (how the attention takes its query, key and
    value from HF's layout), else None."""
    if turn_back.op_type != "Transpose" or list(node_attr(turn_back, "perm", [])) != _TOKENS_FIRST:
        return None
    gather = g.made_by(turn_back.input[0], "Gather")
    if gather is None or node_attr(gather, "axis", 0) != 0 or not g.only_reader(gather.output[0],
                                                                           turn_back):  # fmt: skip
        return None
    index = g.values.get(gather.input[1])
    turn = g.made_by(gather.input[0], "Transpose")
    if index is None or index.ndim != 0 or int(index) != 0 or turn is None:
        return None
    if list(node_attr(turn, "perm", [])) != _HEADS_FIRST:
        return None
    if not g.only_reader(turn.output[0], gather):
        return None
    return gather


def _row_shape(g: GraphIndex, reshape: onnx.NodeProto | None) -> list[int] | None:
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
    g = GraphIndex(graph)
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
    nodes = spliced(graph, new, drop)
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
