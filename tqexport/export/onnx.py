"""Export a loaded model with its per-layer spec to one ONNX graph.

Per attention layer the graph holds a ``tqexport::CacheWrite`` node (cache in -> cache out, the
output being the graph output) and a ``tqexport::PagedAttention`` node reading the written
cache. Both carry their layer's spec as attributes and ``plugin_namespace="tqexport"``; their
``overload`` names the model-local function body ORT runs. The spec JSON is embedded in
``metadata_props["tqexport.spec"]``.
"""

from __future__ import annotations

import onnx
import torch

from tqexport.contract.caches import allocate_caches
from tqexport.contract.files import set_spec_metadata
from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
from tqexport.export.block_fusions import fuse_add_rms_norms
from tqexport.export.functions import function_for, quiet_export
from tqexport.export.fusable import divide_by_roots, drop_batch_axis, rotate_halves
from tqexport.export.stack_traces import drop_stack_traces
from tqexport.models.paged import PagedCausalLM
from tqexport.ops.attributes import DOMAIN, import_domain
from tqexport.spec import DEFAULT_OPSET, ModelSpec, block_tables_name, slot_mapping_name


def _example(spec: ModelSpec):
    """Step inputs whose dynamic sizes are all distinct and >= 2 (0/1 would specialize). With
    blocks of one token the 4-token sequence needs 4 blocks: tables of 5, 11 blocks."""
    one = spec.block_size == 1
    row, row2 = ([1, 2, 3, 4, 5], [6, 7, 8, 0, 0]) if one else ([1, 2, 3], [4, 5, 0])
    tables = [list(row) for _ in spec.groups]
    other = [list(row2) for _ in spec.groups]
    chunks = [SeqChunk([1, 2, 3, 4], 0, tables, "all"), SeqChunk([5, 6, 7], 0, other, "none")]
    step = build_step(spec, chunks)
    # bounded groups' block counts differ from the others' so export keeps both dims apart
    blocks = (10, 11) if one else (6, 7)
    caches = allocate_caches(spec, [blocks[0] if g.bounded else blocks[1] for g in spec.groups])
    return step, caches


def _dynamic_shapes(spec: ModelSpec):
    dim = torch.export.Dim
    tokens, seqs, logits = dim("T"), dim("num_seqs"), dim("L")
    out = {
        "input_ids": {0: tokens},
        "positions": {0: tokens},
        "seq_lens": {0: seqs},
        "query_start_loc": {0: seqs + 1},
        "logits_indices": {0: logits},
    }
    for g in spec.groups:
        out[slot_mapping_name(g.id)] = {0: tokens}
        out[block_tables_name(g.id)] = {0: seqs, 1: dim(f"max_blocks_{g.id}")}
    blocks: dict[str, torch.export.Dim] = {}
    for layer in spec.layers:
        for role, _, b in layer.cache_tensors:
            out[layer.onnx_input(role)] = {0: blocks.setdefault(b.blocks_dim, dim(b.blocks_dim))}
    return out


def export_model(hf_model: torch.nn.Module, spec: ModelSpec, opset: int = DEFAULT_OPSET):
    """The ONNX ModelProto (weights inside) for ``spec``; function bodies and metadata added."""
    io = spec.graph_io()
    names_in = [x["name"] for x in io["inputs"]]
    names_out = [x["name"] for x in io["outputs"]]
    step, caches = _example(spec)
    inputs = ordered_inputs(spec, step, caches)
    dyn = _dynamic_shapes(spec)
    module = PagedCausalLM(hf_model, spec, mode="export")
    with quiet_export(), torch.no_grad():
        program = torch.onnx.export(
            module,
            tuple(inputs),
            dynamic_shapes=(tuple(dyn[n] for n in names_in),),
            input_names=names_in,
            output_names=names_out,
            dynamo=True,
            opset_version=opset,
            verbose=False,
        )
    model = program.model_proto
    drop_stack_traces(model)
    divide_by_roots(model)  # RMS norms ORT fuses into one node each
    attach_functions(model, opset)
    rotate_halves(model)  # after: RotateHalf brings its own body
    drop_batch_axis(model)  # after: takes RotateHalf's rows too
    fuse_add_rms_norms(model)  # after divide_by_roots: reads its Div form
    set_spec_metadata(model, spec)
    return model


def attach_functions(model: onnx.ModelProto, opset: int) -> None:
    """Give every tqexport node its overload and add one function body per variant."""
    seen: dict[tuple[str, str], None] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        node.overload = attrs["variant"]
        key = (node.op_type, attrs["variant"])
        if key in seen:
            continue
        seen[key] = None
        fn, extra = function_for(node.op_type, attrs, opset)
        model.functions.append(fn)
        model.functions.extend(extra)
    import_domain(model)
