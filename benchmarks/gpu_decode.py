"""Paged decode on a CUDA GPU: achieved bandwidth of the Triton kernel per kv dtype.

For context 1k..32k and batch 1..32, each mode's cache (head 128, 8 kv heads, 32 query heads,
block 16) is filled by the Triton cache-write kernel; one decode step (one query per sequence)
is timed with CUDA events, L2 flushed (a 256 MiB write) before every timing. Printed per row:
kernel time, bytes the kernel must read (cache slots of the visible context + queries), GB/s,
fraction of the device's peak (``--peak-tbs``, H200 4.8), and time ratios against the
unquantized fp16 kernel and against torch SDPA on a contiguous fp16 cache, in the same run.
A mode ``<dtype>+recent<N>`` also keeps the last N tokens in an fp16 recent cache paged by its
own table (older logical blocks recycled to the null block), as the recent window does.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tqexport.kvquant.codecs import make_codec, torch_dtype
from tqexport.ops.triton.cache_write import write_cache_
from tqexport.ops.triton.paged_attention import paged_attention

MODES = [
    "float16",
    "fp8",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_3bit_nc",
    "turboquant_4bit_nc+recent32",
]
HEADS, KV_HEADS, D, BS = 32, 8, 128, 16


def timed(fn, flush, repeats=5):
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return min(times)


def setup(mode, context, batch, device="cuda"):
    """(codec, cache, paged_attention args and kwargs, bytes the kernel must read)."""
    mode, _, recent = mode.partition("+recent")
    window = int(recent or 0)
    codec = make_codec(mode, D, model_dtype="float16")
    per_seq = -(-context // BS)
    blocks = 1 + batch * per_seq
    cache = [
        torch.zeros((blocks, BS, KV_HEADS) + ((t.width,) if t.width else ()),
                    dtype=torch_dtype(t.dtype), device=device)
        for t in codec.tensors
    ]  # fmt: skip
    slots = torch.arange(BS, BS + batch * per_seq * BS, device=device)
    kv = torch.randn(len(slots), KV_HEADS, D, device=device, dtype=torch.float16)
    write_cache_(codec, cache, kv, kv, slots)
    tables = torch.arange(1, blocks, dtype=torch.int32, device=device).reshape(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    q = torch.randn(batch, HEADS, D, device=device, dtype=torch.float16)
    # bytes the kernel must read: the quantized cache before the window, the fp16 window, q
    read = batch * KV_HEADS * ((context - window) * codec.bytes_per_token_head + window * 4 * D)
    read += q.numel() * 2
    kw = {}
    if window:  # blocks of the recent cache before the window are recycled to the null block
        recent = [torch.zeros(blocks, BS, KV_HEADS, D, dtype=torch.float16, device=device)
                  for _ in range(2)]  # fmt: skip
        write_cache_(make_codec("auto", D, model_dtype="float16"), recent, kv, kv, slots)
        live = torch.arange(per_seq, device=device) >= (context - window) // BS
        kw = dict(recent_cache=recent, recent_block_tables=tables * live.to(tables.dtype),
                  recent_window=window)  # fmt: skip
    return codec, cache, (q, cache, tables, seq_lens, qsl, pos), kw, read


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--splits", type=int, default=8)
    args = ap.parse_args()
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}; peak {args.peak_tbs} TB/s")
    print("mode,context,batch,ms,bytes,GB/s,peak_fraction,vs_fp16_kernel,vs_sdpa")
    for context in args.contexts:
        for batch in args.batches:
            base = {}
            kq = torch.randn(batch, KV_HEADS, context, D, device="cuda", dtype=torch.float16)
            qq = torch.randn(batch, HEADS, 1, D, device="cuda", dtype=torch.float16)
            t_sdpa = timed(lambda kq=kq, qq=qq: F.scaled_dot_product_attention(
                qq, kq, kq, enable_gqa=True), flush)  # fmt: skip
            del kq
            for mode in MODES:
                codec, cache, call, kw, read = setup(mode, context, batch)
                t = timed(lambda c=codec, a=call, kw=kw: paged_attention(
                    c, *a, scale=D**-0.5, splits=args.splits, **kw), flush)  # fmt: skip
                base.setdefault("fp16", t)
                gbs = read / t / 1e9
                frac = gbs / (args.peak_tbs * 1000)
                print(f"{mode},{context},{batch},{t * 1e3:.3f},{read},{gbs:.0f},{frac:.2f},"
                      f"{t / base['fp16']:.2f},{t / t_sdpa:.2f}")  # fmt: skip
                del cache, call, kw
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
