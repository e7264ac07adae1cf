"""Load a model with weights: HF directory, GGUF file (cached as safetensors), or built-in."""

from __future__ import annotations

import pickle
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import MODEL_DTYPES
from tqexport.models import builtins
from tqexport.models.cache import gguf_cache
from tqexport.models.config import describe_config, load_config
from tqexport.models.description import ModelDescription
from tqexport.safe_files import make_temp_dir

TINY_SEED = 0


@dataclass
class LoadedModel:
    model: torch.nn.Module
    description: ModelDescription
    tokenizer: object | None  # a transformers tokenizer, or None for tiny random models
    generation_config: object | None


@contextmanager
def parsed_once(path: Path):
    """transformers parses a GGUF file's metadata (every vocabulary array) once per use: for the
    weights, again for the tokenizer's config. Within this block it parses ``path`` once and
    hands every later caller that parse (the tensors are never kept)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse, kept = gguf_utils.load_gguf_checkpoint, {}

    def once(checkpoint, return_tensors=False, **kwargs):
        if Path(checkpoint) != path or (return_tensors and "tensors" in kept):
            return parse(checkpoint, return_tensors=return_tensors, **kwargs)
        if not kept or return_tensors:
            got = parse(checkpoint, return_tensors=return_tensors, **kwargs)
            kept.update({k: v for k, v in got.items() if k != "tensors"}, tensors=return_tensors)
            return got
        return {k: v for k, v in kept.items() if k != "tensors"}

    gguf_utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = parse


def _load_gguf(path: Path, config, dtype: torch.dtype):
    """transformers' GGUF loader dequantizes every load; keep a safetensors copy instead. The
    file is parsed once: CONFIG is its metadata already mapped (kept by load_config)."""
    from safetensors.torch import save_model as save_safetensors
    from transformers import AutoModelForCausalLM

    target = gguf_cache(path)
    if not (target / "config.json").is_file():
        with parsed_once(path):
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, config=config
            )
            tok, gen = _read_tokens(path.parent, config, gguf_file=path.name)
        tmp = make_temp_dir(target)
        # The weights are dequantized already; drop the GGUF quantizer so they save as-is.
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.save_pretrained(tmp)
        save_safetensors(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it meanwhile (or a link is in the way)
            shutil.rmtree(tmp, ignore_errors=True)
            if not (target / "config.json").is_file():
                raise
    return _load_dir(target, dtype)


def load_tokenizer(name: str, config) -> tuple:
    """MODEL's (tokenizer, generation config) without its weights: from the converted copy of
    a GGUF when there is one, else parsed from the file; an HF directory's own files. CONFIG is
    MODEL's config (the generation defaults when it has no generation_config.json)."""
    path = source_path(name)
    if path.suffix != ".gguf":
        return _read_tokens(path if path.is_dir() else path.parent, config)
    converted = gguf_cache(path)
    if (converted / "tokenizer_config.json").is_file():
        return _read_tokens(converted, config)
    with parsed_once(path):
        return _read_tokens(path.parent, config, gguf_file=path.name)


def _read_tokens(root: Path, config, gguf_file: str | None = None) -> tuple:
    """(tokenizer or None, generation config) of directory ROOT, or of GGUF_FILE in it. Without
    a generation_config.json the model's generation defaults come from CONFIG, as transformers
    derives them for a loaded model: the artifact carries the same file either way."""
    from transformers import AutoTokenizer, GenerationConfig

    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    tok = None
    if gguf_file or any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(root, **gguf)
    try:
        gen = GenerationConfig.from_pretrained(root, **gguf)
    except (OSError, ValueError):
        gen = GenerationConfig.from_model_config(config)
    return tok, gen


def source_path(name: str) -> Path:
    """The file or directory MODEL's weights are read from (a built-in's GGUF, or MODEL)."""
    return builtins.builtin_gguf(name) if name in builtins.GGUF_BUILTINS else Path(name)


def _load_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, output_loading_info=True
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers fills them with random values and carries on
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise TQExportError(
            f"{path} holds no weight for {', '.join(missing[:3])}{more}: its checkpoint is not "
            "one of the model its config.json describes; give the model's own weights"
        )
    tok, gen = _read_tokens(path, model.config)
    return model, tok, gen


@contextmanager
def _quiet_transformers():
    """transformers' load report and progress bar off in the block: what is missing is our
    error line, what is unexpected is harmless (and the bars would precede every message)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _checkpoint_files(root: Path) -> list[Path]:
    """The pickle checkpoints of an HF directory (what transformers torch.loads)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))


@contextmanager
def _warnings_on_success():
    """Hold the warnings raised in the block (torch's "Detected pickle protocol" for a raw
    pickle checkpoint): shown when it succeeds, dropped when it fails, so a refused checkpoint
    is one ``error:`` line."""
    with warnings.catch_warnings(record=True) as held:
        yield
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def check_memory(desc: ModelDescription) -> None:
    """Refuse, before any allocation, a model whose weights (estimated from its config at the
    model dtype) exceed this machine's memory: loading would swap or be killed."""
    from tqexport.console import fmt_bytes

    need = desc.parameters * MODEL_DTYPES[desc.dtype].itemsize
    limit = validate.physical_memory()
    if limit is not None and need > limit:
        half = desc.dtype == "float32" and need // 2 <= limit
        smaller = "; try --dtype float16" if half else "; use a smaller model or a larger machine"
        raise TQExportError(
            f"{desc.name}: its weights take about {fmt_bytes(need)} as {desc.dtype} "
            f"({desc.parameters:,} parameters by its config), more than this machine's "
            f"{fmt_bytes(limit)} of memory{smaller}"
        )


def load_model(name: str, dtype: str | None = None) -> LoadedModel:
    """Load MODEL for export: weights, tokenizer, generation config, and its description."""
    from transformers import AutoModelForCausalLM

    config, source = load_config(name)
    desc = describe_config(
        config, name if name in builtins.BUILTIN_NAMES else Path(name).name, source, dtype
    )
    check_memory(desc)
    torch_dtype = MODEL_DTYPES[desc.dtype]
    if name in builtins.TINY_CONFIGS:
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        tok, gen = None, model.generation_config
    else:
        path = builtins.builtin_gguf(name) if name in builtins.GGUF_BUILTINS else Path(name)
        root = path if path.is_dir() or path.suffix == ".gguf" else path.parent
        try:
            with _warnings_on_success():
                if path.suffix == ".gguf":
                    model, tok, gen = _load_gguf(path, config, torch_dtype)
                else:
                    model, tok, gen = _load_dir(root, torch_dtype)
        except TQExportError:
            raise
        except pickle.UnpicklingError as e:
            # torch.load(weights_only=True) refused a pickle: it names a global it would run
            files = _checkpoint_files(root) or [root]
            reason = [ln for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
            raise TQExportError(
                f"cannot load the weights of {name}: {', '.join(str(f) for f in files)} is not a "
                f"plain PyTorch checkpoint, torch refused to unpickle it "
                f"({(reason or [_first_line(e)])[0].strip()}); only load it if you trust it, "
                "or convert it to safetensors"
            ) from None
        except (OSError, ValueError, RuntimeError, EOFError) as e:
            # a truncated or damaged file: torch, safetensors, json and transformers raise these
            raise TQExportError(f"cannot load the weights of {name}: {_first_line(e)}") from None
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise TQExportError(
                f"cannot load the weights of {name}: a safetensors file is damaged "
                f"({_first_line(e)})"
            ) from None
    model.eval()
    return LoadedModel(model, desc, tok, gen)
