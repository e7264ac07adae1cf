"""The files of an artifact directory, how any of them is opened (confined to the artifact), and
the ONNX metadata entry that embeds the spec."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import onnx

from tqexport.errors import TQExportError
from tqexport.safe_files import file_kind
from tqexport.spec import ModelSpec

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
SPEC_FILE = "tqexport.json"
#: written by ``tqexport engine``: the serialized TensorRT engine and its profile limits
ENGINE_FILE = "engine.plan"
PROFILE_FILE = "engine.json"
SPEC_METADATA_KEY = "tqexport.spec"
#: written last by ``tqexport build``: every file the build wrote, so ``--force`` can tell an
#: artifact's files from a user's
MANIFEST_FILE = "tqexport.files.json"
#: files other commands add to a built artifact
ADDED_FILES = frozenset({ENGINE_FILE, PROFILE_FILE})
#: bytes a manifest may take (names of a few dozen files)
_MAX_MANIFEST_BYTES = 1 << 20
GENERATION_CONFIG_FILE = "generation_config.json"
#: where transformers 5 keeps the chat template, and the older place
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
#: a tokenizer's extra named chat templates (``NAME.jinja`` files), written by transformers
CHAT_TEMPLATE_DIR = "additional_chat_templates"
#: the tokenizer file set: every name transformers may read from a tokenizer directory that an
#: artifact can carry (config files, fast and slow vocabularies, chat templates); only these are
#: handed to transformers (see ``runtime.text.load_tokenizer``)
TOKENIZER_SET = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    *CHAT_TEMPLATE_FILES,
    "config.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "tekken.json",
    "tiktoken.model",
)


def _confined(root: Path, name: str) -> tuple[Path, Path, os.stat_result] | None:
    """(``root / name``, its real path, its stat), None when there is no such entry; one
    ``TQExportError`` naming the file when it must not be opened (see :func:`artifact_file`)."""
    path = Path(root) / name
    fix = "copy the file itself into the artifact or rebuild it"
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise TQExportError(f"cannot read {path} ({e.strerror})") from None
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TQExportError(f"{path} is a link loop; {fix}") from None
        if isinstance(e, FileNotFoundError):
            target = os.path.realpath(path)
            raise TQExportError(
                f"{path} is a link to {target!r:.200}, which does not exist; {fix}"
            ) from None
        raise TQExportError(f"cannot read {path} ({e.strerror})") from None
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(root)):
        raise TQExportError(
            f"{path} is a link to {str(real)!r:.200}, outside the artifact; refusing to read it, "
            f"{fix}"
        )
    if not stat.S_ISREG(st.st_mode):
        raise TQExportError(f"{path} is {file_kind(st.st_mode)}, not a regular file; {fix}")
    return path, real, st


def artifact_file(root: Path, name: str) -> Path | None:
    """``root / name`` checked before anything (this package, ONNX Runtime, TensorRT,
    transformers) opens it: None when the artifact has no such entry, else a regular file whose
    real path lies inside the artifact's real directory.

    Anything else is one ``TQExportError`` naming the file: a link (or a linked directory on
    the way) whose target lies outside the artifact, a dangling link, a link loop, and
    directories, FIFOs, sockets and devices (opening a FIFO would block). Links that stay
    inside the artifact are allowed: they read only the artifact's own bytes (e.g. a weights
    file linked to a renamed copy next to it), so refusing them would protect nothing. A path
    handed to another library is checked here, not opened: replacing the file between the two
    is not guarded against (:func:`read_artifact_file` is, for what this package reads)."""
    found = _confined(root, name)
    return None if found is None else found[0]


def read_artifact_file(root: Path, name: str, max_bytes: int | None = None) -> bytes | None:
    """The bytes of ``root / name`` (at most ``max_bytes``), checked as :func:`artifact_file`
    does; opened by its real path without following a link and without blocking, and refused
    when what was opened is not the file that was checked (replaced meanwhile)."""
    found = _confined(root, name)
    if found is None:
        return None
    path, real, st = found
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        raise TQExportError(f"cannot read {path} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise TQExportError(
                f"{path} was replaced while being opened; retry when nothing is changing the "
                "artifact"
            )
        try:
            return f.read() if max_bytes is None else f.read(max_bytes)
        except OSError as e:
            raise TQExportError(f"cannot read {path} ({e.strerror})") from None


def set_spec_metadata(model: onnx.ModelProto, spec: ModelSpec) -> None:
    """Embed ``spec`` in the graph (replacing an older copy)."""
    for prop in list(model.metadata_props):
        if prop.key == SPEC_METADATA_KEY:
            model.metadata_props.remove(prop)
    entry = model.metadata_props.add()
    entry.key, entry.value = SPEC_METADATA_KEY, spec.to_json()


def read_spec_metadata(model: onnx.ModelProto) -> str:
    """The spec JSON embedded in the graph."""
    for prop in model.metadata_props:
        if prop.key == SPEC_METADATA_KEY:
            return prop.value
    raise TQExportError(f"the ONNX model has no {SPEC_METADATA_KEY!r} metadata")


def write_manifest(root: Path) -> None:
    """List every file under ``root`` (a finished build) in its MANIFEST_FILE."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    (root / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def read_manifest(root: Path) -> frozenset[str] | None:
    """The files a build wrote into ``root`` (its manifest included), as relative POSIX paths;
    None when the manifest is missing or not one."""
    try:
        raw = read_artifact_file(root, MANIFEST_FILE, _MAX_MANIFEST_BYTES)
        data = None if raw is None else json.loads(raw)
    except (TQExportError, ValueError, RecursionError):  # a link outward, a FIFO, ...
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(x, str) and x for x in files):
        return None
    return frozenset(files) | {MANIFEST_FILE}
