"""Read a model's config (no weights) and describe its attention layers for resolution."""

from __future__ import annotations

from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.models import builtins
from tqexport.resolve import AttentionLayer, ModelDescription
from tqexport.spec import config_digest

#: transformers model_type -> architecture; tqexport hooks attention through transformers'
#: attention registry, verified for these.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_SCALAR_QUERY_SCALE_TYPES = {"gemma2", "gemma3_text"}
_SLIDING = {"sliding_attention", "sliding_window", "sliding"}
_FULL = {"full_attention", "full", "attention"}


def load_config(model: str):
    """Config of MODEL: a built-in name, an HF directory, a config.json or a .gguf file.

    Returns ``(config, source)``; nothing but the config (GGUF: its metadata) is read.
    """
    from transformers import AutoConfig

    if model == "smollm2":
        path = builtins.smollm2_gguf()
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), f"gguf:{path.name}"
    if model in builtins.TINY_CONFIGS:
        return builtins.tiny_config(model), f"builtin:{model}"
    path = Path(model)
    if not path.exists():
        names = ", ".join(builtins.BUILTIN_NAMES)
        raise TQExportError(
            f"model {model!r} not found: give an HF model directory, a config.json, "
            f"a .gguf file, or a built-in name ({names})"
        )
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise TQExportError(f"{path} has no config.json; is it a Hugging Face model dir?")
            return AutoConfig.from_pretrained(path), f"hf:{path.name}"
        if path.suffix == ".gguf":
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), f"gguf:{path.name}"
        if path.suffix == ".json":
            return AutoConfig.from_pretrained(path), f"config:{path.name}"
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, TQExportError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TQExportError(f"cannot read the config of {model}: {first}") from None
    raise TQExportError(f"{model}: expected a directory, a config.json or a .gguf file")


def describe_config(config, name: str, source: str = "", dtype: str | None = None):
    """ModelDescription of a transformers config; unsupported architectures fail clearly."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(set(SUPPORTED_MODEL_TYPES.values())))
        raise TQExportError(
            f"unsupported architecture {model_type!r} ({name}); tqexport supports: {supported}"
        )
    n_layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise TQExportError(f"{name}: config lists {len(types)} layer types for {n_layers} layers")
    if model_type in _SCALAR_QUERY_SCALE_TYPES:
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
    else:
        scale = float(head_size) ** -0.5
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    layers = []
    for i, kind in enumerate(types):
        if kind in _SLIDING:
            if not window:
                raise TQExportError(f"{name}: layer {i} is sliding but the config has no window")
            layer_window = int(window)
        elif kind in _FULL:
            layer_window = None
        else:
            raise TQExportError(f"{name}: layer {i} has unsupported attention type {kind!r}")
        layers.append(
            AttentionLayer(
                index=i,
                module=f"model.layers.{i}.self_attn",
                window=layer_window,
                num_kv_heads=int(kv_heads),
                head_size=int(head_size),
                scale=scale,
                softcap=float(softcap) if softcap else None,
            )
        )
    config_dtype = getattr(cfg, "dtype", None)
    model_dtype = dtype or (str(config_dtype).removeprefix("torch.") if config_dtype else "float32")
    if model_dtype not in ("float32", "float16", "bfloat16"):
        raise TQExportError(f"{name}: model dtype {model_dtype!r} is not float32/float16/bfloat16")
    return ModelDescription(
        name=name,
        architecture=SUPPORTED_MODEL_TYPES[model_type],
        dtype=model_dtype,
        num_heads=int(heads),
        layers=tuple(layers),
        config_digest=config_digest(
            {
                k: v
                for k, v in cfg.to_dict().items()
                if not k.startswith("_") and k != "transformers_version"
            }
        ),
        source=source,
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
    )


def describe_model(model: str, dtype: str | None = None) -> ModelDescription:
    config, source = load_config(model)
    name = model if model in builtins.BUILTIN_NAMES else Path(model).name
    return describe_config(config, name, source, dtype)
