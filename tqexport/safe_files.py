"""How every file tqexport creates is created: never through a link planted at its name.

A file is written under a fresh name that ``tempfile`` makes in the target's folder
(``O_CREAT | O_EXCL``, so nothing planted there is opened) and renamed onto its name; a rename
replaces a link itself, never what it points to. Without ``force`` the final step is a
no-replace link, so even a file that appears between the check and the write is kept. Lock
files are created with ``O_EXCL | O_NOFOLLOW`` and only a file this process created is ever
written. Output paths are checked before any work (:func:`check_output_file`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import io
import os
import stat
import tempfile
from pathlib import Path

from tqexport.errors import TQExportError

#: renameat2 flags (linux/fs.h) and the "relative to the working directory" descriptor
RENAME_NOREPLACE, RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100
#: errors that mean "this kernel, libc or filesystem has no such operation"
UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: what a directory entry is, by its stat mode, in every message that names one
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What an entry of stat mode MODE is, for a message: "a folder", "a named pipe (FIFO)"..."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def check_output_file(path: Path, force: bool, option: str = "-o") -> Path:
    """Refuse, before any work, an output file that cannot or must not be written: an existing
    entry without ``force`` (with ``force``: anything but a regular file or a link, which the
    write replaces rather than follows), or a folder on the way that is a file or not writable.
    Returns the path."""
    shown = f"{option} {path}"
    try:
        st = path.lstat()
    except (FileNotFoundError, NotADirectoryError):  # the folders on the way are checked below
        st = None
    except OSError as e:
        raise TQExportError(f"{shown} cannot be checked ({e.strerror}); choose another") from None
    if st is not None:
        kind = file_kind(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            raise TQExportError(f"{shown} is a folder; give a file name")
        if not force:
            raise TQExportError(f"{shown} already exists ({kind}); pass --force to replace it")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise TQExportError(f"{shown} is {kind}; --force replaces only a file; choose another")
    parent = Path(os.path.abspath(path)).parent
    ancestor = next((p for p in (parent, *parent.parents) if os.path.lexists(p)), None)
    if ancestor is not None:
        if not ancestor.is_dir():
            raise TQExportError(f"{ancestor} is not a directory, so {shown} cannot be written")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise TQExportError(f"{ancestor} is not writable, so {shown} cannot be written")
    return path


@contextlib.contextmanager
def _temp_beside(path: Path, mode: int):
    """A fresh file beside ``path`` (``mkstemp``: never an entry that was there) as (file
    object, its name); removed on exit unless the caller renamed or linked it away."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode & ~_umask())
            yield f, tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def replacing(path: Path, mode: int = 0o666):
    """A binary file object to fill; on success it becomes ``path`` (renamed over whatever is
    there: a link is replaced, not followed), on failure it is removed. For large files."""
    with _temp_beside(path, mode) as (f, tmp):
        yield f
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)


def write_file(path: Path, data: bytes | str, *, force: bool = True, mode: int = 0o666) -> None:
    """Write ``data`` as a new file at ``path`` (its folders made as needed) under a fresh
    temporary name beside it, then rename it onto ``path``, replacing whatever is there when
    ``force`` (a link is replaced, not followed), else refusing anything there with
    FileExistsError. The file gets ``mode`` less the umask; no reader sees half a file."""
    with _temp_beside(path, mode) as (f, tmp):
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            _link_noreplace(tmp, path)


def _link_noreplace(tmp: str, path: Path) -> None:
    """Give the finished file ``tmp`` the name ``path`` unless something has that name."""
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as e:  # a filesystem without hard links
        if e.errno not in UNSUPPORTED | {errno.EPERM, errno.EMLINK, errno.EXDEV}:
            raise
        if not renameat2(Path(tmp), path, RENAME_NOREPLACE):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
            os.replace(tmp, path)


def write_output(path: Path, data: bytes | str, force: bool, option: str = "-o") -> None:
    """The user-named output file ``path``: checked as :func:`check_output_file` does, then
    written as :func:`write_file` does; one-line errors."""
    check_output_file(path, force, option)
    try:
        write_file(path, data, force=force)
    except FileExistsError:
        raise TQExportError(
            f"{option} {path} was created by something else meanwhile; left it as it is; pass "
            "--force to replace it"
        ) from None
    except OSError as e:
        raise TQExportError(f"cannot write {option} {path}: {e.strerror or e}") from None


def make_temp_dir(beside: Path) -> Path:
    """A fresh private folder next to ``beside`` (created, never reused), to fill and rename."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=".tmp"))


def create_exclusive(path: Path, flags: int = os.O_RDWR, mode: int = 0o644) -> int:
    """A descriptor of a new file at ``path``: FileExistsError if anything (a link included)
    has that name; nothing is followed."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def open_existing_nofollow(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the existing entry ``path`` without following a link (ELOOP if it is
    one) and without blocking on a FIFO."""
    return os.open(path, flags | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK)


def read_regular_file(path: Path, option: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` that ``option`` names, at most ``max_bytes``:
    anything else (missing, a device such as /dev/zero, a FIFO, a folder, larger) is one error
    naming both. Opened without blocking and checked on the open descriptor, so a FIFO swapped
    in after a check neither blocks nor is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise TQExportError(f"{option} {path} not found") from None
    except OSError as e:
        raise TQExportError(f"cannot read {option} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TQExportError(f"{option} {path} is {file_kind(st.st_mode)}; give a regular file")
        if st.st_size > max_bytes:
            raise TQExportError(f"{option} {path} has {st.st_size} bytes, more than {max_bytes}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise TQExportError(f"cannot read {option} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew after the check
        raise TQExportError(f"{option} {path} has more than {max_bytes} bytes")
    return data


@functools.cache
def _libc_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2``; False where the libc, kernel or filesystem lacks it or the flag."""
    fn = _libc_renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def write_figure(fig, path: Path, force: bool = True, **savefig_kwargs) -> None:
    """A matplotlib figure saved as PNG through :func:`write_file` (never through a link)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kwargs)
    write_file(path, buf.getvalue(), force=force)
