"""Chat messages -> token ids through the model's chat template (text.py's sandboxed render).

:func:`tqexport.runtime.text.encode_prompt` wraps one text as a single user turn; a
conversation (system, user and assistant turns) renders here with the same sandbox, limits and
error messages.
"""

from __future__ import annotations

from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.runtime import text

ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages) -> list[dict[str, str]]:
    """``messages`` as a non-empty list of ``{"role", "content"}`` dicts with text content."""
    if not isinstance(messages, list) or not messages:
        raise TQExportError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TQExportError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise TQExportError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        if not isinstance(content, str):
            raise TQExportError(f"messages[{i}].content must be text")
        out.append({"role": role, "content": content})
    return out


def encode_messages(tokenizer, messages: list[dict], artifact_dir: Path | None = None) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ending with the
    assistant's generation prompt. A model without a template is one ``TQExportError``."""
    messages = check_messages(messages)
    where = Path(artifact_dir) if artifact_dir is not None else None
    template = text._chat_template(tokenizer)
    if template is None:
        raise TQExportError(
            "this model has no chat template; send a plain text prompt (completions) instead"
        )
    source = text.chat_template_file(where) if where else "the tokenizer's chat template"
    variables = {
        **getattr(tokenizer, "special_tokens_map", {}),
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": True,
    }
    size = sum(len(m["content"]) for m in messages)
    try:
        rendered = text.render_chat_template(
            template, variables, max_chars=text.TEMPLATE_MAX_CHARS + size
        )
    except text.TemplateLimit as e:
        raise TQExportError(f"the chat template in {source} {e}; it is stopped there") from None
    except Exception as e:  # jinja2's errors, raise_exception(), MemoryError, ...
        raise TQExportError(f"the chat template in {source} fails: {text._first_line(e)}") from None
    return text._encode(tokenizer, rendered, where, add_special_tokens=False)
