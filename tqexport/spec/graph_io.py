"""The graph's input and output names, dtypes and symbolic shapes, derived from a spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqexport.kvquant.codecs import TensorFormat
    from tqexport.spec.layer import CacheBinding
    from tqexport.spec.model import ModelSpec


def slot_mapping_name(group: int) -> str:
    """The graph input holding each step token's cache slot in ``group`` (-1 = padding)."""
    return f"slot_mapping_{group}"


def block_tables_name(group: int) -> str:
    """The graph input holding every sequence's block table in ``group``."""
    return f"block_tables_{group}"


def symbolic_shape(b: CacheBinding, t: TensorFormat) -> list:
    """A cache tensor's shape with its block count by name: ``[num_blocks, bs, kvh(, X)]``."""
    lead = [b.blocks_dim, b.cache.block_size, b.cache.num_kv_heads]
    return lead + ([] if t.width is None else [t.width])


def io_entry(name: str, dtype: str, shape: list) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape}


def graph_io(spec: ModelSpec) -> dict[str, list[dict[str, Any]]]:
    """The graph's input/output contract: names, dtypes and symbolic shapes, in order."""
    vocab = spec.model.get("vocab_size", "vocab")
    inputs = [
        io_entry("input_ids", "int64", ["T"]),
        io_entry("positions", "int64", ["T"]),
        io_entry("seq_lens", "int32", ["num_seqs"]),
        io_entry("query_start_loc", "int32", ["num_seqs_plus_1"]),
        io_entry("logits_indices", "int64", ["L"]),
    ]
    for g in spec.groups:
        inputs.append(io_entry(slot_mapping_name(g.id), "int64", ["T"]))
        inputs.append(
            io_entry(block_tables_name(g.id), "int32", ["num_seqs", f"max_blocks_{g.id}"])
        )
    outputs = [io_entry("logits", "float32", ["L", vocab])]
    for layer in spec.layers:
        for role, t, b in layer.cache_tensors:
            shape = symbolic_shape(b, t)
            inputs.append(io_entry(layer.onnx_input(role), t.dtype, shape))
            outputs.append(io_entry(layer.onnx_output(role), t.dtype, shape))
    return {"inputs": inputs, "outputs": outputs}
