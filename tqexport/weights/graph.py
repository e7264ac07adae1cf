"""Stored weights into the exported graph: every stand-in node (:mod:`~tqexport.weights.
placeholders`) becomes standard ONNX over initializers of the stored precision.

- a block-quantized matrix read by a MatMul: ``DequantizeLinear`` of an INT4/INT8 initializer
  ``[K, N]`` in blocks along K (opset 21 blocked form, float32 scales) feeding the MatMul; ONNX
  Runtime fuses the pair into ``MatMulNBits`` at load, TensorRT reads it as weight-only
  quantization. A block offset (the min of GGUF's Q4_1/Q4_K/Q5_1/Q5_K blocks) is added by one
  ``tqexport.AddBlockOffsets`` node: the input's block sums times a float32 ``[K / block, N]``
  matrix, plus the product (a native kernel, or its function body here);
- matrices that alone read one input tensor with the same K, bits, block and offset presence
  (a layer's q, k, v; its gate and up) are stored as ONE such matrix, their codes, scales and
  offsets concatenated along N (initializers named by the members joined with
  :data:`PACK_SEP`), its product split back into theirs: fewer nodes for ORT to run;
- an embedding table ``[V, D]``: ``Gather`` of its rows and of their scales, then
  ``DequantizeLinear`` (4-bit tables are stored in 8-bit containers: Gather takes no INT4);
  an output head tied to it reads the same initializers through a ``Transpose``;
- a float16 matrix: the initializer cast to the model dtype (ORT folds the cast at load).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tqexport.ops.attributes import ADD_BLOCK_OFFSETS, BODY_OPSET, DOMAIN, import_domain
from tqexport.spec.weights import StoredTensor
from tqexport.weights.blocks import BlockWeight, pack_int4
from tqexport.weights.placeholders import GATHER, MATMUL, PLACEHOLDER_DOMAIN

#: what a build stores for a weight: blocks (decoded when the graph takes them) or a float16
#: array
Stored = Callable[[], "BlockWeight | np.ndarray"]

#: joins the names of the matrices packed into one (their initializers' common base name)
PACK_SEP = "+"
#: a packed matrix's int64 initializer of its members' widths along N (the Split's sizes)
WIDTHS = ".widths"
#: the prefix of the graph's own constants (index constants): no weight
INTERNAL = f"{PLACEHOLDER_DOMAIN}."


def members(base: str) -> list[str]:
    """The stored matrices whose initializers are named ``base`` (one unless packed)."""
    return base.split(PACK_SEP)


class _Emitter:
    def __init__(self, graph: onnx.GraphProto, model_dtype: int, data_file: Path | None):
        self.graph = graph
        self.dtype = model_dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.consts: dict[tuple, str] = {}
        self.functions: dict[str, onnx.FunctionProto] = {}
        self.data_file = data_file

    def node(self, op: str, inputs: list[str], out: str | list[str], **attrs) -> str:
        outs = [out] if isinstance(out, str) else out
        self.nodes.append(helper.make_node(op, inputs, outs, name=outs[0], **attrs))
        return outs[0]

    def init(self, name: str, array: np.ndarray, int4: bool = False) -> str:
        """Add ``array`` as an initializer (``int4``: its int8 values as INT4); with a data file
        its bytes go there now, a slice of rows at a time, and are never held whole twice."""
        data_type = TensorProto.INT4 if int4 else helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor = onnx.TensorProto(name=name, data_type=data_type, dims=array.shape)
        chunks = _chunks(array, int4)
        if self.data_file is None:
            tensor.raw_data = b"".join(chunks)
        else:
            with open(self.data_file, "ab") as f:
                offset = f.tell()
                for c in chunks:
                    f.write(c)
                length = f.tell() - offset
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data_file.name), ("offset", offset),
                               ("length", length)):  # fmt: skip
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
        self.inits.append(tensor)
        return name

    def const(self, values: list[int]) -> str:
        key = tuple(values)
        if key not in self.consts:
            name = f"{INTERNAL}const.{len(self.consts)}"
            self.inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
            self.consts[key] = name
        return self.consts[key]

    def add_block_offsets(self, x: str, y: str, offsets: str, block: int, out: str) -> str:
        """``out = y + (x's sums over blocks of block) @ offsets``: one tqexport node (native
        kernel, or its function body), the body added to the model once per block size."""
        overload = f"block_size_{block}"
        self.functions.setdefault(overload, block_offsets_function(block, overload))
        node = helper.make_node(ADD_BLOCK_OFFSETS, [x, y, offsets], [out], name=out, domain=DOMAIN,
                                block_size=block)  # fmt: skip
        node.overload = overload
        self.nodes.append(node)
        # a custom op's output type is not inferred: declared here, the model's float type
        self.graph.value_info.append(helper.make_tensor_value_info(out, self.dtype, None))
        return out


def block_offsets_function(block: int, overload: str) -> onnx.FunctionProto:
    """AddBlockOffsets' portable body for blocks of ``block``: ``x`` reshaped to ``[..., K /
    block, block]``, summed over the last axis, times ``offsets`` (cast to ``x``'s type), plus
    ``y``."""
    nodes = [
        helper.make_node("Constant", [], ["tail"], value_ints=[-1, block]),
        helper.make_node("Constant", [], ["last"], value_ints=[-1]),
        helper.make_node("Shape", ["x"], ["lead"], end=-1),
        helper.make_node("Concat", ["lead", "tail"], ["blocked"], axis=0),
        helper.make_node("Reshape", ["x", "blocked"], ["xb"]),
        helper.make_node("ReduceSum", ["xb", "last"], ["sums"], keepdims=0),
        helper.make_node("CastLike", ["offsets", "x"], ["m"]),
        helper.make_node("MatMul", ["sums", "m"], ["share"]),
        helper.make_node("Add", ["y", "share"], ["out"]),
    ]
    return helper.make_function(DOMAIN, ADD_BLOCK_OFFSETS, ["x", "y", "offsets"], ["out"], nodes,
                                [helper.make_opsetid("", BODY_OPSET)], ["block_size"],
                                overload=overload)  # fmt: skip


#: elements written per slice of a large initializer
_CHUNK = 1 << 24


def _chunks(array: np.ndarray, int4: bool):
    """``array``'s raw bytes (row-major) in slices of whole rows (an even element count each
    where it is packed as INT4, so no byte straddles two slices)."""
    rows = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
    width = max(1, rows.shape[1])
    step = max(1, _CHUNK // width)
    step += step % 2 if int4 and width % 2 else 0
    for r in range(0, rows.shape[0], step):
        part = np.ascontiguousarray(rows[r : r + step])
        yield pack_int4(part) if int4 else part.tobytes()


class _Weight:
    """One stored weight's initializers, made on first use in the layout its readers need."""

    def __init__(self, name: str, value: BlockWeight | np.ndarray, rows_layout: bool,
                 em: _Emitter):  # fmt: skip
        self.name, self.em = name, em
        self.dense = isinstance(value, np.ndarray)
        self.rows = rows_layout
        self.k = value.shape[1]
        if self.dense:
            self.record = StoredTensor(name, "fp16", None, "fp16")
            w = value if rows_layout else value.T
            self.data = em.init(f"{name}.fp16", w.astype(np.float16, copy=False))
            return
        bits = 8 if rows_layout and value.bits == 4 else value.bits  # Gather takes no INT4
        self.block, self.bits = value.block, bits
        self.record = StoredTensor(name, f"int{bits}", value.block, value.source)
        t = (lambda a: a) if rows_layout else (lambda a: a.T)
        self.codes = em.init(f"{name}.codes", t(value.codes), int4=bits == 4)
        self.scale = em.init(f"{name}.scale", t(value.scale).astype(np.float32, copy=False))
        self.offset = None
        if value.offset is not None:
            self.offset = em.init(f"{name}.offset", t(value.offset).astype(np.float32, copy=False))
        self._transposed: tuple | None = None

    def kn(self) -> tuple[str, str, str | None]:
        """(codes, scale, offset) laid out ``[K, N]`` for a MatMul."""
        if not self.rows:
            return self.codes, self.scale, self.offset
        if self._transposed is None:  # emitted before the first reader, shared by the others
            parts = [self.codes, self.scale] + ([self.offset] if self.offset else [])
            out = [self.em.node("Transpose", [p], f"{p}.T", perm=[1, 0]) for p in parts]
            self._transposed = (out[0], out[1], out[2] if self.offset else None)
        return self._transposed


def _block_matmul(em: _Emitter, kn: tuple[str, str, str | None], block: int, x: str, y: str,
                  dq: str) -> None:  # fmt: skip
    """``y = x @ W`` for the blocks ``kn`` (codes, scales, offsets ``[K, N]``): the MatMul of
    their DequantizeLinear (output ``dq``), plus block sums times offsets where there are any."""
    codes, scale, offset = kn
    dq = em.node("DequantizeLinear", [codes, scale], dq, axis=0, block_size=block)
    if offset is None:
        em.node("MatMul", [x, dq], y)
        return
    em.add_block_offsets(x, em.node("MatMul", [x, dq], f"{y}.main"), offset, block, y)


def _matmul(em: _Emitter, w: _Weight, x: str, y: str, tag: str) -> None:
    if w.dense:
        data = w.data if not w.rows else em.node("Transpose", [w.data], f"{w.data}.T{tag}",
                                                  perm=[1, 0])  # fmt: skip
        cast = em.node("Cast", [data], f"{w.name}.cast{tag}", to=em.dtype)
        em.node("MatMul", [x, cast], y)
        return
    _block_matmul(em, w.kn(), w.block, x, y, f"{w.name}.dq{tag}")


def _pack_key(name: str, value: BlockWeight | np.ndarray) -> tuple:
    """Matrices reading one input with equal keys are packed into one: blocks of the same K,
    bits, block and offset presence; a float16 matrix's key is its own name (never packed)."""
    if isinstance(value, np.ndarray):
        return (name,)
    return value.shape[1], value.bits, value.block, value.offset is None


def _packed(em: _Emitter, names: list[str], values: list[BlockWeight], x: str,
            ys: list[str]) -> list[StoredTensor]:  # fmt: skip
    """``ys[i] = x @ values[i].T`` as one product over the matrices concatenated along N, split
    back; the group (a few matrices) is held at once while its initializers are written."""
    base = PACK_SEP.join(names)
    first = values[0]

    def cat(parts):
        return np.concatenate(parts, axis=0).T

    codes = em.init(f"{base}.codes", cat([v.codes for v in values]), int4=first.bits == 4)
    scale = em.init(f"{base}.scale", cat([v.scale.astype(np.float32) for v in values]))
    offset = None
    if first.offset is not None:
        offset = em.init(f"{base}.offset", cat([v.offset.astype(np.float32) for v in values]))
    widths = np.array([v.shape[0] for v in values], np.int64)  # in the graph, not the data
    em.inits.append(numpy_helper.from_array(widths, f"{base}{WIDTHS}"))  # file: shape inference
    y = f"{ys[0]}.packed"
    _block_matmul(em, (codes, scale, offset), first.block, x, y, f"{y}.dq")
    em.node("Split", [y, f"{base}{WIDTHS}"], ys, axis=-1)
    return [
        StoredTensor(n, f"int{v.bits}", v.block, v.source)
        for n, v in zip(names, values, strict=True)
    ]


def _emit_group(em: _Emitter, group: list[tuple[str, str]], weights: Mapping[str, Stored],
                x: str, tag: str) -> dict[str, StoredTensor]:  # fmt: skip
    """The matrices ``group`` ((weight, output) of the stand-ins that alone read each, all
    reading ``x``): those that match are packed, the others stored one by one."""
    values = {name: weights[name]() for name, _ in group}
    kinds: dict[tuple, list[tuple[str, str]]] = {}
    for name, y in group:
        kinds.setdefault(_pack_key(name, values[name]), []).append((name, y))
    records = {}
    for same in kinds.values():
        if len(same) == 1:
            ((name, y),) = same
            w = _Weight(name, values[name], False, em)
            _matmul(em, w, x, y, tag)
            records[name] = w.record
            continue
        names = [n for n, _ in same]
        out = _packed(em, names, [values[n] for n in names], x, [y for _, y in same])
        records.update(zip(names, out, strict=True))
    return records


def _gather(em: _Emitter, w: _Weight, ids: str, y: str, tag: str) -> None:
    flat = em.node("Reshape", [ids, em.const([-1])], f"{y}.ids")
    if w.dense:
        rows = em.node("Gather", [w.data, flat], f"{y}.rows16", axis=0)
        rows = em.node("Cast", [rows], f"{y}.rows", to=em.dtype)
    else:
        codes = em.node("Gather", [w.codes, flat], f"{y}.codes", axis=0)
        scale = em.node("Gather", [w.scale, flat], f"{y}.scale", axis=0)
        rows = em.node("DequantizeLinear", [codes, scale], f"{y}.rows", axis=1,
                       block_size=w.block)  # fmt: skip
        if w.offset is not None:
            off = em.node("Gather", [w.offset, flat], f"{y}.off", axis=0)
            off = em.node("Unsqueeze", [off, em.const([-1])], f"{y}.off3")
            split = em.node("Reshape", [rows, em.const([-1, w.k // w.block, w.block])],
                            f"{y}.rows3")  # fmt: skip
            rows = em.node("Add", [split, off], f"{y}.rows3o")
            rows = em.node("Reshape", [rows, em.const([-1, w.k])], f"{y}.rowso")
    lead = em.node("Shape", [ids], f"{y}.idshape")
    shape = em.node("Concat", [lead, em.const([w.k])], f"{y}.shape", axis=0)
    em.node("Reshape", [rows, shape], y)


def store_weights(model: onnx.ModelProto, weights: Mapping[str, Stored],
                  model_dtype: int = TensorProto.FLOAT,
                  data_file: Path | None = None) -> list[StoredTensor]:  # fmt: skip
    """Replace every stand-in node of ``model`` by standard ops over the initializers of its
    stored weight (loaded once each, in graph order); returns how each weight is stored. The
    MatMul stand-ins that alone read their weights and share an input are replaced together
    (matching ones packed) at the first of them. With ``data_file`` (the external data file
    the model is saved beside), each weight's bytes are appended there as it is made, so no
    more than one weight (or one input's group of them) is held in memory."""
    graph = model.graph
    stand_ins = [n for n in graph.node if n.domain == PLACEHOLDER_DOMAIN]
    attrs = {id(n): {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in stand_ins}
    name_of = {id(n): attrs[id(n)]["weight"].decode() for n in stand_ins}
    missing = sorted(set(name_of.values()) - set(weights))
    if missing:
        raise KeyError(f"no stored weight for {missing[:3]}")
    gathered = {name_of[id(n)] for n in stand_ins if n.op_type == GATHER}
    readers = Counter(name_of.values())
    sole = {id(n) for n in stand_ins if n.op_type == MATMUL and readers[name_of[id(n)]] == 1}
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for n in stand_ins:
        if id(n) in sole:
            by_input.setdefault(n.input[0], []).append(n)
    em = _Emitter(graph, model_dtype, data_file)
    made: dict[str, _Weight] = {}
    records: dict[str, StoredTensor] = {}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for i, n in enumerate(stand_ins):
        if id(n) in replaced:
            continue
        name, start = name_of[id(n)], len(em.nodes)
        if id(n) in sole:
            group = by_input[n.input[0]]
            pairs = [(name_of[id(m)], m.output[0]) for m in group]
            records.update(_emit_group(em, pairs, weights, n.input[0], f".{i}"))
            replaced.update({id(m): [] for m in group})
        else:
            if name not in made:
                made[name] = _Weight(name, weights[name](), name in gathered, em)
                records[name] = made[name].record
            reader = _matmul if n.op_type == MATMUL else _gather
            reader(em, made[name], n.input[0], n.output[0], f".{i}")
        replaced[id(n)] = em.nodes[start:]
    nodes = []
    for n in graph.node:
        nodes += replaced.get(id(n), [n])
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(em.inits)
    model.functions.extend(em.functions.values())
    for imp in list(model.opset_import):
        if imp.domain == PLACEHOLDER_DOMAIN:
            model.opset_import.remove(imp)
    if em.functions:
        import_domain(model)
    return [records[name] for name in dict.fromkeys(name_of[id(n)] for n in stand_ins)]


#: the suffixes of one stored matrix's initializers (codes first: it decides the precision)
_PARTS = (".codes", ".scale", ".offset", ".fp16")
_ELEMENT_BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.INT8: 8,
                 TensorProto.UINT8: 8, TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16,
                 TensorProto.FLOAT: 32, TensorProto.INT64: 64, TensorProto.INT32: 32}  # fmt: skip
_PRECISION = {TensorProto.INT4: "int4", TensorProto.INT8: "int8", TensorProto.FLOAT16: "fp16"}


def weight_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes the graph's initializers take by precision: a stored matrix's scales and offsets
    count with its codes; everything else by its own element type (``fp32``: the float
    matrices, norms and biases; the graph's own constants count nowhere)."""
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, int] = {}
    for name, t in inits.items():
        if name.startswith(INTERNAL):
            continue
        size = int(np.prod(t.dims, dtype=np.int64)) * _ELEMENT_BITS.get(t.data_type, 32) // 8
        base = next((name[: -len(s)] for s in _PARTS if name.endswith(s)), None)
        codes = inits.get(f"{base}.codes") if base else None
        kind = (codes or t).data_type if base else t.data_type
        label = _PRECISION.get(kind, "fp32" if kind == TensorProto.FLOAT else None)
        if label is not None:  # not a packed matrix's widths
            out[label] = out.get(label, 0) + size
    return out


def _unpack_int4(raw: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(raw, np.uint8)
    both = np.stack([b & 15, b >> 4], axis=-1).reshape(-1)[:count].astype(np.int8)
    return np.where(both > 7, both - 16, both).astype(np.int8)


def _array(t: onnx.TensorProto) -> np.ndarray:
    if t.data_type == TensorProto.INT4:
        count = int(np.prod(t.dims, dtype=np.int64))
        return _unpack_int4(t.raw_data, count).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def read_stored(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every stored matrix of a built graph (external data loaded), dequantized to float32 in
    its parameter's layout ``[N, K]`` (a packed matrix split back into its members): what the
    torch reference computes with, so it and ONNX Runtime hold the same weights."""
    inits = {t.name: t for t in model.graph.initializer}
    gathered = {i for n in model.graph.node if n.op_type == "Gather" for i in n.input[:1]}
    block_of = {
        n.input[0]: next(a.i for a in n.attribute if a.name == "block_size")
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute)
    }
    out = {}
    for name, t in inits.items():
        if name.endswith(".fp16"):
            w = numpy_helper.to_array(t).astype(np.float32)
            out[name[:-5]] = w if name in gathered else w.T
        if not name.endswith(".codes"):
            continue
        base = name[: -len(".codes")]
        codes, scale = _array(t), numpy_helper.to_array(inits[f"{base}.scale"])
        offset = inits.get(f"{base}.offset")
        offset = None if offset is None else numpy_helper.to_array(offset)
        if name not in gathered:  # [K, N] as the MatMul reads it
            codes, scale = codes.T, scale.T
            offset = None if offset is None else offset.T
        block = codes.shape[1] // scale.shape[1]
        block = block_of.get(name, block)
        w = BlockWeight(np.ascontiguousarray(codes), np.ascontiguousarray(scale), 8, block,
                        None if offset is None else np.ascontiguousarray(offset), "")  # fmt: skip
        dense = w.dequantize()
        names = members(base)
        if len(names) == 1:
            out[base] = dense
            continue
        widths = numpy_helper.to_array(inits[f"{base}{WIDTHS}"])
        parts = np.split(dense, np.cumsum(widths)[:-1], axis=0)
        out.update((n, np.ascontiguousarray(p)) for n, p in zip(names, parts, strict=True))
    return out


def weights_summary(model_file: Path, weights) -> dict:
    """An artifact's weight bytes by precision (read from its graph, largest first) and how ORT
    runs them (``weights``: its spec's weights, None for a spec without)."""
    graph = onnx.load(str(model_file), load_external_data=False)
    sizes = dict(sorted(weight_bytes(graph).items(), key=lambda kv: -kv[1]))
    default = None if weights is None else weights.default
    return {
        "bytes": sizes,
        "accuracy_level": None if weights is None else weights.accuracy_level,
        "default": None if default is None else default.to_dict(),
    }
