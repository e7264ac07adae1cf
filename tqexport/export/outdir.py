"""Where a build writes: refuse what it must not replace, stage in a sibling, swap atomically.

``--force`` replaces only a directory that is a tqexport artifact (flat, with a
``tqexport.json`` that names a tqexport version) or an empty one; anything else is refused, so a
mistyped ``-o`` never deletes a user's files. The build is staged in ``.NAME.tmp-PID`` beside the
target, whose creation proves the location is writable before any export work; the old artifact
is swapped out (``.NAME.old-PID``) and removed only after the new one is in place. Staging
directories of builds whose process is gone (kill -9, power loss) are removed by the next build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from tqexport.errors import TQExportError

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")


def is_artifact_dir(path: Path) -> bool:
    """A flat directory whose tqexport.json is a JSON object written by tqexport."""
    from tqexport.contract.files import SPEC_FILE, read_artifact_file

    try:
        raw = read_artifact_file(path, SPEC_FILE, 64 << 20)
    except TQExportError:  # a link outward, a FIFO, ...: not one of ours
        return False
    if raw is None or any(p.is_dir() for p in path.iterdir()):
        return False
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and "tqexport_version" in data and "schema_version" in data


def check_target(out_dir: Path, force: bool) -> Path:
    """The absolute target, or a one-line error when building there could lose data."""
    target = Path(os.path.abspath(out_dir))
    if target.parent == target:
        raise TQExportError(f"-o {out_dir} is a filesystem root; name a directory to create")
    cwd = Path.cwd().resolve()
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise TQExportError(f"{out_dir} exists and is not a directory; choose another -o")
        if not force:
            raise TQExportError(f"{out_dir} already exists; pass --force to replace it")
        if target.resolve() == cwd or target.resolve() in cwd.parents:
            raise TQExportError(
                f"-o {out_dir} is the current directory or contains it; build elsewhere"
            )
        if any(target.iterdir()) and not is_artifact_dir(target):
            raise TQExportError(
                f"{out_dir} is not a tqexport artifact (no tqexport.json, or it holds "
                "subdirectories); --force only replaces artifacts or empty directories, "
                "so choose another -o or remove it yourself"
            )
    ancestor = next((p for p in target.parents if p.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        raise TQExportError(f"{ancestor} is not a directory, so {out_dir} cannot be created")
    if ancestor is not None and not os.access(ancestor, os.W_OK | os.X_OK):
        raise TQExportError(f"{ancestor} is not writable; choose another -o")
    return target


def remove_stale_staging(target: Path) -> list[Path]:
    """Delete ``.NAME.tmp-PID`` / ``.NAME.old-PID`` siblings of dead builds; returns them."""
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.iterdir():
        m = _STAGING.match(p.name)
        if m and m["name"] == target.name and p.is_dir() and not _alive(int(m["pid"])):
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


class Staging:
    """The sibling directory a build writes into; ``commit`` swaps it in, ``discard`` undoes
    everything, including parent directories this build created."""

    def __init__(self, target: Path):
        self.target = target
        #: parents this build creates, outermost first (removed again by ``discard``)
        self.created_parents = [p for p in target.parents if not p.exists()][::-1]
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self.path = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            if self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir()
        except OSError as e:
            raise TQExportError(f"cannot write into {target.parent}: {e.strerror}") from None

    def check_free_space(self, need_bytes: int) -> None:
        free = shutil.disk_usage(self.path).free
        if free < need_bytes:
            raise TQExportError(
                f"{self.target.parent} has {free / 2**20:.0f} MiB free but the artifact needs "
                f"about {need_bytes / 2**20:.0f} MiB; free space or choose another -o"
            )

    def commit(self) -> None:
        """Make files readable as the umask allows, then swap the staged directory in."""
        mask = os.umask(0)
        os.umask(mask)
        for p in self.path.iterdir():
            if p.is_file():
                p.chmod(0o666 & ~mask)
        old = None
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            self.target.rename(old)
        self.path.rename(self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        for p in reversed(self.created_parents):  # innermost first
            try:
                p.rmdir()
            except OSError:
                break
