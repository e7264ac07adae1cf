"""Read a model's config (no weights) and describe its attention layers for resolution."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import MAX_HEAD_SIZE, MODEL_DTYPES
from tqexport.models import builtins
from tqexport.models.description import AttentionLayer, ModelDescription
from tqexport.safe_files import write_file
from tqexport.spec import (
    MAX_HEADS,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
    MAX_WINDOW,
    config_digest,
)

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


#: bytes of a config.json read (real ones are a few KiB; 1024 layer types take ~20 KiB)
MAX_CONFIG_BYTES = 1 << 24
#: nesting of a config.json (real ones nest 3 levels: text_config, rope_scaling, a list)
MAX_CONFIG_DEPTH = 32
#: hidden and MLP widths (the widest models have ~50k); weight estimates multiply them
MAX_WIDTH = 1 << 20
#: config field -> (smallest, largest) value taken: the spec's own limits, checked before
#: transformers or tqexport builds anything per layer (a 700-byte config can claim 10^7 layers)
_SIZE_LIMITS = {
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_KV_HEADS),
    "head_dim": (1, MAX_HEAD_SIZE),
    "hidden_size": (1, MAX_WIDTH),
    "intermediate_size": (1, MAX_WIDTH),
    "sliding_window": (0, MAX_WINDOW),
    "vocab_size": (1, MAX_VOCAB_SIZE),
}
#: what a damaged config.json or GGUF header raises in json, transformers or gguf
_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, EOFError, OverflowError, struct.error)


def check_sizes(values: Mapping, name: str) -> None:
    """Refuse sizes outside :data:`_SIZE_LIMITS` (None: not given) and a head size above
    ``MAX_HEAD_SIZE``: one line naming the field, before any per-layer work or allocation."""
    for key, (lo, hi) in _SIZE_LIMITS.items():
        v = values.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise TQExportError(
                f"{name}: config {key} must be an integer from {lo} to {hi} (tqexport's limit), "
                f"got {v!r:.40}; is the config damaged?"
            )
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    if values.get("head_dim") is None and hidden and heads and hidden // heads > MAX_HEAD_SIZE:
        raise TQExportError(
            f"{name}: config hidden_size {hidden} / num_attention_heads {heads} is a head size of "
            f"{hidden // heads}, more than {MAX_HEAD_SIZE} (tqexport's limit); is the config "
            "damaged?"
        )
    types = values.get("layer_types")
    if isinstance(types, list | tuple) and len(types) > MAX_LAYERS:
        raise TQExportError(
            f"{name}: config layer_types lists {len(types)} layers, more than {MAX_LAYERS} "
            "(tqexport's limit); is the config damaged?"
        )


def _nesting(value, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests at most ``limit`` lists/objects deep."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True


def check_config_dict(d, name: str) -> None:
    """A raw config (config.json or GGUF metadata) before transformers sees it: an object,
    nested at most :data:`MAX_CONFIG_DEPTH` deep, its sizes (and its text config's) bounded."""
    if not isinstance(d, dict):
        raise TQExportError(f"{name}: the config must be a JSON object, got {type(d).__name__}")
    if not _nesting(d, MAX_CONFIG_DEPTH):
        raise TQExportError(
            f"{name}: the config nests lists/objects more than {MAX_CONFIG_DEPTH} deep; "
            "is it damaged?"
        )
    check_sizes(d, name)
    if isinstance(d.get("text_config"), dict):
        check_sizes(d["text_config"], name)


def _read_json(path: Path, name: str) -> dict:
    """A config.json, parsed and checked (:func:`check_config_dict`)."""
    with path.open("rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise TQExportError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; not a config")
    try:
        d = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TQExportError(
            f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None
    except RecursionError:
        raise TQExportError(f"{path} is not a config: its JSON nests too deeply") from None
    except json.JSONDecodeError as e:
        raise TQExportError(f"{path} is not valid JSON ({e})") from None
    check_config_dict(d, name)
    return d


def _gguf_config_dict(path: Path) -> dict:
    """A GGUF file's metadata as transformers maps it to a config, kept as JSON beside the
    converted weights: transformers parses every metadata array (a 262k-token vocabulary takes
    minutes), the config is a few hundred bytes."""
    from transformers import PretrainedConfig

    from tqexport.models.cache import gguf_cache

    target = gguf_cache(path)
    kept = target.with_name(f"{target.name}.config.json")
    if kept.is_file():
        try:
            return json.loads(kept.read_text())
        except (OSError, ValueError):
            pass  # damaged or half-read: parse the GGUF again
    d, _ = PretrainedConfig.get_config_dict(str(path.parent), gguf_file=path.name)
    try:
        write_file(kept, json.dumps(d))
    except (OSError, TypeError, ValueError):
        pass  # a read-only cache or a value JSON cannot hold: parse it again next time
    return d


def _gguf_config(path: Path, name: str):
    """A GGUF file's config: its metadata as transformers maps it, checked, then the config
    class built from it as ``AutoConfig`` does (so the metadata is parsed once, not twice)."""
    from transformers import CONFIG_MAPPING

    d = _gguf_config_dict(path)
    check_config_dict(d, name)
    if d.get("model_type") not in CONFIG_MAPPING:
        raise TQExportError(f"{name}: GGUF architecture {d.get('model_type')!r} is unknown")
    return CONFIG_MAPPING[d["model_type"]].from_dict(d, gguf_file=path.name)


def load_config(model: str):
    """Config of MODEL: a built-in name, an HF directory, a config.json or a .gguf file.

    Returns ``(config, source)``; nothing but the config (GGUF: its metadata) is read, and its
    sizes are checked (:func:`check_config_dict`) before transformers builds anything from it.
    """
    if model in builtins.TINY_CONFIGS:
        return builtins.tiny_config(model), f"builtin:{model}"
    path = builtins.builtin_gguf(model) if model in builtins.GGUF_BUILTINS else Path(model)
    kind = validate.path_kind(path)
    if kind not in ("a folder", "a file"):
        names = ", ".join(builtins.BUILTIN_NAMES)
        problem = "not found:" if kind is None else f"is {kind}, not a model;"
        raise TQExportError(
            f"model {model!r} {problem} give an HF model directory, a config.json, "
            f"a .gguf file, or a built-in name ({names})"
        )
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise TQExportError(f"{path} has no config.json; is it a Hugging Face model dir?")
            _read_json(path / "config.json", model)
            from transformers import AutoConfig  # after the checks: importing it takes seconds

            return AutoConfig.from_pretrained(path), f"hf:{path.name}"
        if path.suffix == ".gguf":
            return _gguf_config(path, model), f"gguf:{path.name}"
        if path.suffix == ".json":
            _read_json(path, model)
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(path), f"config:{path.name}"
    except TQExportError:
        raise
    except _READ_ERRORS as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.suffix == ".gguf":
            raise TQExportError(
                f"cannot read the GGUF header of {model} ({first}); the file is truncated or "
                "damaged, download it again"
            ) from None
        raise TQExportError(f"cannot read the config of {model}: {first}") from None
    raise TQExportError(
        f"model {model!r} is a file but neither a .json config nor a .gguf file; give an HF "
        "model directory, a config.json or a .gguf file"
    )


def describe_config(config, name: str, source: str = "", dtype: str | None = None):
    """ModelDescription of a transformers config; unsupported architectures fail clearly."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(set(SUPPORTED_MODEL_TYPES.values())))
        raise TQExportError(
            f"unsupported architecture {model_type!r} ({name}); tqexport supports: {supported}"
        )
    check_sizes({k: getattr(cfg, k, None) for k in (*_SIZE_LIMITS, "layer_types")}, name)
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
        scalar = cfg.query_pre_attn_scalar
        if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
            raise TQExportError(
                f"{name}: config query_pre_attn_scalar must be a positive number, got "
                f"{scalar!r:.40}"
            )
        scale = float(scalar) ** -0.5
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
    if model_dtype not in MODEL_DTYPES:
        raise TQExportError(f"{name}: model dtype {model_dtype!r} is not {'/'.join(MODEL_DTYPES)}")
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
        parameters=_parameters(cfg, int(heads), int(kv_heads), int(head_size)),
        max_position_embeddings=_position_limit(cfg),
    )


def _position_limit(cfg) -> int | None:
    """The config's max_position_embeddings when it is a usable one (None: absent or odd; the
    serving side then falls back as for an artifact built before it was recorded)."""
    n = getattr(cfg, "max_position_embeddings", None)
    ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_POSITIONS
    return n if ok else None


def _parameters(cfg, heads: int, kv_heads: int, head_size: int) -> int:
    """The weights of a Llama-like decoder, from its config: embeddings (and an untied head),
    and per layer the q/k/v/o projections and a gated MLP (norms and biases left out)."""
    hidden = cfg.hidden_size
    mlp = 3 * hidden * (getattr(cfg, "intermediate_size", 0) or 0)
    attention = 2 * hidden * head_size * (heads + kv_heads)
    vocab = (getattr(cfg, "vocab_size", 0) or 0) * hidden
    tied = getattr(cfg, "tie_word_embeddings", False)
    return cfg.num_hidden_layers * (attention + mlp) + vocab * (1 if tied else 2)


def describe_model(model: str, dtype: str | None = None) -> ModelDescription:
    config, source = load_config(model)
    name = model if model in builtins.BUILTIN_NAMES else Path(model).name
    return describe_config(config, name, source, dtype)
