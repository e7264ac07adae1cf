"""Typer option types that several commands share (one help text each; the defaults come from
:class:`~tqexport.runtime.config.EngineConfig` and :mod:`tqexport.validate`)."""

from __future__ import annotations

from typing import Annotated

import typer

SkipOption = Annotated[
    list[str] | None,
    typer.Option(
        "--skip-layers",
        help="Layers kept unquantized: 5, -1, 0-3, sw, full, boundary:N (repeatable, or a,b).",
    ),
]


KvDtypeOption = Annotated[str, typer.Option(help="vLLM kv-cache dtype name.")]
BoundaryOption = Annotated[
    bool, typer.Option(help="TurboQuant boundary protection (first/last 2 layers).")
]
BlockSizeOption = Annotated[int, typer.Option(help="Tokens per cache block.")]
RecentWindowOption = Annotated[
    int,
    typer.Option(
        "--kv-recent-window",
        help="Also keep each quantized layer's last N tokens in the model dtype (0 = off).",
    ),
]
SinkTokensOption = Annotated[
    int,
    typer.Option(
        "--kv-sink-tokens",
        help="Also keep each sequence's first N tokens in the recent-window cache, in the model "
        "dtype (needs --kv-recent-window; 0 = off).",
    ),
]
KeyTransformOption = Annotated[
    str,
    typer.Option(
        "--kv-key-transform",
        help="Exact key transforms of tqx_* TurboQuant caches: none, or center, smooth, signs "
        "joined by + (fitted on --calibration-text; default: held-out pydoc topics).",
    ),
]

KernelsOption = Annotated[
    str,
    typer.Option(
        help="What runs the cache and attention ops on ONNX Runtime's CPU: auto (the native "
        "kernels where they serve every layer, else the function bodies), native, bodies.",
    ),
]

MemoryOptions = (
    Annotated[int | None, typer.Option(help="Cache blocks per layer (block 0 is the null block).")],
    Annotated[
        str | None, typer.Option(help="KV budget, e.g. 512MiB (default when no --num-blocks).")
    ],
)

EngineOptions = (
    Annotated[str, typer.Option(help="ort | torch | trt (needs `tqexport engine`)")],
    Annotated[int, typer.Option(help="Token budget per step.")],
    Annotated[int, typer.Option(help="Sequences per step.")],
    Annotated[int | None, typer.Option(help="ONNX Runtime intra-op threads (default: its own).")],
    Annotated[bool, typer.Option(help="Apply the model's chat template.")],
)
