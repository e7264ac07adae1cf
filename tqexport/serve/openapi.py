"""The server's OpenAPI description (/openapi.json, /docs): request bodies from the request
models, every status code a route sends with its body, and the bearer key where one is set.
The schema tests check the live server against it, so it says what the server does."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from tqexport.serve.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"
_BEARER = "bearer"

#: what each error status means, for every route that can send it
STATUS = {
    400: "Bad parameters, malformed JSON, or a prompt that cannot fit.",
    401: "A missing or wrong API key (send 'Authorization: Bearer KEY').",
    404: "An unknown model.",
    413: "A request body over the server's limit (8 MiB by default).",
    415: "A request body that is not 'Content-Type: application/json'.",
    500: "An unexpected server error (logged on the server).",
    503: "The engine failed, or the server is shutting down.",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Strict):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(_Strict):
    """OpenAI's error body."""

    error: ErrorDetail


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(_Strict):
    index: Literal[0]
    logprobs: None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] = []  # return_token_ids only (vLLM's extension)
    prompt_token_ids: list[int] = []


class CompletionChoice(_Choice):
    text: str


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class _Whole(_Strict):
    id: str
    created: int
    model: str
    usage: Usage


class Completion(_Whole):
    """A whole (non-streamed) completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletion(_Whole):
    """A whole (non-streamed) chat completion."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class _ChunkChoice(_Strict):
    index: Literal[0]
    logprobs: None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] = []
    prompt_token_ids: list[int] = []  # the first chunk's


class CompletionChunkChoice(_ChunkChoice):
    text: str


class Delta(_Strict):
    role: Literal["assistant"] = "assistant"  # the first chunk's
    content: str = ""


class ChatChunkChoice(_ChunkChoice):
    delta: Delta


class _Chunk(_Strict):
    id: str
    created: int
    model: str
    usage: Usage | None = None  # the last chunk's, with no choices (stream_options)


class CompletionChunk(_Chunk):
    """One streamed chunk of a completion."""

    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]


class ChatCompletionChunk(_Chunk):
    """One streamed chunk of a chat completion."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class ModelCard(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelCard]


def errors(*codes: int) -> dict:
    """FastAPI's ``responses`` for these error statuses."""
    return {c: {"model": ErrorResponse, "description": STATUS[c]} for c in codes}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def generated(whole: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """The 200 of a generation route: the ``whole`` response, or server-sent events when
    streamed, each a ``chunk`` (or the error that ended the stream) and last ``[DONE]``."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
    }
    event = {
        "type": "object",
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        "required": ["data"],
    }
    return {200: {"model": whole, "content": {"text/event-stream": {"schema": event}}}}


def body(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra``: its JSON request body is ``model`` (read by hand)."""
    content = {"application/json": {"schema": _ref(model)}}
    return {"requestBody": {"required": True, "content": content}}


def describe(app: FastAPI, model_name: str, public: frozenset[str], bearer: bool) -> dict:
    """The OpenAPI document of ``app`` serving ``model_name``; with ``bearer`` every path but
    ``public`` ones needs the key (and says 401 without it)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    requests = (CompletionRequest, ChatCompletionRequest)
    replies = (ErrorResponse, CompletionChunk, ChatCompletionChunk)
    _, defs = models_json_schema(
        [*((m, "validation") for m in requests), *((m, "serialization") for m in replies)],
        ref_template=_REF,
    )
    for name, schema in defs["$defs"].items():
        if name in (m.__name__ for m in requests):
            schema["properties"]["model"]["enum"] = [model_name]
        schemas.setdefault(name, schema)
    if not bearer:
        return doc
    doc["components"]["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
    unauthorized = _ref(ErrorResponse)
    for path, operations in doc["paths"].items():
        if path in public:
            continue
        for op in operations.values():
            op["security"] = [{_BEARER: []}]
            op["responses"]["401"] = {
                "description": STATUS[401],
                "content": {"application/json": {"schema": unauthorized}},
            }
    return doc
