"""Tools of the graph rewrites (:mod:`tqexport.export.fusable`,
:mod:`tqexport.export.block_fusions`): an index of a graph's producers, readers and constants,
the splice of a rewrite into the graph in topological order, and the half-slicing nodes two
function bodies share."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tqexport.ops.attributes import import_domain


def halves(x: str, first: str, second: str) -> list[onnx.NodeProto]:
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


class GraphIndex:
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


def node_attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def spliced(
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


def element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The element type of every tensor the graph declares (value infos, inputs, outputs,
    initializers)."""
    typed = {v.name: v.type.tensor_type.elem_type
             for v in (*graph.value_info, *graph.input, *graph.output)}  # fmt: skip
    typed.update((t.name, t.data_type) for t in graph.initializer)
    return {k: v for k, v in typed.items() if v}


def apply_rewrite(model: onnx.ModelProto, new: dict[int, list[onnx.NodeProto]], drop: set[int],
           function: onnx.FunctionProto, keep: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """Splice a rewrite into the main graph (:func:`spliced`), declare its new nodes' outputs
    (ORT infers no custom op's type), drop the value infos of tensors gone and the initializers
    only removed nodes read (but those in ``keep``), and add ``function`` with the tqexport
    domain's import."""
    graph = model.graph
    typed = element_types(graph)
    removed = [n for n in graph.node if id(n) in drop or id(n) in new]
    made = [m for n in graph.node if id(n) in new for m in new[id(n)]]
    nodes = spliced(graph, new, drop)
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


#: what a rewrite's matcher finds at a node: the node replacing it, the other nodes that node
#: replaces, and the initializers those read that stay in the graph
Match = tuple[onnx.NodeProto, list[onnx.NodeProto], frozenset[str]]


def fuse(model: onnx.ModelProto, op: str, match: Callable[[GraphIndex, onnx.NodeProto],
         Match | None], function: onnx.FunctionProto) -> int:  # fmt: skip
    """Replace each ``op`` node of the main graph where ``match`` finds its form by the node it
    makes (see :data:`Match`), through :func:`apply_rewrite` with ``function`` added once. A
    match none of whose tensors the graph types, or that overlaps an earlier one, is left as
    it is. Returns the replacements."""
    g = GraphIndex(model.graph)
    typed = element_types(model.graph)
    new: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    keep: set[str] = set()
    for node in model.graph.node:
        found = match(g, node) if node.op_type == op else None
        if found is None:
            continue
        made, replaced, kept = found
        if any(id(n) in drop for n in replaced):
            continue
        if not any(t in typed for t in (*made.input, *made.output)):
            continue
        new[id(node)] = [made]
        drop.update(id(n) for n in replaced)
        keep |= kept
    if new:
        apply_rewrite(model, new, drop, function, frozenset(keep))
    return len(new)
