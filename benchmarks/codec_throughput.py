"""Encode/decode throughput of the reference codecs, side by side with a plain copy.

For every kv-cache dtype and head size, K and V of N token-heads (fp32 input) are encoded and
decoded in chunks. Each row prints GB/s of fp32 input processed and the time ratio against
``clone()`` of the same input bytes, timed right beside that codec (best of --repeats each).
``auto`` stands for a bf16 model (a cast to bf16 and back).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import make_codec
from tqexport.kvquant.modes import kv_cache_dtype_names


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--token-heads", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=1 << 17)
    ap.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    table = Table(
        title=f"reference codecs on {torch.get_num_threads()} threads: "
        f"{args.token_heads} token-heads, fp32 K+V in"
    )
    cols = ("dtype", "D", "encode GB/s", "decode GB/s", "copy GB/s", "encode/copy", "decode/copy")
    for col in cols:
        table.add_column(col, justify="left" if col == "dtype" else "right")
    torch.manual_seed(0)
    for d in args.head_sizes:
        n_chunks = max(1, args.token_heads // args.chunk)
        chunks = [
            (torch.randn(args.chunk, 1, d), torch.randn(args.chunk, 1, d)) for _ in range(n_chunks)
        ]
        nbytes = sum(k.numel() * 4 * 2 for k, _ in chunks)

        def copy_all(chunks=chunks):
            return [(k.clone(), v.clone()) for k, v in chunks]

        for name in kv_cache_dtype_names():
            try:
                codec = make_codec(name, d, model_dtype="bfloat16")
            except TQExportError:
                continue  # e.g. MSE TurboQuant presets on a non-power-of-two head
            codec.encode(*chunks[0])  # warm-up: codebooks, Hadamard

            def enc(codec=codec, chunks=chunks):
                return [codec.encode(k, v) for k, v in chunks]

            t_enc = best_of(enc, args.repeats)
            encoded = enc()

            def dec(codec=codec, encoded=encoded):
                return [codec.decode(e) for e in encoded]

            t_dec = best_of(dec, args.repeats)
            t_copy = best_of(copy_all, args.repeats)
            table.add_row(
                name,
                str(d),
                f"{nbytes / t_enc / 1e9:.2f}",
                f"{nbytes / t_dec / 1e9:.2f}",
                f"{nbytes / t_copy / 1e9:.2f}",
                f"{t_enc / t_copy:.1f}x",
                f"{t_dec / t_copy:.1f}x",
            )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
