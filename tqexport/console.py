"""The command line's two consoles and the few formatting helpers every command shares.

No markup, emoji codes or highlighting: user text ('[/x]', 'boundary:100:') prints as it is.
Tables are wider than 80 columns; a pipe or CI log gets the full width instead of ellipses.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.text import Text

from tqexport.validate import printable

T = TypeVar("T")

_PLAIN = dict(markup=False, emoji=False, highlight=False)
console = Console(width=None if sys.stdout.isatty() else 160, **_PLAIN)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160, **_PLAIN)


def warn(message: str) -> None:
    err.print(Text.assemble(("warning:", "yellow"), " ", printable(message)), soft_wrap=True)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units up to TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def ok_text(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="red")


def error_exit(message: str, code: int = 2):
    """The one line every user error prints: ``error: <problem and fix>``."""
    text = printable(message).strip() or "unknown error"
    err.print(Text.assemble(("error:", "red"), " ", text), soft_wrap=True)
    sys.exit(code)


@contextmanager
def progress(*columns) -> Iterator:
    """A rich Progress on stderr, live on a terminal only and cleared if the work inside
    fails: a failure prints its error line alone, never after a bar."""
    from rich.progress import Progress

    with Progress(*columns, console=err, disable=not err.is_terminal) as bar:
        try:
            yield bar
        except BaseException:
            bar.live.transient = True
            raise


def run_in_stages(labels: dict[str, str], work: Callable[[Callable[[str], None]], T]) -> T:
    """Run ``work(stage)``, which calls ``stage(name)`` as each stage starts. A terminal gets a
    live display (cleared if the work fails); a log gets each stage's time once, after
    success, so a failure prints its error line only."""
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    started: dict[str, float] = {}
    current = {}
    columns = SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn()
    with progress(*columns) as bar:

        def stage(name: str) -> None:
            for task in current.values():
                bar.update(task, completed=1, total=1)
            current[name] = bar.add_task(labels[name], total=None)
            started[name] = time.monotonic()

        result = work(stage)
        for task in current.values():
            bar.update(task, completed=1, total=1)
    if not err.is_terminal:
        ends = [*list(started.values())[1:], time.monotonic()]
        for (name, t0), t1 in zip(started.items(), ends, strict=True):
            err.print(f"  {labels[name]} {t1 - t0:.1f} s")
    return result
