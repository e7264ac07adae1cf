"""What several commands share: the serving defaults, plan's and build's request, stderr notes
and the ``--vllm-args`` option with what it prints."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from tqexport.console import err, error_exit
from tqexport.errors import TQExportError
from tqexport.options import given
from tqexport.runtime.engine_config import EngineConfig
from tqexport.spec import BuildRequest
from tqexport.spec.request import GIVEN_RULES
from tqexport.validate import printable

#: every serving option's default (run, inspect, serve): defined once, in EngineConfig
ENGINE = EngineConfig()


def given_names(ctx: typer.Context) -> list[str]:
    """The parameters given on the command line or in their environment variables, for the
    rules that judge an option by whether it was given."""
    return [name for name in ctx.params if given(ctx, name)]


def one_output(as_json: bool, vllm_args: bool) -> None:
    """``--json`` and ``--vllm-args`` each choose what is printed: at most one of them."""
    if as_json and vllm_args:
        raise TQExportError("--json and --vllm-args each choose what is printed; give one")


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
    rules = [name for name in GIVEN_RULES if name in p and given(ctx, name)]
    budget = p["kv_bits"] is not None
    request.check_given(rules, layers_pending=budget)
    kv_layers = _budget_layers(ctx, model, request.dtype)
    if budget:
        request = dataclasses.replace(request, kv_layers=kv_layers)
        request.check_given(rules)
    return request


def _budget_layers(ctx: typer.Context, model: str, dtype: str | None) -> str | None:
    """``--kv-layers`` as given, or as ``--kv-bits`` chooses it (the plan and its predicted
    cost printed to stderr); options ``--kv-bits`` would override are refused first."""
    from tqexport.kvplan import kv_budget

    p = ctx.params
    kv_budget.check_calibration(p["kv_bits"], p["calibration"])
    if p["kv_bits"] is None:
        return p["kv_layers"]
    overridden = {
        "--kv-layers": p["kv_layers"] is not None, "--kv-cache-dtype": given(ctx, "kv_cache_dtype"),
        "--skip-layers": bool(p["skip_layers"]), "--kv-recent-window": given(ctx, "recent_window"),
        "--kv-sink-tokens": given(ctx, "sink_tokens"),
    }  # fmt: skip
    return kv_budget.choose_kv_layers(model, dtype, p["kv_bits"], p["calibration"],
                                      p["key_transform"], overridden, say)  # fmt: skip


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
