"""Where the tool keeps what it derives from models on disk: converted GGUF weights and other
per-user caches (``TQEXPORT_CACHE`` overrides the location)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """The per-user cache folder (``TQEXPORT_CACHE`` overrides)."""
    base = os.environ.get("TQEXPORT_CACHE") or Path.home() / ".cache" / "tqexport"
    return Path(base)


def gguf_cache(path: Path) -> Path:
    """Where GGUF file PATH's converted weights are kept (keyed by its path, size, mtime)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "gguf" / f"{path.stem}-{key[:12]}"
