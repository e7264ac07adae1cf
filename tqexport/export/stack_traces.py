"""torch.onnx records each node's Python stack trace, which names files by their absolute path on
the build machine: dropped, so an artifact holds no local paths and the same build gives the
same bytes in any checkout or virtual environment (the node's other metadata stays)."""

from __future__ import annotations

import onnx

STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(model: onnx.ModelProto) -> int:
    """Remove the stack-trace entry from every node of the graph and of its functions, in
    subgraphs too; returns how many entries went."""
    dropped = 0

    def visit(nodes) -> None:
        nonlocal dropped
        for node in nodes:
            kept = [p for p in node.metadata_props if p.key != STACK_TRACE_KEY]
            if len(kept) != len(node.metadata_props):
                dropped += len(node.metadata_props) - len(kept)
                del node.metadata_props[:]
                node.metadata_props.extend(kept)
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g.node)
                for g in attr.graphs:
                    visit(g.node)

    visit(model.graph.node)
    for fn in model.functions:
        visit(fn.node)
    return dropped
