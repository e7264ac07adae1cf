"""Where a build writes: refuse what it must not replace, stage in a sibling, swap atomically.

``--force`` replaces only an empty directory or exactly an artifact: the files its manifest lists
(plus those ``tqexport engine`` adds), each present, nothing else, and a spec that loads and
validates; anything else is refused, so a mistyped ``-o`` never deletes a user's files. A build
holds an exclusive lock, ``.NAME.lock`` beside the target, from its check to its swap, so a second
build to the same target fails at once. It is staged in ``.NAME.tmp-PID`` beside the target,
whose creation proves the location is writable before any export work. The swap never replaces
what the check did not see: a new target is moved in with an atomic no-replace rename, and an
old artifact is exchanged with the staged one and put back unless it is the same directory with
the same files as at the check; it is removed only after the new one is in place. Staging
directories of builds whose process is gone (kill -9, power loss) are removed by the next build.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
from pathlib import Path

from tqexport.contract.artifact import open_artifact
from tqexport.contract.files import ADDED_FILES, MANIFEST_FILE, SPEC_FILE, read_manifest
from tqexport.errors import TQExportError
from tqexport.safe_files import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    UNSUPPORTED,
    create_exclusive,
    open_existing_nofollow,
    renameat2,
)

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")


def check_target(out_dir: Path, force: bool) -> Path:
    """The absolute target, or a one-line error when building there could lose data."""
    target = Path(os.path.abspath(out_dir))
    if target.parent == target:
        raise TQExportError(f"-o {out_dir} is a filesystem root; name a directory to create")
    cwd = Path.cwd().resolve()
    st = _lstat(target, out_dir)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise TQExportError(f"{out_dir} exists and is not a directory; choose another -o")
        if not force:
            raise TQExportError(f"{out_dir} already exists; pass --force to replace it")
        if target.resolve() == cwd or target.resolve() in cwd.parents:
            raise TQExportError(
                f"-o {out_dir} is the current directory or contains it; build elsewhere"
            )
        check_replaceable(target, out_dir)
    ancestor = next((p for p in target.parents if _lstat(p, out_dir) is not None), None)
    if ancestor is not None and not ancestor.is_dir():
        raise TQExportError(f"{ancestor} is not a directory, so {out_dir} cannot be created")
    if ancestor is not None and not os.access(ancestor, os.W_OK | os.X_OK):
        raise TQExportError(f"{ancestor} is not writable; choose another -o")
    return target


def _lstat(path: Path, out_dir: Path) -> os.stat_result | None:
    """``path``'s own entry (a link not followed), None where there is none; one line where a
    folder on the way cannot be searched (PermissionError otherwise)."""
    try:
        return path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise TQExportError(
            f"{path} cannot be looked at ({e.strerror}), so -o {out_dir} cannot be checked; "
            "choose another -o"
        ) from None


def check_replaceable(target: Path, shown: Path | str) -> None:
    """A one-line error unless the directory ``target`` (named ``shown``) is empty or exactly
    an artifact, naming what makes it more or less than that."""
    try:
        entries = _entries(target)
    except OSError as e:
        raise TQExportError(
            f"{shown} cannot be read ({e.strerror}), so --force cannot check it holds only an "
            "artifact; remove it yourself or choose another -o"
        ) from None
    if not entries:
        return
    files = {rel for rel, st in entries.items() if stat.S_ISREG(st.st_mode)}
    listed = read_manifest(target)
    if listed is None:
        if SPEC_FILE in files:
            raise TQExportError(
                f"{shown} has no readable {MANIFEST_FILE} listing the files its build wrote "
                "(an artifact of an older tqexport?), so --force cannot tell them from yours; "
                "remove it yourself or choose another -o"
            )
        raise TQExportError(
            f"{shown} is not a tqexport artifact (it holds {_names(entries)}); --force only "
            "replaces an artifact or an empty directory, so choose another -o"
        )
    folders = {str(Path(rel).parent) for rel in listed} - {"."}
    folders |= {str(p) for f in folders for p in Path(f).parents} - {"."}
    extra = [
        rel
        for rel, st in entries.items()
        if not (rel in files and rel in listed | ADDED_FILES)
        and not (stat.S_ISDIR(st.st_mode) and rel in folders)
    ]
    if extra:
        raise TQExportError(
            f"{shown} holds files no tqexport build wrote there: {_names(extra)}; --force only "
            "replaces a whole artifact, so move them out or choose another -o"
        )
    missing = listed - files
    if missing:
        raise TQExportError(
            f"{shown} is an incomplete artifact (missing {_names(missing)}); --force only "
            "replaces a whole artifact, so remove it yourself or choose another -o"
        )
    try:
        open_artifact(target)
    except TQExportError as e:
        raise TQExportError(
            f"{shown} is not a valid artifact ({e}); --force only replaces one that loads, "
            "so remove it yourself or choose another -o"
        ) from None


def _entries(root: Path) -> dict[str, os.stat_result]:
    """Every entry under ``root`` (links not followed) by relative POSIX path."""

    def fail(e: OSError):
        raise e

    out = {}
    for here, dirs, names in os.walk(root, onerror=fail):
        for name in dirs + names:
            p = Path(here, name)
            out[p.relative_to(root).as_posix()] = p.lstat()
    return out


def _names(paths) -> str:
    paths = sorted(paths)
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return ", ".join(paths[:3]) + more


def _snapshot(path: Path) -> tuple | None:
    """The directory's identity and every entry's type, size and mtime; None if absent."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    entries = _entries(path)
    files = {rel: (s.st_mode, s.st_size, s.st_mtime_ns) for rel, s in entries.items()}
    return st.st_dev, st.st_ino, files


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move the directory ``src`` to ``dst`` atomically; FileExistsError if ``dst`` exists.
    Without renameat2 the name is claimed with mkdir and ``src`` renamed onto that empty
    directory, which fails if anything was put into it meanwhile."""
    if renameat2(src, dst, RENAME_NOREPLACE):
        return
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        try:
            os.rmdir(dst)  # ours, unless something was written into it: then it stays
        except OSError:
            pass
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        raise


def remove_stale_staging(target: Path) -> list[Path]:
    """Delete ``.NAME.tmp-PID`` / ``.NAME.old-PID`` siblings of dead builds; returns them. Only
    real directories this user owns count: a link or someone else's folder of that name stays."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.iterdir():
        m = _STAGING.match(p.name)
        if not m or m["name"] != target.name or _alive(int(m["pid"])):
            continue
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover of an earlier process that had our pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lock:
    """An exclusive flock on ``.NAME.lock`` beside the target, held until ``release``, which
    removes the file; a second holder fails at once with a one-line error. The file is created
    with ``O_EXCL | O_NOFOLLOW`` and only a file this build created is written (its pid): a
    link at that name is refused, and a file left by a dead build (or put there by anyone) is
    unlinked once locked, never truncated, and created afresh."""

    def __init__(self, target: Path):
        self.path = target.with_name(f".{target.name}.lock")
        self.fd: int | None = None
        for _ in range(8):  # the holder may remove the file between our open and our flock
            created = True
            try:
                fd = create_exclusive(self.path, os.O_RDWR, 0o644)
            except FileExistsError:
                created = False
                try:
                    fd = open_existing_nofollow(self.path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise self._foreign(e) from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise self._foreign(None)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                pid = f" (pid {holder})" if holder.isdigit() else ""
                raise TQExportError(
                    f"another tqexport build{pid} is writing {target}; wait for it to finish "
                    "or choose another -o"
                ) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in UNSUPPORTED | {errno.ENOLCK}:
                    raise
                if created:  # no locks on this filesystem: the swap guards
                    self.path.unlink(missing_ok=True)
                return
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same and created:
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            if same:  # a stale lock file: locked by us, so no build holds it; remove the name
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    os.close(fd)
                    raise self._foreign(e) from None
            os.close(fd)
        raise TQExportError(f"cannot lock {self.path}: it keeps changing; try again")

    def _foreign(self, e: OSError | None) -> TQExportError:
        """The error for a lock name this build cannot use: a link, not a file, not ours."""
        try:
            what = "a symbolic link" if self.path.is_symlink() else None
        except OSError:
            what = None
        if what is None and e is not None and e.errno == errno.ELOOP:
            what = "a symbolic link"
        if what is None:
            what = f"not removable by this user ({e.strerror})" if e is not None else "not a file"
        return TQExportError(
            f"the lock file {self.path} is {what} that no tqexport build made; remove it or "
            "choose another -o"
        )

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still held, so no one locks a lost file
            os.close(self.fd)
            self.fd = None


class Staging:
    """The sibling directory a build writes into; ``commit`` swaps it in, ``discard`` undoes
    everything, including parent directories this build created."""

    def __init__(self, target: Path, force: bool = False):
        self.target = target
        #: parents this build creates, outermost first (removed again by ``discard``)
        self.created_parents = [p for p in target.parents if not p.exists()][::-1]
        self.path: Path | None = None  # the staged build, while it is ours to delete
        self._staged: tuple[int, int] | None = None  # its identity, checked before deleting
        self._lock: _Lock | None = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._lock = _Lock(target)
            remove_stale_staging(target)
            try:
                #: what the target was when checked under the lock (None: absent)
                self.replaces = _snapshot(target)
            except OSError:
                self.replaces = None  # unreadable: check_target refuses it
            check_target(target, force)
            path = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            path.mkdir()
            self.path, self._staged = path, _identity(path)
        except OSError as e:
            self.discard()
            raise TQExportError(f"cannot write into {target.parent}: {e.strerror}") from None
        except BaseException:
            self.discard()
            raise

    def check_free_space(self, need_bytes: int) -> None:
        free = shutil.disk_usage(self.path).free
        if free < need_bytes:
            raise TQExportError(
                f"{self.target.parent} has {free / 2**20:.0f} MiB free but the artifact needs "
                f"about {need_bytes / 2**20:.0f} MiB; free space or choose another -o"
            )

    def commit(self) -> str | None:
        """Make files readable as the umask allows, then swap the staged directory in; returns
        what it replaced (None when the target did not exist)."""
        mask = os.umask(0)
        os.umask(mask)
        for p in self.path.iterdir():
            if p.is_file():
                p.chmod(0o666 & ~mask)
        replaced = None
        if self.replaces is None:
            self._move_in()
        else:
            replaced = self._replace()
        self.path = None
        self._lock.release()
        return replaced

    def _move_in(self) -> None:
        try:
            rename_noreplace(self.path, self.target)
        except FileExistsError:
            raise TQExportError(
                f"{self.target} was created by something else during the build; left it as it "
                "is and discarded this build; remove it or choose another -o"
            ) from None

    def _replace(self) -> str | None:
        """Swap the old directory out, check it is what was checked, remove it; else put it
        back and refuse."""
        files = sum(stat.S_ISREG(mode) for mode, _, _ in self.replaces[2].values())
        what = f"the artifact that was in {self.target} ({files} files)"
        if not files:
            what = f"the empty directory {self.target}"
        try:
            exchanged = renameat2(self.path, self.target, RENAME_EXCHANGE)
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            if exchanged:
                old = self.path
            else:
                os.rename(self.target, old)
        except FileNotFoundError:  # removed meanwhile: nothing to replace
            self._move_in()
            return None
        if exchanged:
            self.path = None  # holds the old directory now, not ours to delete
        try:
            same = _snapshot(old) == self.replaces
        except OSError:
            same = False
        if not same:
            self._put_back(old, exchanged)
            raise TQExportError(
                f"{self.target} changed during the build (files added, removed or rewritten "
                "since the check); left it as it is and discarded this build; build again"
            )
        if not exchanged:
            try:
                rename_noreplace(self.path, self.target)
            except FileExistsError:
                raise TQExportError(
                    f"{self.target} was created by something else during the swap; left it as "
                    f"it is, moved the old artifact to {old} and discarded this build"
                ) from None
        shutil.rmtree(old, ignore_errors=True)
        return what

    def _put_back(self, old: Path, exchanged: bool) -> None:
        """Return the swapped-out directory ``old`` to the target's name."""
        try:
            if exchanged:
                renameat2(old, self.target, RENAME_EXCHANGE)
                self.path = old  # the staged build again, if it still is (see discard)
            else:
                rename_noreplace(old, self.target)
        except OSError:
            raise TQExportError(
                f"{self.target} changed during the build and could not be put back; its "
                f"earlier content is in {old}, nothing deleted; move it back yourself"
            ) from None

    def discard(self) -> None:
        if self.path is not None and _identity(self.path) == self._staged:
            shutil.rmtree(self.path, ignore_errors=True)
        self.path = None
        if self._lock is not None:
            self._lock.release()
        for p in reversed(self.created_parents):  # innermost first
            try:
                p.rmdir()
            except OSError:
                break
