"""What bounds decode speed where a step is memory bound: the bytes one decode step reads (the
weights once, then every sequence's cached keys and values in its own format), taken from each
system's files on disk and cache formats, never from hard-coded sizes."""

from __future__ import annotations

from pathlib import Path

from tqexport.contract.files import MODEL_FILE, WEIGHTS_FILE


def footprint(
    weights_bytes: int,
    kv_bytes_per_token: float,
    recent_window: int = 0,
    recent_bytes_per_token: int = 0,
) -> dict:
    """What a step of one system reads: its weights, its KV bytes per cached token, and a
    recent window's (the last ``recent_window`` tokens are read from that cache instead)."""
    return {
        "weights_bytes": weights_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "recent_window": recent_window,
        "recent_bytes_per_token": recent_bytes_per_token,
    }


def artifact_footprint(art) -> dict:
    """A tqexport artifact's: its ONNX files on disk and its spec's cache bytes per token."""
    weights = sum((art.path / f).stat().st_size for f in (MODEL_FILE, WEIGHTS_FILE)
                  if (art.path / f).is_file())  # fmt: skip
    s = art.spec
    return footprint(weights, s.bytes_per_token, s.recent_window, s.recent_bytes_per_token)


def kv_elements_per_token(spec) -> int:
    """K and V elements one token adds over every layer of ``spec``'s model."""
    return sum(2 * la.cache.num_kv_heads * la.cache.head_size for la in spec.layers)


def genai_footprint(model_dir: Path, config: dict) -> dict:
    """An ONNX Runtime GenAI model (``genai_config.json`` as ``config``): its ONNX files on
    disk, fp32 keys and values of every decoder layer per token (its CPU models' cache)."""
    d = config["model"]["decoder"]
    weights = sum(f.stat().st_size for f in Path(model_dir).iterdir()
                  if f.name.endswith((".onnx", ".onnx.data")))  # fmt: skip
    per_token = 2 * d["num_hidden_layers"] * d["num_key_value_heads"] * d["head_size"] * 4
    return footprint(weights, per_token)


def gguf_footprint(gguf: Path, kv_elements: int, kv_bits: float) -> dict:
    """llama.cpp on a GGUF: the file on disk, ``kv_elements`` per token at ``kv_bits`` each."""
    return footprint(Path(gguf).stat().st_size, kv_elements * kv_bits / 8)


def step_bytes(fp: dict, context: int, batch: int) -> float:
    """Bytes one decode step of ``batch`` sequences holding ``context`` tokens reads."""
    w = min(context, fp.get("recent_window", 0))
    per_seq = (context - w) * fp["kv_bytes_per_token"] + w * fp.get("recent_bytes_per_token", 0)
    return fp["weights_bytes"] + batch * per_seq
