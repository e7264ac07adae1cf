"""Argument checks shared by the command line and the library, and terminal-safe text.

Every check raises :class:`TQExportError` with one line naming the argument, the rule and the
value, so the CLI can run them all before any expensive work and the library classes
(``SamplingParams``, ``Executor``) give the same messages. Nothing here imports torch.
"""

from __future__ import annotations

import math
import operator
import os
import re
import struct
import unicodedata
from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.safe_files import file_kind, read_regular_file

#: ``--seed`` of ``run`` and ``parity``: numpy's range; request i samples with seed + i.
SEED_MAX = 2**32 - 1
#: what ``torch.Generator.manual_seed`` takes (the per-request seeds of the library)
TORCH_SEED_MAX = 2**64 - 1
#: the Triton kernels range over a block with ``tl.arange(0, BS)``: a power of two
MAX_BLOCK_SIZE = 256
#: tokens per cache block unless a build asks otherwise (vLLM's default too)
DEFAULT_BLOCK_SIZE = 16
#: block ids are int32 in the step inputs
MAX_NUM_BLOCKS = 2**31 - 1
MAX_NUM_SEQS = 2**16
#: the serving defaults (vLLM's names): sequences and tokens per engine step
DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS = 64, 512
#: prompt tokens per step while sequences decode (0: no cap; ``runtime.scheduler``)
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 0
MAX_NUM_BATCHED_TOKENS = 2**20
#: temperatures below this overflow ``logits / temperature`` in fp32; 0 means greedy
MIN_TEMPERATURE = 1e-5
#: the largest finite float32 and the smallest positive one: sampling computes in float32
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45
MAX_RECENT_WINDOW = 2**20
#: attention layers of a model (the largest have ~130): every layer index given is below it
MAX_LAYERS = 1024
#: sink tokens kept in the model dtype per sequence (a few are what attention leans on)
MAX_SINK_TOKENS = 2**10


def integer(value, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int within [minimum, maximum] (bools and floats are refused)."""
    if isinstance(value, bool):
        raise TQExportError(f"{name} must be an integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TQExportError(f"{name} must be an integer, got {value!r}") from None
    if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        if maximum is None:
            rule = f">= {minimum}"
        elif minimum is None:
            rule = f"<= {maximum}"
        else:
            rule = f"from {minimum} to {maximum}"
        raise TQExportError(f"{name} must be {rule}, got {n}")
    return n


def number(value, name: str, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> float:  # fmt: skip
    """``value`` as a finite float; ``minimum``/``maximum`` inclusive, ``above`` exclusive."""
    if isinstance(value, bool):
        raise TQExportError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise TQExportError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise TQExportError(f"{name} must be a finite number, got {value}")
    low = [f">= {minimum:g}"] if minimum is not None else []
    low += [f"> {above:g}"] if above is not None else []
    rule = " and ".join(low + ([f"<= {maximum:g}"] if maximum is not None else []))
    if (
        (minimum is not None and x < minimum)
        or (above is not None and x <= above)
        or (maximum is not None and x > maximum)
    ):
        raise TQExportError(f"{name} must be {rule}, got {x:g}")
    return x


def clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters (``...`` marks a cut) for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_int(text: str, name: str, minimum: int, maximum: int) -> int:
    """The decimal integer ``text`` (digits, an optional ``-``) within [minimum, maximum],
    refused by its length before it is converted: Python refuses to convert more than 4300
    digits, and a number that long in a message is no help."""
    digits = len(text.lstrip("-"))
    if digits > len(str(max(abs(minimum), abs(maximum)))):
        raise TQExportError(f"{name} must be from {minimum} to {maximum}, got {digits} digits")
    return integer(int(text), name, minimum, maximum)


def choice(value: str, name: str, options) -> str:
    if value not in options:
        raise TQExportError(f"{name} must be one of {', '.join(options)}, got {value!r}")
    return value


def comma_list(text: str, name: str) -> list[str]:
    """'a, b' -> ['a', 'b']: the comma-separated values of option ``name``, none of them empty
    ('a,,b' and 'a,' are refused, never read as 'a,b' and 'a')."""
    values = [x.strip() for x in text.split(",")]
    if not all(values):
        raise TQExportError(
            f"{name} {text!r} has an empty value; separate the values by single commas"
        )
    return values


def block_size(value, name: str = "--block-size") -> int:
    """Tokens per cache block: a power of two up to :data:`MAX_BLOCK_SIZE` (the kernels' rule)."""
    n = integer(value, name, 1)
    if n > MAX_BLOCK_SIZE or n & (n - 1):
        raise TQExportError(
            f"{name} must be a power of two from 1 to {MAX_BLOCK_SIZE} (16 is vLLM's default), "
            f"got {n}"
        )
    return n


def max_threads() -> int:
    """The most threads a session may ask for: 4 per core of this machine (more only add
    memory and switching; 100000 threads exhausted memory before any work)."""
    return 4 * (os.cpu_count() or 1)


def threads(value, name: str = "--threads") -> int:
    """ONNX Runtime's intra-op threads: from 1 to :func:`max_threads`."""
    return integer(value, name, 1, max_threads())


def recent_window(value, name: str = "--kv-recent-window") -> int:
    return integer(value, name, 0, MAX_RECENT_WINDOW)


def sink_tokens(value, name: str = "--kv-sink-tokens") -> int:
    return integer(value, name, 0, MAX_SINK_TOKENS)


def seed(value, name: str = "--seed", maximum: int = SEED_MAX) -> int:
    return integer(value, name, 0, maximum)


def float32(x: float) -> float:
    """``x`` rounded to float32 (inf past its range), the precision sampling computes in."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _flag(field: str, cli: bool) -> str:
    return "--" + field.replace("_", "-") if cli else field


def sampling(max_tokens, temperature, top_k, top_p, seed_value, *, cli: bool = False,
             seed_max: int = TORCH_SEED_MAX) -> None:  # fmt: skip
    """The rules of ``SamplingParams``; ``cli`` names the flags (``--max-tokens``) instead of the
    fields (``max_tokens``) in the message. Floats are checked as float32 too, the precision
    sampling computes in, so a value that passes cannot make sampling fail."""
    integer(max_tokens, _flag("max_tokens", cli), 1)
    name = _flag("temperature", cli)
    t = number(temperature, name, 0.0)
    if 0 < t < MIN_TEMPERATURE:
        raise TQExportError(f"{name} must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}")
    if math.isinf(float32(t)):
        raise TQExportError(
            f"{name} must be <= {FLOAT32_MAX:.6g}, got {t:g}, which is infinite in float32 "
            "(the precision sampling computes in)"
        )
    integer(top_k, _flag("top_k", cli), 0)
    name = _flag("top_p", cli)
    p = number(top_p, name, above=0.0, maximum=1.0)
    if float32(p) == 0:
        raise TQExportError(
            f"{name} must be > 0 and <= 1, got {p:g}, which is 0 in float32 (the precision "
            f"sampling computes in); the smallest that works is {FLOAT32_TINY:.2g}"
        )
    seed(seed_value, _flag("seed", cli), seed_max)


def greedy(temperature: float, given: list[str]) -> None:
    """Sampling options ``given`` (field names) with temperature 0 would be ignored: refused."""
    if temperature == 0:
        for name in ("top_k", "top_p", "seed"):
            if name in given:
                raise TQExportError(
                    f"--{name.replace('_', '-')} has no effect with --temperature 0 (greedy): "
                    "give a temperature > 0 to sample, or drop it"
                )


def serving(
    num_blocks=None,
    max_num_seqs=DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
    backend=None,
    long_prefill_token_threshold=DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
) -> None:
    """The executor's sizes (``--num-blocks``, ``--max-num-seqs``, ...), before any allocation."""
    if num_blocks is not None:
        integer(num_blocks, "--num-blocks", 2, MAX_NUM_BLOCKS)
    integer(max_num_seqs, "--max-num-seqs", 1, MAX_NUM_SEQS)
    integer(max_num_batched_tokens, "--max-num-batched-tokens", 1, MAX_NUM_BATCHED_TOKENS)
    integer(long_prefill_token_threshold, "--long-prefill-token-threshold", 0,
            MAX_NUM_BATCHED_TOKENS)  # fmt: skip
    if backend is not None:
        choice(backend, "--backend", ("ort", "torch", "trt"))


def api_key(key: str | None) -> str | None:
    """``--api-key`` as clients can send it, ``Authorization: Bearer KEY``: printable ASCII
    without spaces (RFC 9110's visible characters); any other key would make every request a
    401. The key is never printed, only where and what kind of character is wrong."""
    if key is None:
        return None
    name = "--api-key (or TQEXPORT_API_KEY)"
    if not key:
        raise TQExportError(f"{name} is empty; give a key or none")
    for i, ch in enumerate(key):
        if not "!" <= ch <= "~":
            kind = ("a space" if ch == " " else "a non-ASCII character" if ord(ch) > 127
                    else f"the control character {printable(ch)}")  # fmt: skip
            raise TQExportError(
                f"{name} has {kind} at position {i + 1}, which no client can send in an "
                "Authorization header; use printable ASCII without spaces"
            )
    return key


def serve_options(key: str | None, metrics_public: bool, port: int, grace_seconds: float,
                  replicas: int, replica_cpus: float, max_replicas_per_node: int | None,
                  ray: bool, given: list[str]) -> None:  # fmt: skip
    """``serve``'s own options before anything loads; the Ray ones (``given``: field names of
    those given) only with ``--ray``."""
    if key is None and os.environ.get("TQEXPORT_API_KEY") == "":
        raise TQExportError("TQEXPORT_API_KEY is set but empty; give a key or unset it")
    api_key(key)
    if metrics_public and key is None:
        raise TQExportError(
            "--metrics-public needs --api-key (or TQEXPORT_API_KEY): without a key every route "
            "is open already"
        )
    integer(port, "--port", 0, 65535)
    number(grace_seconds, "--grace-seconds", 0.0)
    integer(replicas, "--replicas", 1, 1024)
    number(replica_cpus, "--replica-cpus", 0.0)
    if max_replicas_per_node is not None:
        integer(max_replicas_per_node, "--max-replicas-per-node", 1, 100)  # Ray's range
    for name in ("replicas", "ray_address", "replica_cpus", "max_replicas_per_node"):
        if name in given and not ray:
            flag = "--" + name.replace("_", "-")
            raise TQExportError(
                f"{flag} needs --ray (it sets up Ray Serve); add --ray or drop {flag}"
            )


def physical_memory() -> int | None:
    """Bytes of RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


_BIDI = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A))


def printable(text: object, keep_newlines: bool = False) -> str:
    """``text`` with control characters (terminal escape codes, bidi overrides) shown as escapes
    (``\\x1b``, ``\\n``), so a user string prints literally and on one line. ``keep_newlines``
    leaves newlines and tabs alone (generated text)."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        o = ord(ch)
        if keep_newlines and ch in "\n\t":
            out.append(ch)
        elif o in _BIDI or unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            esc = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch)
            out.append(esc or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"))
        else:
            out.append(ch)
    return "".join(out)


def path_kind(path: Path) -> str | None:
    """What ``path`` is ("a folder", "a file", "a character device", ...; links followed),
    None when nothing is there: so a wrong kind of path is named, not called missing."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL byte in the name
        return None
    return file_kind(mode)


def regular_file(path: Path, option: str, noun: str = "a file", fix: str = "") -> Path:
    """``path`` when it is a regular file (never a device or FIFO, which can block or never
    end); else one error: "OPTION PATH not found" or "... is a folder, not NOUN; FIX"."""
    kind = path_kind(path)
    if kind == "a file":
        return path
    problem = "not found" if kind is None else f"is {kind}, not {noun}"
    raise TQExportError(f"{option} {path} {problem}" + (f"; {fix}" if fix else ""))


#: the largest text file read (--prompts-file, --calibration-text, bench's --text-file): more
#: than any model's context
MAX_TEXT_FILE_BYTES = 256 * 2**20


def text_file(path: Path, option: str) -> str:
    """The text of the UTF-8 file ``option`` names, or one error naming both: missing, not a
    regular file, larger than :data:`MAX_TEXT_FILE_BYTES`, not UTF-8, or blank."""
    regular_file(path, option, "a text file", "give a UTF-8 text file")
    data = read_regular_file(path, option, MAX_TEXT_FILE_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TQExportError(
            f"{option} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); give a UTF-8 text file"
        ) from None
    if not text.strip():
        raise TQExportError(f"{option} {path} is empty; give a UTF-8 text file")
    return text


def prompt_source(prompt: str | None, path: Path | None) -> None:
    """``run`` reads one prompt or one prompts file, and a prompt must say something."""
    if (prompt is None) == (path is None):
        raise TQExportError("give exactly one of --prompt and --prompts-file")
    if prompt is not None and not prompt.strip():
        raise TQExportError("--prompt is empty")


def prompts_file(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 prompts file, or one error naming the file."""
    return [ln for ln in text_file(path, "--prompts-file").splitlines() if ln.strip()]


#: the KV budget when neither a block count nor a memory size is given
DEFAULT_KV_CACHE_MEMORY = "512MiB"
#: what ``--kv-cache-memory`` and other sizes accept, in bytes per unit
MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_memory(text: str, option: str = "--kv-cache-memory") -> int:
    """'512MiB' -> bytes (a positive size); ``option`` names the flag in the error."""
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]i?B|B)?\s*", str(text), re.I)
    if not m:
        raise TQExportError(
            f"{option}: cannot read {str(text)!r}; write e.g. 512MiB or 2GiB (units B, KiB, MiB, "
            "GiB, TiB, KB, MB, GB, TB)"
        )
    n = int(float(m[1]) * MEMORY_UNITS[(m[2] or "").upper()])
    if n < 1:
        raise TQExportError(f"{option} must be a positive size, got {text!r}")
    return n
