"""``tqexport dtypes``: the kv-cache dtype table, at one head size."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from tqexport.console import console
from tqexport.validate import printable


def dtypes(
    head_size: Annotated[int, typer.Option(help="Head size D for the byte columns.")] = 128,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
):
    """List every kv-cache dtype: mode, bits per element, bytes per token-head (K+V, all in)."""
    from tqexport.kvquant.catalog import check_head_size, dtype_rows

    check_head_size(head_size)
    rows = dtype_rows(head_size)
    if as_json:
        print(json.dumps({"head_size": head_size, "dtypes": rows}, indent=2))
        return
    t = Table(title=f"kv-cache dtypes at head size {head_size} (auto shown as bf16)")
    for col in ("name", "mode", "data bits", "bytes/token-head", "bits/elem all-in", "vs bf16"):
        t.add_column(col, justify="left" if col in ("name", "mode") else "right")
    notes = []
    for r in rows:
        if not r["available"]:
            t.add_row(r["name"], r["mode"], "-", "n/a", "n/a", "n/a")
            notes.append(f"{r['name']}: {r['reason']}")
            continue
        t.add_row(
            r["name"],
            r["mode"],
            str(r["data_bits"] or "model"),
            str(r["bytes_per_token_head"]),
            f"{r['bits_per_element']:.2f}",
            f"{r['compression_vs_bf16']:.2f}x",
        )
    console.print(t)
    for note in notes:
        console.print(printable(note))
