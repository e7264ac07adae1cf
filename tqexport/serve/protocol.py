"""OpenAI's request schema for completions and chat completions, checked strictly.

Every parameter OpenAI defines is either honoured or refused with a 400 naming it: the ones
tqexport does not implement (``n > 1``, ``logprobs``, ``tools``, ...) are accepted only at the
value that means "off", and a parameter nobody defines is an error, never ignored.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from tqexport.errors import TQExportError
from tqexport.runtime.chat import ROLES
from tqexport.runtime.engine import MAX_STOP_STRINGS
from tqexport.runtime.sequence import SamplingParams
from tqexport.validate import TORCH_SEED_MAX

#: OpenAI's default max_tokens for completions (chat: whatever the context and cache leave)
DEFAULT_COMPLETION_TOKENS = 16


class APIError(Exception):
    """An error response: HTTP status and OpenAI's ``{"error": {...}}`` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _same(value: Any, off: Any) -> bool:
    """``value`` is the "off" value ``off`` (0 and 0.0 alike, but never a bool for a number)."""
    if off is None or isinstance(off, bool):
        return value is off
    if isinstance(off, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == off
    return type(value) is type(off) and value == off


# What the hand-checked (``Any``) fields accept, for the OpenAPI description (/openapi.json)
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_ONE_PROMPT = {"anyOf": [_TEXT, _TOKEN_IDS]}
Prompt = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                _TEXT,
                _TOKEN_IDS,
                {"type": "array", "items": _ONE_PROMPT, "minItems": 1, "maxItems": 1},
            ],
            "description": "One prompt: text or token ids (or a list holding one of them).",
        }
    ),
]
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
Messages = Annotated[
    Any,
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": list(ROLES)},
                    "content": {
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]
                    },
                },
                "required": ["role", "content"],
                "additionalProperties": False,
            },
        }
    ),
]
Stop = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "null"},
                _TEXT,
                {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS},
            ]
        }
    ),
]


def _describe(schema: dict, model: type[_Sampling]) -> None:
    """The JSON schema of a request model: every OFF parameter as the values it accepts, and
    the fields checked by hand that a request needs (REQUIRED) marked required."""
    props = schema["properties"]
    for name, off in model.OFF.items():
        props[name] = {
            "anyOf": [{"type": "null"} if v is None else {"const": v} for v in off],
            "description": "Accepted only at a value that turns it off.",
        }
    for name in model.REQUIRED:
        props[name].pop("default", None)
    schema["required"] = sorted({*schema.get("required", ()), *model.REQUIRED})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share; the ``Any`` ones are checked by hand for clear messages."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_describe)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 and 0 mean off
    seed: int | None = Field(None, ge=0, le=TORCH_SEED_MAX)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own bookkeeping
    ignore_eos: bool = False  # vLLM's extension
    return_token_ids: bool = False  # vLLM's extension: token ids in every choice
    # OpenAI parameters honoured only at their "off" value
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None

    #: fields checked by hand that every request needs
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    #: parameter -> the values that mean "off" (the only ones accepted)
    OFF: ClassVar[dict[str, tuple]] = {
        "n": (None, 1),
        "presence_penalty": (None, 0),
        "frequency_penalty": (None, 0),
        "logit_bias": (None, {}),
    }

    def check_supported(self) -> None:
        for name, off in self.OFF.items():
            value = getattr(self, name)
            if not any(_same(value, o) for o in off):
                raise APIError(
                    400,
                    f"{name}={value!r} is not supported by tqexport serve",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        stop = self.stop
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
        return tuple(stop)

    def sampling(self, max_tokens: int) -> SamplingParams:
        """SamplingParams of the request (OpenAI's defaults: temperature 1, top_p 1; no seed
        means a fresh random one)."""
        seed = self.seed if self.seed is not None else secrets.randbelow(2**63)
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        temperature = 1.0 if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                max_tokens, temperature, top_k, 1.0 if self.top_p is None else self.top_p, seed
            )
        except TQExportError as e:  # its message starts with the field's name
            name = str(e).split(" ", 1)[0]
            param = name if name in type(self).model_fields else None
            raise APIError(400, str(e), param=param) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Prompt = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    REQUIRED: ClassVar[tuple[str, ...]] = ("prompt",)
    OFF: ClassVar[dict[str, tuple]] = {
        **_Sampling.OFF,
        "logprobs": (None,),
        "best_of": (None, 1),
        "echo": (None, False),
        "suffix": (None, ""),
    }

    def prompt_value(self) -> str | list[int]:
        """One prompt: text or token ids (a batch of several is refused)."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p
        if (
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise APIError(
                400,
                "one prompt per request: send a batch as separate requests",
                param="prompt",
                code="unsupported_parameter",
            )
        raise APIError(
            400, "prompt must be a non-empty string or a list of token ids", param="prompt"
        )

    def max_new_tokens(self) -> int | None:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens


#: the most messages of one chat request: each is rendered by the chat template and tokenized,
#: and a conversation longer than any context would only keep a worker busy
MAX_MESSAGES = 4096


class ChatCompletionRequest(_Sampling):
    messages: Messages = None
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    REQUIRED: ClassVar[tuple[str, ...]] = ("messages",)
    OFF: ClassVar[dict[str, tuple]] = {
        **_Sampling.OFF,
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "parallel_tool_calls": (None,),
        "functions": (None, []),
        "function_call": (None, "none"),
        "response_format": (None, {"type": "text"}),
    }

    def message_list(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` with text content (text parts joined)."""
        msgs = self.messages
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        if len(msgs) > MAX_MESSAGES:
            raise APIError(
                400,
                f"messages has {len(msgs)} items, more than {MAX_MESSAGES}; send a shorter "
                "conversation",
                param="messages",
                code="too_many_messages",
            )
        out = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise APIError(400, f"{where} must be an object", param=where)
            extra = set(m) - {"role", "content"}
            if extra:
                raise APIError(
                    400,
                    f"{where}.{sorted(extra)[0]} is not supported",
                    param=where,
                    code="unsupported_parameter",
                )
            content = m.get("content")
            if isinstance(content, list):
                texts = [_text_part(part) for part in content]
                if None in texts:
                    raise APIError(
                        400,
                        f"{where}.content: only text parts are supported",
                        param=where,
                        code="unsupported_parameter",
                    )
                content = "\n".join(texts)
            if not isinstance(content, str):
                raise APIError(400, f"{where}.content must be text", param=where)
            out.append({"role": m.get("role"), "content": content})
        return out

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (as much as the context leaves)."""
        return self.max_completion_tokens or self.max_tokens


def _text_part(part: Any) -> str | None:
    """The text of a ``{"type": "text", "text": ...}`` content part, else None."""
    if isinstance(part, dict) and set(part) == {"type", "text"} and part["type"] == "text":
        return part["text"] if isinstance(part["text"], str) else None
    return None


def parse(model: type[_Sampling], data: Any) -> _Sampling:
    """The request model of a JSON body, or a 400 naming the first bad parameter."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise APIError(
                400, f"unknown parameter {param!r}", param=param, code="unsupported_parameter"
            ) from None
        if err["type"] == "missing":
            raise APIError(400, f"{param} is required", param=param) from None
        raise APIError(400, f"{param}: {err['msg']}", param=param) from None
    req.check_supported()
    return req
