"""What several commands share: the serving defaults, plan's and build's request, stderr notes
and the ``--vllm-args`` option with what it prints."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from tqexport.console import err, error_exit
from tqexport.errors import TQExportError
from tqexport.options import given
from tqexport.runtime.config import EngineConfig
from tqexport.spec import BuildRequest
from tqexport.validate import printable

#: every serving option's default (run, inspect, serve): defined once, in EngineConfig
ENGINE = EngineConfig()

#: plan's and build's options whose explicit use BuildRequest.check_given judges
_GIVEN_RULES = ("boundary", "kv_scales")


def build_request(ctx: typer.Context, model: str, **fields) -> BuildRequest:
    """plan's and build's options as one checked request (``--kv-bits`` chooses its
    ``--kv-layers``, after the cheap checks); options given to no effect are refused."""
    p = ctx.params
    request = BuildRequest(
        kv_cache_dtype=p["kv_cache_dtype"],
        skip_layers=tuple(p["skip_layers"] or ()),
        boundary=p["boundary"],
        block_size=p["block_size"],
        recent_window=p["recent_window"],
        sink_tokens=p["sink_tokens"],
        key_transform=p["key_transform"],
        kv_layers=p["kv_layers"],
        **fields,
    )
    rules = [name for name in _GIVEN_RULES if name in p and given(ctx, name)]
    budget = p["kv_bits"] is not None
    request.check_given([r for r in rules if not (budget and r == "kv_scales")])
    kv_layers = _budget_layers(ctx, model, request.dtype)
    if budget:
        request = dataclasses.replace(request, kv_layers=kv_layers)
        request.check_given(rules)
    return request


def _budget_layers(ctx: typer.Context, model: str, dtype: str | None) -> str | None:
    """``--kv-layers`` as given, or as ``--kv-bits`` chooses it (the plan and its predicted
    cost printed to stderr); options ``--kv-bits`` would override are refused first."""
    from tqexport import kv_budget

    p = ctx.params
    if p["kv_bits"] is None:
        if p["calibration"] is not None:
            raise TQExportError("--calibration is read only by --kv-bits; add --kv-bits or drop it")
        return p["kv_layers"]
    kv_bits = kv_budget.check_budget(p["kv_bits"])
    names = ("kv_layers", "kv_cache_dtype", "skip_layers", "recent_window", "sink_tokens")
    kv_budget.conflicts(f"{kv_bits:g}", {
        "--kv-layers": p["kv_layers"] is not None, "--kv-cache-dtype": given(ctx, names[1]),
        "--skip-layers": bool(p["skip_layers"]), "--kv-recent-window": given(ctx, names[3]),
        "--kv-sink-tokens": given(ctx, names[4]),
    })  # fmt: skip
    from tqexport.kvquant.transforms import parse_key_transform
    from tqexport.models.config import describe_model

    desc = describe_model(model, dtype)
    kinds = parse_key_transform(p["key_transform"])
    choice, _ = kv_budget.budget_plan(model, desc, kv_bits, p["calibration"], say, kinds)
    say(
        f"--kv-bits {kv_bits:g} chose --kv-layers {choice.kv_layers}: "
        f"{float(choice.bits_per_element):.4f} bits per element all in, predicted KL "
        f"{choice.predicted_cost:.5f} (the sum of its layers' calibrated costs)"
    )
    return choice.kv_layers


def say(text: str) -> None:
    """One progress or choice line on stderr, printed literally."""
    err.print(printable(text))


VllmArgsOption = Annotated[
    bool,
    typer.Option(
        "--vllm-args",
        help="Print the `vllm serve` command giving the same per-layer caches (exit 1 and say "
        "why when vLLM cannot express them).",
    ),
]


def print_vllm_command(spec, model: str) -> None:
    """The ``vllm serve`` command for ``spec``'s caches, or exit 1 naming what vLLM lacks."""
    from tqexport.vllm_bridge import vllm_args

    flags = vllm_args(spec)
    if flags.unsupported:
        error_exit("vLLM cannot serve this plan: " + "; ".join(flags.unsupported), 1)
    print(flags.command(model))
