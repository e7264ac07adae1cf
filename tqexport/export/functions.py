"""ONNX function bodies for the tqexport ops, generated from the reference implementation.

Each op variant (one set of static node attributes) gets a model-local FunctionProto in domain
``tqexport``, selected by the node's ``overload`` = its ``variant`` attribute. The body is the
reference op (:mod:`tqexport.ops.reference`) exported by torch.onnx to standard ops, so ONNX
Runtime computes exactly what the torch reference computes; TensorRT, with
``plugin_namespace="tqexport"``, swaps in a plugin instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from tqexport.export.stack_traces import drop_stack_traces
from tqexport.kvquant.codecs import MODEL_DTYPES, codec_for, torch_dtype
from tqexport.models.cache import cache_dir
from tqexport.ops import reference
from tqexport.ops.attributes import CACHE_WRITE, DOMAIN
from tqexport.safe_files import write_file


class _CacheWriteBody(torch.nn.Module):
    def __init__(self, codec):
        super().__init__()
        self.codec = codec

    def forward(self, *inputs):
        n = len(self.codec.tensors)
        cache, (k, v, slot_mapping) = list(inputs[:n]), inputs[n:]
        return tuple(reference.write_cache(self.codec, cache, k, v, slot_mapping))


class _PagedAttentionBody(torch.nn.Module):
    def __init__(self, codec, attrs):
        super().__init__()
        self.codec = codec
        self.attrs = attrs

    def forward(self, *inputs):
        n = len(self.codec.tensors)
        q, cache = inputs[0], list(inputs[1 : 1 + n])
        block_tables, seq_lens, query_start_loc, positions = inputs[1 + n : 5 + n]
        recent = list(inputs[5 + n :])  # recent K, recent V, recent block tables (or nothing)
        a = self.attrs
        return reference.paged_attention(
            self.codec,
            q,
            cache,
            block_tables,
            seq_lens,
            query_start_loc,
            positions,
            scale=a["scale"],
            softcap=a["softcap"] or None,
            window=a["window"] or None,
            recent_cache=recent[:2] or None,
            recent_block_tables=recent[2] if recent else None,
            recent_window=a.get("recent_window", 0),
            sink_tokens=a.get("sink_tokens", 0),
        )


def _example_cache(codec, attrs, num_blocks):
    lead = (num_blocks, attrs["block_size"], attrs["num_kv_heads"])
    return [torch.zeros(t.shape(*lead), dtype=torch_dtype(t.dtype)) for t in codec.tensors]


def _export_body(op: str, attrs: dict, opset: int) -> onnx.ModelProto:
    codec = codec_for(
        attrs["kv_cache_dtype"],
        attrs["head_size"],
        attrs["model_dtype"],
        attrs["k_scale"],
        attrs["v_scale"],
    )
    dt = MODEL_DTYPES[attrs["model_dtype"]]
    kvh, d = attrs["num_kv_heads"], attrs["head_size"]
    tokens, blocks = torch.export.Dim("T"), torch.export.Dim("num_blocks")
    seqs, max_blocks = torch.export.Dim("num_seqs"), torch.export.Dim("max_blocks")
    cache = _example_cache(codec, attrs, 5)
    cache_dyn = tuple({0: blocks} for _ in cache)
    if op == CACHE_WRITE:
        module = _CacheWriteBody(codec)
        args = (*cache, torch.zeros(3, kvh, d, dtype=dt), torch.zeros(3, kvh, d, dtype=dt))
        args = (*args, torch.tensor([1, 2, -1], dtype=torch.int64))
        dyn = (*cache_dyn, {0: tokens}, {0: tokens}, {0: tokens})
    else:
        module = _PagedAttentionBody(codec, attrs)
        q = torch.zeros(3, attrs["num_heads"], d, dtype=dt)
        args = (
            q,
            *cache,
            torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
            torch.tensor([2, 1], dtype=torch.int32),
            torch.tensor([0, 2, 3], dtype=torch.int32),
            torch.tensor([0, 1, 0], dtype=torch.int64),
        )
        # positions' length gets a symbol of its own: every step-level index the body derives
        # then reads shapes of step inputs only (never of q), so the layers' copies are
        # identical and ONNX Runtime's common-subexpression pass computes them once per step
        dyn = (
            {0: tokens},
            *cache_dyn,
            {0: seqs, 1: max_blocks},
            {0: seqs},
            {0: seqs + 1},
            {0: torch.export.Dim("step_tokens")},
        )
        if attrs.get("recent_window"):
            recent = [torch.zeros(4, attrs["block_size"], kvh, d, dtype=dt) for _ in range(2)]
            args = (*args, *recent, torch.tensor([[1, 2, 0], [3, 0, 0]], dtype=torch.int32))
            recent_blocks = torch.export.Dim("num_recent_blocks")
            recent_tables = {0: seqs, 1: torch.export.Dim("max_recent_blocks")}
            dyn = (*dyn, {0: recent_blocks}, {0: recent_blocks}, recent_tables)
    with quiet_export():
        program = torch.onnx.export(
            module, args, dynamic_shapes=(dyn,), dynamo=True, opset_version=opset, verbose=False
        )
    model = program.model_proto  # a fresh proto on each read
    drop_stack_traces(model)
    return model


@contextmanager
def quiet_export() -> Iterator[None]:
    """torch.onnx.export without its Python warnings and warning log lines ("torchvision is
    not installed. Skipping torchvision::nms"): noise to a user, printed ahead of whatever
    the command says next, an error line included. Its errors still raise."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


_SHAPE_ONLY = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _narrow_lookup_indices(graph: onnx.GraphProto) -> None:
    """Cast element-wise lookup indices to int32 instead of int64 (in place).

    ``torch.gather`` takes int64 indices only, so a table lookup of bytes exports as
    Cast(uint8 -> int64) -> Reshape -> GatherElements. ONNX's GatherElements also takes int32,
    and these indices are small (< 65536), so the Cast writes half the bytes; same values, same
    gather. Only a Cast whose every use is, through shape-only ops, a GatherElements index is
    changed.
    """
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))

    def only_indices(name: str, seen: list[str]) -> bool:
        uses = consumers.get(name, [])
        if not uses or name in {o.name for o in graph.output}:
            return False
        for n, i in uses:
            if n.op_type == "GatherElements" and i == 1:
                continue
            if n.op_type in _SHAPE_ONLY and i == 0 and only_indices(n.output[0], seen):
                seen.append(n.output[0])
                continue
            return False
        return True

    for n in graph.node:
        to = next((a for a in n.attribute if a.name == "to"), None)
        if n.op_type != "Cast" or to is None or to.i != onnx.TensorProto.INT64:
            continue
        renamed: list[str] = []
        if only_indices(n.output[0], renamed):
            to.i = onnx.TensorProto.INT32
            for info in graph.value_info:
                if info.name in (n.output[0], *renamed):
                    info.type.tensor_type.elem_type = onnx.TensorProto.INT32


def _constant_nodes(init: onnx.TensorProto) -> list[onnx.NodeProto]:
    """Nodes that produce initializer ``init`` inside a function body.

    Usually one Constant. A small integer tensor (an arange, a shape) is instead built from
    scalar constants (a Range, or a Concat of one-element constants, then a reshape): ONNX
    Runtime shares equal scalar constants between the inlined copies of a body but not equal
    tensors, and a node reading an unshared constant keeps the layers' copies of every
    step-level index computation from being merged into one by its common-subexpression pass.
    """
    arr = numpy_helper.to_array(init)
    if arr.dtype.kind not in "iu" or not 1 < arr.size <= 64:
        return [helper.make_node("Constant", [], [init.name], value=init)]
    name, flat = init.name, arr.reshape(-1)
    nodes = []

    def const(value, suffix, one_d=True, dtype=arr.dtype):
        out = f"{name}__{suffix}"
        value = np.array([value] if one_d else value, dtype=dtype)
        nodes.append(helper.make_node("Constant", [], [out],
                                      value=numpy_helper.from_array(value, out)))  # fmt: skip
        return out

    def concat(values, suffix, dtype=arr.dtype):
        parts = [const(v, f"{suffix}{i}", dtype=dtype) for i, v in enumerate(values)]
        out = f"{name}__{suffix}"
        nodes.append(helper.make_node("Concat", parts, [out], axis=0))
        return out

    target = name if arr.ndim == 1 else f"{name}__flat"
    steps = np.diff(flat)
    if (steps == steps[0]).all() and steps[0] != 0:  # an arange
        start, delta = const(flat[0], "start", False), const(steps[0], "delta", False)
        limit = const(flat[-1] + steps[0], "limit", False)
        nodes.append(helper.make_node("Range", [start, limit, delta], [target]))
    else:
        nodes.append(helper.make_node("Identity", [concat(flat, "e")], [target]))
    if arr.ndim != 1:
        shape = concat(arr.shape, "shape", dtype=np.int64)
        nodes.append(helper.make_node("Reshape", [target, shape], [name]))
    return nodes


#: serialized bodies exported in this process, by (op, variant, opset): a variant names exactly
#: the static parameters a body is specialized to, so a later build reuses the export
_EXPORTED: dict[tuple[str, str, int], bytes] = {}


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """What a body is exported by: every tqexport source file and the exporting libraries'
    versions (any change gives new keys, so a stale body is never read)."""
    h = hashlib.sha256(f"torch {torch.__version__} onnx {onnx.__version__}".encode())
    h.update(f" onnxscript {importlib.metadata.version('onnxscript')}".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _disk_path(op: str, attrs: dict, opset: int) -> Path:
    static = {k: v for k, v in attrs.items() if k not in ("layer", "plugin_namespace")}
    key = json.dumps([_code_digest(), op, opset, static], sort_keys=True)
    name = f"{attrs['variant']}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.onnx"
    return cache_dir() / "onnx-bodies" / op / name


def _cached_body(op: str, attrs: dict, opset: int) -> bytes:
    """The serialized single-function model of one variant: from this process, else from the
    cache directory (``TQEXPORT_CACHE``, shared by processes), else exported and stored there
    (written to a temporary name and renamed, so a reader never sees half a file)."""
    key = (op, attrs["variant"], opset)
    if key in _EXPORTED:
        return _EXPORTED[key]
    path = _disk_path(op, attrs, opset)
    try:
        data = path.read_bytes()
        functions = onnx.ModelProto.FromString(data).functions
        if not functions or functions[0].overload != attrs["variant"]:
            raise DecodeError("not this variant's body")  # a damaged file is exported again
    except (OSError, DecodeError):
        data = _function_model(op, attrs, opset).SerializeToString()
        try:
            write_file(path, data)
        except OSError:  # a read-only cache costs time, never a build
            pass
    _EXPORTED[key] = data
    return data


def function_for(op: str, attrs: dict, opset: int) -> tuple[onnx.FunctionProto, list]:
    """FunctionProto for one variant; also returns functions its body calls (usually none).
    Exported once per variant and tqexport version (torch.onnx export is most of a build's
    time), see :func:`_cached_body`; every call returns fresh copies."""
    model = onnx.ModelProto.FromString(_cached_body(op, attrs, opset))
    return model.functions[0], list(model.functions[1:])


def _function_model(op: str, attrs: dict, opset: int) -> onnx.ModelProto:
    """A model holding the variant's function, then the functions it calls."""
    fn, extra = _function_for(op, attrs, opset)
    return helper.make_model(helper.make_graph([], "body", [], []), functions=[fn, *extra])


def _function_for(op: str, attrs: dict, opset: int) -> tuple[onnx.FunctionProto, list]:
    model = _export_body(op, attrs, opset)
    _narrow_lookup_indices(model.graph)
    g = model.graph
    constants = [node for init in g.initializer for node in _constant_nodes(init)]
    # Attributes are declared so nodes may carry their whole spec; the body is specialized.
    declared = sorted(set(attrs) | {"variant", "layer", "plugin_namespace"})
    fn = helper.make_function(
        DOMAIN,
        op,
        [i.name for i in g.input],
        [o.name for o in g.output],
        constants + list(g.node),
        opset_imports=list(model.opset_import),
        attributes=declared,
        overload=attrs["variant"],
    )
    return fn, list(model.functions)
