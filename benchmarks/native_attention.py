"""Thread CPU time of one native PagedAttention node (one decode step of one layer).

The shapes of SmolLM2's layers by default (9 query heads over 3 kv heads of 64, blocks of 16;
``--shape`` gives others, e.g. 14x2x64 for Qwen2.5 Coder 0.5B): B sequences
with C cached tokens each, one query per sequence, each sequence's blocks contiguous as
``peers_speed.py`` lays them out (``--scatter``: a random permutation, as a long-running server's
recycled blocks lie). Caches are filled by the native CacheWrite from normal keys and values.
The session has one intra-op thread, so the node runs on the calling thread and its thread CPU
time is the kernel's work (a loaded machine stretches wall time, not CPU time); the minimum of
``--repeats`` runs is printed per kv dtype.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from tqexport.native import build as native_build
from tqexport.ops.attributes import (
    CACHE_WRITE,
    DOMAIN,
    DOMAIN_VERSION,
    PAGED_ATTENTION,
    cache_write_attrs,
)
from tqexport.spec import KVCacheSpec

ONNX_TYPES = {"float32": TensorProto.FLOAT, "uint8": TensorProto.UINT8,
              "int32": TensorProto.INT32, "int64": TensorProto.INT64}  # fmt: skip


def session(op: str, attrs: dict, inputs: dict, outputs: dict, library: str, threads: int):
    """A session of one ``op`` node: graph inputs/outputs name -> (element type, rank)."""
    node = helper.make_node(op, list(inputs), list(outputs), domain=DOMAIN)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())

    def info(n, t):
        return helper.make_tensor_value_info(n, ONNX_TYPES[t[0]], [None] * t[1])

    graph = helper.make_graph([node], "g", [info(n, t) for n, t in inputs.items()],
                              [info(n, t) for n, t in outputs.items()])  # fmt: skip
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])  # fmt: skip
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def measure(dtype: str, context: int, batch: int, repeats: int, scatter: bool,
            libraries: list[str], threads: int, shape=(9, 3, 64)) -> list[float]:  # fmt: skip
    """Fastest thread CPU ms of one PagedAttention step at ``dtype``, per library (their runs
    interleaved, so a change of load hits them alike; the caches written by the first)."""
    library = libraries[0]
    (heads, kvh, d), bs = shape, 16
    spec = KVCacheSpec(kv_cache_dtype=dtype, num_kv_heads=kvh, head_size=d, block_size=bs,
                       model_dtype="float32")  # fmt: skip
    rng = np.random.default_rng(0)
    per_seq = -(-(context + 1) // bs)
    num_blocks = 1 + batch * per_seq
    shapes = spec.tensor_shapes(num_blocks)
    caches = [
        np.zeros(s, dtype=t.dtype) for t, s in zip(spec.tensors, shapes.values(), strict=True)
    ]
    ids = 1 + (rng.permutation(num_blocks - 1) if scatter else np.arange(num_blocks - 1))
    tables = ids.reshape(batch, per_seq).astype(np.int32)
    write_attrs = cache_write_attrs(spec)
    cache_io = {f"c{i}": (str(c.dtype), c.ndim) for i, c in enumerate(caches)}
    writer = session(CACHE_WRITE, write_attrs,
                     {**cache_io, "k": ("float32", 3), "v": ("float32", 3), "slots": ("int64", 1)},
                     {f"o{i}": t for i, t in enumerate(cache_io.values())}, library, 2)  # fmt: skip
    slots = (tables[:, :, None] * bs + np.arange(bs)).reshape(batch, -1)[:, :context].ravel()
    k, v = (rng.standard_normal((len(slots), kvh, d), np.float32) for _ in "kv")
    binding = writer.io_binding()
    values = [ort.OrtValue.ortvalue_from_numpy(c) for c in caches]
    for i, value in enumerate(values):
        binding.bind_ortvalue_input(f"c{i}", value)
        binding.bind_ortvalue_output(f"o{i}", value)
    for n, x in (("k", k), ("v", v), ("slots", slots.astype(np.int64))):
        binding.bind_cpu_input(n, x)
    writer.run_with_iobinding(binding)
    attrs = {**write_attrs, "num_heads": heads, "scale": d**-0.5, "layer": 0}
    step = {"tables": tables, "lens": np.full(batch, context, np.int32),
            "starts": np.arange(batch + 1, dtype=np.int32),
            "positions": np.full(batch, context - 1, np.int64)}  # fmt: skip
    attention = [session(PAGED_ATTENTION, attrs, {"q": ("float32", 3), **cache_io,
                         **{n: (str(x.dtype), x.ndim) for n, x in step.items()}},
                         {"out": ("float32", 3)}, lib, threads) for lib in libraries]  # fmt: skip
    feed = {"q": rng.standard_normal((batch, heads, d), np.float32),
            **dict(zip(cache_io, caches, strict=True)), **step}  # fmt: skip
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = [float("inf")] * len(libraries)
    for _ in range(repeats + 1):
        for i, sess in enumerate(attention):
            t0 = clock()
            sess.run(None, feed)
            best[i] = min(best[i], clock() - t0)
    return [b * 1000 for b in best]


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", default="auto,fp8,turboquant_4bit_nc")
    ap.add_argument("--points", default="1024x1,1024x8,4096x1,4096x8", help="CONTEXTxBATCH,...")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="above 1: wall time, not CPU time")
    ap.add_argument("--scatter", action="store_true")
    ap.add_argument("--shape", default="9x3x64", help="HEADSxKV_HEADSxHEAD_SIZE")
    ap.add_argument(
        "--baseline",
        help="another build of the library (say, of the previous commit): timed beside this "
        "checkout's, interleaved, as 'before / after'",
    )
    args = ap.parse_args(argv)
    libraries = [*([args.baseline] if args.baseline else []), str(native_build.build().library)]
    print(f"kernel ISA cap: {os.environ.get('TQEXPORT_NATIVE_ISA') or 'none'}; "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    dtypes = args.dtypes.split(",")
    shape = tuple(int(x) for x in args.shape.split("x"))
    print("| point | " + " | ".join(f"{d} ms" for d in dtypes) + " |")
    print("|---" * (len(dtypes) + 1) + "|")
    for point in args.points.split(","):
        c, b = (int(x) for x in point.split("x"))
        cells = []
        for d in dtypes:
            ms = measure(d, c, b, args.repeats, args.scatter, libraries, args.threads, shape)
            ratio = f" ({ms[0] / ms[-1]:.2f}x)" if len(ms) > 1 else ""
            cells.append(" / ".join(f"{m:.2f}" for m in ms) + ratio)
        print(f"| {point} | " + " | ".join(cells) + " |", flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
