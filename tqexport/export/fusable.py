"""Rewrites of the exported graph into the forms ONNX Runtime's graph optimizer fuses.

torch exports ``x * rsqrt(mean(x^2) + eps)`` (every RMS norm of the models tqexport loads) as
``Sqrt -> Reciprocal -> Mul``; ORT fuses an RMS norm into one SimplifiedLayerNormalization node
only from ``Sqrt -> Div`` (ORT 1.32), so unrewritten each norm runs as seven small nodes.
"""

from __future__ import annotations

import onnx


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
