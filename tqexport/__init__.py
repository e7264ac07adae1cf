"""tqexport: per-layer quantized KV caches, exported."""

__version__ = "0.1.0"
