"""Markdown pieces the benchmark report is written from."""

from __future__ import annotations


def table(header: list, rows: list[list]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(str(c) for c in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
