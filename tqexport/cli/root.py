"""The root ``tqexport`` app: every command registered in order, and the console entry point
that turns user and usage errors into one line on stderr and an exit code."""

from __future__ import annotations

import sys

import typer

from tqexport.bench.commands import bench_app
from tqexport.cli import build, calibrate, dtypes, inspect, parity, plan, run, serve, tensorrt
from tqexport.console import error_exit
from tqexport.errors import TQExportError
from tqexport.options import Command

try:  # typer >= 0.16 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions
#: CTRL+C at a prompt (typer's own Abort, and click's where the vendored copy has one)
_ABORTS = (typer.Abort, getattr(click_exceptions, "Abort", typer.Abort))

app = typer.Typer(
    help="Per-layer quantized KV caches (vLLM kv-cache-dtype names and layouts), exported.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _command in (dtypes.dtypes, plan.plan, build.build, calibrate.calibrate, parity.parity,
                 inspect.inspect, run.run, serve.serve):  # fmt: skip
    app.command(cls=Command)(_command)
app.add_typer(bench_app, name="bench")
app.command(cls=Command)(tensorrt.engine)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors, usage errors included, become one line on stderr and
    exit code 2; ``--help`` and no arguments at all (the help) exit 0; parity's mismatch exits 1."""
    run_app(app, argv, "tqexport")


def run_app(typer_app: typer.Typer, argv: list[str] | None, prog_name: str) -> None:
    """Run ``typer_app`` as :func:`main` runs tqexport's (the benchmark report runs its own)."""
    try:
        rv = typer_app(args=argv, prog_name=prog_name, standalone_mode=False)
    except TQExportError as e:
        error_exit(str(e))
    except click_exceptions.ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # typer printed the help: as --help does
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        path = ctx.command_path if ctx is not None else prog_name
        error_exit(f"{e.format_message()} (see {path} --help)", 2 if e.exit_code == 2 else 1)
    except _ABORTS:
        error_exit("aborted", 1)
    sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)
