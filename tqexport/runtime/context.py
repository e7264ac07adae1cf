"""The longest sequence an artifact is served at, found without starting an engine (``inspect``):
the tokenizer is read only where it is the one source of the model's position limit."""

from __future__ import annotations

from tqexport.contract.artifact import Artifact
from tqexport.runtime.engine import context_limit, limit_fallback_note
from tqexport.runtime.text import has_tokenizer, load_tokenizer


def served_context(artifact: Artifact, max_model_len: int | None) -> tuple[int | None, str | None]:
    """(the context, None if unknown; the line to warn with when the limit came from a
    fallback, None if nothing to say)."""
    context, _ = context_limit(artifact, max_model_len)
    tokenizer = None
    if context is None and has_tokenizer(artifact.path):
        tokenizer = load_tokenizer(artifact.path)
        context, _ = context_limit(artifact, max_model_len, tokenizer)
    return context, limit_fallback_note(artifact, max_model_len, tokenizer)
