"""The evaluation text and its chunking, defined once for ours and the peer's runs.

Default text: every topic of ``pydoc_data.topics`` (ships with every CPython) in sorted key
order, each topic's text as stored, joined by one blank line (``"\\n\\n"``). The module changes
between Python releases, so every result records the text's SHA-256 and the Python version.
Tokens: the model's tokenizer on the whole text, no special tokens added; then consecutive,
non-overlapping windows of ``chunk`` tokens, the first ``max_chunks`` of them (a short tail is
dropped). Each window is scored on its own from an empty cache.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

from tqexport import validate
from tqexport.errors import TQExportError


@dataclass(frozen=True)
class EvalText:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "characters": len(self.text),
            "python": platform.python_version(),
        }


def pydoc_topics() -> EvalText:
    from pydoc_data.topics import topics

    return EvalText(
        "pydoc_data.topics (all topics, sorted keys, joined by a blank line)",
        "\n\n".join(topics[k] for k in sorted(topics)),
    )


def file_text(path: Path) -> EvalText:
    return EvalText(str(path), validate.text_file(path, "--text-file"))


def chunk_tokens(tokens: list[int], chunk: int, max_chunks: int) -> list[list[int]]:
    """The first ``max_chunks`` full windows of ``chunk`` tokens; refuses a text too short."""
    if chunk < 2 or max_chunks < 1:
        raise TQExportError("--chunk must be >= 2 and --chunks >= 1")
    n = min(max_chunks, len(tokens) // chunk)
    if n == 0:
        raise TQExportError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of {chunk}; "
            "use a longer text or a smaller --chunk"
        )
    return [tokens[i * chunk : (i + 1) * chunk] for i in range(n)]
