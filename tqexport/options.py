"""Typer option types that several commands share (one help text each; the defaults come
from :class:`~tqexport.runtime.engine_config.EngineConfig` and :mod:`tqexport.validate`), the
command class every command uses, and whether an option was given."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand

from tqexport.errors import TQExportError


class Command(TyperCommand):
    """A command that refuses an empty value of any option or argument: typer would read ''
    as the path '.' or as an unset name, and go on silently."""

    def parse_args(self, ctx, args):
        raw, _, _ = self.make_parser(ctx).parse_args(args=list(args))  # values as typed
        for param in self.get_params(ctx):
            value = raw.get(param.name)
            if value == "" or (isinstance(value, (list, tuple)) and "" in value):
                fix = "give a value" + ("" if param.required else " or leave it out")
                raise TQExportError(f"{_label(param)} is empty; {fix}")
        return super().parse_args(ctx, args)


def _label(param) -> str:
    """How the user names a parameter: its long option, or an argument's metavar."""
    if isinstance(param, TyperArgument):
        return param.name.upper()
    return max(param.opts, key=len)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option behind parameter ``name`` was given (on the command line or in its
    environment variable) rather than left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


SkipOption = Annotated[
    list[str] | None,
    typer.Option(
        "--skip-layers",
        help="Layers kept unquantized: 5, -1, 0-3, sw, full, boundary:N (repeatable, or a,b).",
    ),
]

KvLayersOption = Annotated[
    str | None,
    typer.Option(
        "--kv-layers",
        help="Per-layer caches: RANGE:DTYPE[:wN][:sN] joined by commas, e.g. "
        "0-1:auto,2-27:tqx_k4v2_mse:w64:s4,28-29:fp8 (wN/sN: that range's recent window and "
        "sink tokens); layers left out get --kv-cache-dtype.",
    ),
]

KvBitsOption = Annotated[
    float | None,
    typer.Option(
        "--kv-bits",
        help="Choose every layer's cache (dtype, window, sinks) for the least predicted cost at "
        "most B bits per element all in (a knapsack over a `tqexport calibrate` table).",
    ),
]
CalibrationOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="With --kv-bits: the `tqexport calibrate` table (default: measured now).",
    ),
]

KvDtypeOption = Annotated[str, typer.Option(help="vLLM kv-cache dtype name.")]
WeightsOption = Annotated[
    str,
    typer.Option(
        help="How the matrices are stored: auto (the source's own precision: a GGUF's 4- and "
        "8-bit blocks, a float checkpoint in fp32), fp32, fp16, int8 or int4 (blocks of 32; a "
        "float checkpoint through ONNX Runtime's quantizer)."
    ),
]
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
    Annotated[
        int | None,
        typer.Option(
            help="Cache blocks per full-attention layer (block 0 is the null block; windowed "
            "layers get what they can use)."
        ),
    ],
    Annotated[
        str | None, typer.Option(help="KV budget, e.g. 512MiB (default when no --num-blocks).")
    ],
    Annotated[
        int | None,
        typer.Option(
            help="Longest sequence (prompt + output) served; the KV budget is split between "
            "windowed and full-attention layers for it (default: the model's position limit)."
        ),
    ],
)

EngineOptions = (
    Annotated[str, typer.Option(help="ort | torch | trt (needs `tqexport engine`)")],
    Annotated[int, typer.Option(help="Token budget per step.")],
    Annotated[int, typer.Option(help="Sequences per step.")],
    Annotated[
        int | None,
        typer.Option(help="ONNX Runtime intra-op threads, 1 to 4 per core (default: its own)."),
    ],
    Annotated[bool, typer.Option(help="Apply the model's chat template.")],
    Annotated[
        int,
        typer.Option(
            help="While sequences decode, prompt tokens per step at most (0: no cap), so a long "
            "prompt delays their next token by a short chunk, not a whole step's budget."
        ),
    ],
)
