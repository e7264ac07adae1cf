"""OpenAI's response objects for completions and chat completions, whole and as SSE chunks."""

from __future__ import annotations

import json
import time
import uuid


def sse(obj: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Response:
    """One request's response: its id, creation time and model, for every object it sends."""

    def __init__(self, chat: bool, model: str, prompt_ids: list[int], return_token_ids: bool):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.return_token_ids = return_token_ids

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str | None,
        token_ids: list[int],
        reason: str | None,
        chunk: bool,
        first: bool = False,
    ) -> dict:
        choice: dict = {"index": 0}
        if not self.chat:
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = ({"role": "assistant", "content": ""} if first else {}) | (
                {"content": text} if text else {}
            )
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        if self.return_token_ids:  # vLLM's extension
            choice["token_ids"] = token_ids
            if first or not chunk:
                choice["prompt_token_ids"] = self.prompt_ids
        return choice

    def whole(self, text: str, token_ids: list[int], reason: str) -> dict:
        """The non-streamed response."""
        return self._head(False) | {
            "choices": [self._choice(text, token_ids, reason, chunk=False)],
            "usage": usage(len(self.prompt_ids), len(token_ids)),
        }

    def chunk(self, text: str, token_ids: list[int], reason: str | None, first=False) -> dict:
        """One streamed chunk (the first of a chat stream also names the assistant role)."""
        return self._head(True) | {
            "choices": [self._choice(text, token_ids, reason, chunk=True, first=first)]
        }

    def usage_chunk(self, completion_tokens: int) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._head(True) | {
            "choices": [],
            "usage": usage(len(self.prompt_ids), completion_tokens),
        }
