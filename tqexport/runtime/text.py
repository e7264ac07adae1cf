"""Text side of serving: tokenizer, chat template, stop ids, UTF-8-safe streaming.

Everything read from an artifact directory is checked as it is read: every file is a regular
file inside the artifact (``contract.files.read_artifact_file``), a damaged tokenizer,
tokenizer config or generation config is one ``TQExportError`` naming the file, and a chat
template (code from the model's author) renders in a Jinja sandbox with a time limit
(:data:`TEMPLATE_SECONDS`) and an output-size limit (:data:`TEMPLATE_MAX_CHARS`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from tqexport.contract.files import (
    CHAT_TEMPLATE_DIR,
    CHAT_TEMPLATE_FILES,
    GENERATION_CONFIG_FILE,
    TOKENIZER_SET,
    artifact_file,
    read_artifact_file,
)
from tqexport.errors import TQExportError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: JSON files of a tokenizer that transformers reads when they are present
JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
#: wall time one chat-template render may take
TEMPLATE_SECONDS = 5.0
#: characters a rendered chat template may have beyond the prompt itself (1 MiB)
TEMPLATE_MAX_CHARS = 2**20
#: characters a normalizer may merge into one (NFC composes at most 4 code points into one)
NORMALIZER_MERGE = 4


def _first_line(e: BaseException) -> str:
    if isinstance(e, KeyError):
        return f"missing field {e}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _json_object(path: Path, raw: bytes) -> dict:
    """The JSON object ``raw`` (the bytes of ``path``), or one error naming the file."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TQExportError(f"{path} is not UTF-8 text; rebuild the artifact") from None
    except ValueError as e:  # JSONDecodeError
        raise TQExportError(f"{path} is not valid JSON ({e}); rebuild the artifact") from None
    except RecursionError:
        raise TQExportError(f"{path} nests too deeply to be a tokenizer file") from None
    if not isinstance(data, dict):
        raise TQExportError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def read_json_file(artifact_dir: Path, name: str) -> dict | None:
    """The JSON object in the artifact's file ``name`` (None when absent), or one error naming
    the file."""
    raw = read_artifact_file(artifact_dir, name)
    return None if raw is None else _json_object(Path(artifact_dir) / name, raw)


def has_tokenizer(artifact_dir: Path) -> bool:
    """Whether the artifact carries a tokenizer (tokenizer.json or tokenizer_config.json)."""
    return any(artifact_file(artifact_dir, f) is not None for f in TOKENIZER_FILES)


def tokenizer_file(artifact_dir: Path) -> Path:
    """The file a message about the tokenizer names: tokenizer.json, else tokenizer_config.json."""
    for name in TOKENIZER_FILES:
        if (artifact_dir / name).is_file():
            return artifact_dir / name
    return artifact_dir / TOKENIZER_FILES[0]


def chat_template_file(artifact_dir: Path) -> Path:
    """Where the artifact keeps its chat template (transformers 5 writes chat_template.jinja)."""
    for name in CHAT_TEMPLATE_FILES:
        if (artifact_dir / name).is_file():
            return artifact_dir / name
    return artifact_dir / "tokenizer_config.json"


def _tokenizer_set(artifact_dir: Path) -> dict[str, bytes]:
    """Name -> bytes of every file of the tokenizer file set the artifact carries
    (``contract.files.TOKENIZER_SET`` and the ``*.jinja`` files of its extra chat templates),
    each read as a regular file inside the artifact."""
    files = {}
    for name in TOKENIZER_SET:
        data = read_artifact_file(artifact_dir, name)
        if data is not None:
            files[name] = data
    extra = Path(artifact_dir) / CHAT_TEMPLATE_DIR
    try:
        entries = sorted(os.listdir(extra)) if extra.is_dir() else []
    except OSError as e:
        raise TQExportError(f"cannot read {extra} ({e.strerror})") from None
    for entry in entries:
        if entry.endswith(".jinja"):
            name = f"{CHAT_TEMPLATE_DIR}/{entry}"
            data = read_artifact_file(artifact_dir, name)
            if data is not None:
                files[name] = data
    return files


def load_tokenizer(artifact_dir: Path):
    """The artifact's tokenizer. transformers opens files by itself from a directory, so it is
    handed a private copy of the tokenizer file set, read and checked here: it never sees a
    link, a FIFO or any other file of the artifact."""
    files = _tokenizer_set(artifact_dir)
    if not any(f in files for f in TOKENIZER_FILES):
        raise TQExportError(
            f"{artifact_dir} has no tokenizer (built from a model without one, e.g. a tiny "
            "random built-in); serve it through the Python API with token ids"
        )
    for name in JSON_FILES:
        if name in files:
            _json_object(artifact_dir / name, files[name])
    read_json_file(artifact_dir, GENERATION_CONFIG_FILE)
    for name, data in files.items():
        if name.endswith(".jinja"):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise TQExportError(
                    f"{artifact_dir / name} is not UTF-8 text; rebuild the artifact"
                ) from None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="tqexport-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).parent.mkdir(exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        try:
            tok = AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # tokenizers, transformers and json raise many kinds
            why = _first_line(e).replace(tmp, str(artifact_dir))
            raise TQExportError(
                f"cannot load the tokenizer {tokenizer_file(artifact_dir)}: {why}"
            ) from None
    return tok


class TemplateLimit(Exception):
    """A chat template went past its time or size limit."""


def _template_environment(limits: _Limits):
    """transformers' chat-template sandbox (its extensions, filters and globals when it has
    them), with every value a template builds, calls or returns bounded in size."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            limits.tick()
            if operator == "%" and isinstance(left, str):
                limits.check_format(left, right if isinstance(right, tuple) else (right,))
            elif operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple)) and isinstance(b, int):
                        limits.check_size(len(a) * max(b, 0))
                if isinstance(left, int) and isinstance(right, int):
                    limits.check_bits(abs(left).bit_length() + abs(right).bit_length())
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and abs(left) > 1:
                    limits.check_bits(right * abs(left).bit_length())
            elif operator == "+" and isinstance(left, (str, list, tuple)):
                if isinstance(right, (str, list, tuple)):
                    limits.check_size(len(left) + len(right))
            return limits.checked(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            limits.check_args(args, kwargs)
            if getattr(__obj, "__name__", None) == "replace" and args:
                limits.check_replace(getattr(__obj, "__self__", None), *args[:2])
            return limits.checked(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            limits.tick()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                limits.check_format(obj, ())  # jinja wraps these at access, not at call
            return limits.checked(super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            limits.tick()
            if isinstance(obj, str) and argument in ("format", "format_map"):
                limits.check_format(obj, ())
            return limits.checked(super().getitem(obj, argument))

    base = None
    try:  # transformers' own environment: the `generation` tag, namespace, dict, tojson, ...
        from transformers.utils.chat_template_utils import _compile_jinja_template

        base = _compile_jinja_template("").environment
    except Exception:  # an older or newer transformers: the same settings by hand below
        base = None
    extensions = [jinja2.ext.loopcontrols]
    if base is not None:
        extensions = list({type(x) for x in base.extensions.values()} | {jinja2.ext.loopcontrols})
    env = Limited(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    if base is not None:
        env.filters.update(base.filters)
        env.globals.update(base.globals)
    else:
        from datetime import datetime

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    for name, f in list(env.filters.items()):
        env.filters[name] = limits.wrap_filter(name, f)
    return env


class _Limits:
    """Deadline and size caps of one render."""

    def __init__(self, seconds: float, max_chars: int):
        self.seconds = seconds
        self.max_chars = max_chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"took longer than {self.seconds:g} s")

    def check_size(self, n: int) -> None:
        if n > self.max_chars:
            raise TemplateLimit(f"builds a value of {n} items, more than {self.max_chars}")

    def check_bits(self, bits: int) -> None:
        if bits > 2**16:
            raise TemplateLimit(f"computes a number of about {bits} bits")

    def checked(self, value):
        if isinstance(value, (str, list, tuple, dict, bytes)):
            self.check_size(len(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            self.check_bits(value.bit_length())
        return value

    def check_args(self, args, kwargs) -> None:
        self.tick()
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise TemplateLimit(f"passes {a} to a function, more than {self.max_chars}")
            self.checked(a)

    def check_format(self, fmt: str, args) -> None:
        # a width or precision in a format string allocates that many characters
        if re.search(r"\d{7,}", fmt):
            raise TemplateLimit("formats with a width of a million characters or more")
        self.check_args(tuple(args), {})

    def check_replace(self, s, old, new="") -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            count = len(s) + 1 if old == "" else s.count(old)
            self.check_size(len(s) + count * max(0, len(new) - len(old)))

    def wrap_filter(self, name: str, f):
        import functools

        limits = self

        @functools.wraps(f)
        def limited(*args, **kwargs):
            values = [a for a in args if not _is_jinja_internal(a)]
            limits.check_args(values, kwargs)
            if name == "replace" and len(values) >= 3:
                limits.check_replace(*values[:3])
            if name == "format" and values and isinstance(values[0], str):
                limits.check_format(values[0], values[1:])
            return limits.checked(f(*args, **kwargs))

        return limited


def _is_jinja_internal(value) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (Environment, EvalContext, Context))


def render_chat_template(
    template: str,
    variables: dict,
    seconds: float = TEMPLATE_SECONDS,
    max_chars: int = TEMPLATE_MAX_CHARS,
) -> str:
    """Render a chat template like transformers' ``apply_chat_template(tokenize=False)``, in its
    sandbox, but stopped after ``seconds`` or ``max_chars`` characters of output.

    The time limit holds for any template: a trace function on the template's own code checks
    the deadline on every line it runs, and every value it builds, calls or returns is bounded
    in size, so no single operation runs long. Raises :class:`TemplateLimit` past a limit and
    jinja2's errors for a broken template."""
    limits = _Limits(seconds, max_chars)
    env = _template_environment(limits)
    compiled = env.from_string(template)
    code_file = "<template>"

    finished = False

    def local(frame, event, arg):
        if finished:  # the generator's frames closing later: the limit no longer applies
            return None
        limits.tick()
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == code_file and not finished else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    pieces = compiled.generate(**variables)
    try:
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise TemplateLimit(f"renders more than {max_chars} characters")
            limits.tick()
            out.append(piece)
        return "".join(out)
    finally:
        # closed here, untimed: closed later (by the garbage collector, maybe while another
        # render traces that thread), its frames would raise TemplateLimit where nothing
        # catches it ("Exception ignored in: <generator ...>" on stderr)
        finished = True
        sys.settrace(previous)
        pieces.close()


def _chat_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def encode_prompt(
    tokenizer, text: str, chat_template: bool, artifact_dir: Path | None = None
) -> list[int]:
    """Token ids of a user prompt, through the chat template when the model has one.

    A template that fails, runs past :data:`TEMPLATE_SECONDS` or renders more than
    :data:`TEMPLATE_MAX_CHARS` characters (beyond the prompt) is one ``TQExportError`` naming
    the template's file (in ``artifact_dir``); so is a tokenizer that fails or encodes the
    prompt to no tokens."""
    where = Path(artifact_dir) if artifact_dir is not None else None
    template = _chat_template(tokenizer) if chat_template else None
    if template is not None:
        source = chat_template_file(where) if where else "the tokenizer's chat template"
        variables = {
            **getattr(tokenizer, "special_tokens_map", {}),
            "messages": [{"role": "user", "content": text}],
            "tools": None,
            "documents": None,
            "add_generation_prompt": True,
        }
        try:
            rendered = render_chat_template(
                template, variables, max_chars=TEMPLATE_MAX_CHARS + len(text)
            )
        except TemplateLimit as e:
            raise TQExportError(
                f"the chat template in {source} {e}; it is stopped there (run with "
                "--no-chat-template to send raw text)"
            ) from None
        except Exception as e:  # jinja2's errors, raise_exception(), MemoryError, ...
            raise TQExportError(
                f"the chat template in {source} fails: {_first_line(e)} "
                "(run with --no-chat-template to send raw text)"
            ) from None
        if not rendered.strip():
            raise TQExportError(
                f"the chat template in {source} renders nothing for the prompt {text[:40]!r} "
                "(run with --no-chat-template to send raw text)"
            )
        ids = _encode(tokenizer, rendered, where, add_special_tokens=False)
    else:
        ids = _encode(tokenizer, text, where)
    if not ids and text:
        name = tokenizer_file(where) if where else "the tokenizer"
        raise TQExportError(
            f"{name} encodes the prompt {text[:40]!r} to no tokens; the tokenizer is broken "
            "or does not belong to this model"
        )
    return ids


def _encode(tokenizer, text: str, where: Path | None, **kw) -> list[int]:
    name = tokenizer_file(where) if where else "the tokenizer"
    try:
        enc = tokenizer(text, **kw)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        ids = [int(t) for t in ids]
    except Exception as e:
        raise TQExportError(f"{name} fails on a prompt: {_first_line(e)}") from None
    return ids


def max_token_chars(tokenizer) -> tuple[int, int]:
    """(the most prompt characters one token can stand for, the vocabulary's longest entry):
    that entry (a byte-level entry has one character per byte, so it is at least the characters
    it covers) times :data:`NORMALIZER_MERGE` for a normalizer that composes characters. A
    prompt of more than ``n * bound`` characters needs more than ``n`` tokens."""
    longest = max(1, max(map(len, tokenizer.get_vocab()), default=1))
    return longest * NORMALIZER_MERGE, longest


def stop_token_ids(artifact_dir: Path, tokenizer) -> tuple[int, ...]:
    """Every eos id of the generation config (Llama-3 has three) and the tokenizer's."""
    ids: set[int] = set()
    cfg = artifact_dir / GENERATION_CONFIG_FILE
    data = read_json_file(artifact_dir, GENERATION_CONFIG_FILE)
    if data is not None:
        eos = data.get("eos_token_id")
        eos = [eos] if not isinstance(eos, list) else eos
        for t in eos:
            if t is None:
                continue
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise TQExportError(
                    f"{cfg}: eos_token_id must be a token id or a list of them, got {t!r}"
                )
            ids.add(t)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class StreamDecoder:
    """Emits only complete text: never splits a UTF-8 character across two pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted = ""

    def push(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
