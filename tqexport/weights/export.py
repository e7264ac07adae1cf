"""The model a build exports when it stores weights itself: stand-ins where the stored matrices
go (:mod:`~tqexport.weights.placeholders`) and, per weight name, how to load what is stored.

From a GGUF file the model is built with empty weights and filled from the file: its block-
quantized matrices stay in their blocks (never dequantized), everything else is read as float.
From a loaded model (an HF checkpoint, or ``--weights fp16``) the Linear and Embedding weights
are quantized by ONNX Runtime's quantizer, or kept as float16, when the graph takes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tqexport.errors import TQExportError
from tqexport.weights.blocks import quantize_rtn
from tqexport.weights.graph import Stored
from tqexport.weights.placeholders import swap_in
from tqexport.weights.precision import EMBEDDING_BITS, gguf_type_refusal


@dataclass
class ExportWeights:
    """A model to export and the weights the graph stores itself (name -> loader)."""

    model: torch.nn.Module
    stored: dict[str, Stored]
    #: one line per matrix kept in float although the source stores it quantized
    notes: list[str] = field(default_factory=list)
    #: matrices kept in float although the source stores them quantized: name -> its type
    floats: dict[str, str] = field(default_factory=dict)


def _layer_weights(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every Linear and Embedding weight of ``model`` by parameter name."""
    return {
        f"{name}.weight": m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear | torch.nn.Embedding)
    }


def from_gguf(path: Path, config, dtype: torch.dtype, weights: str) -> ExportWeights:
    """The export model of GGUF file ``path`` with its blocks kept as ``--weights`` asks
    (``auto``: every mapped type as it is, the rest float; ``int8``/``int4``: every matrix at
    that width, or one error naming the first that cannot be)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from tqexport.weights.gguf_source import read_gguf

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = _layer_weights(model)
    found = read_gguf(path, model, dtype, set(layers), lambda t: gguf_type_refusal(t, weights))
    model.load_state_dict(found.dense, strict=False, assign=True)
    model.tie_weights()
    swap_in(model, set(found.blocks), dtype)
    empty = [n for n, p in model.named_parameters() if p.is_meta]
    if empty:
        raise TQExportError(
            f"{path.name} has no tensor for {', '.join(empty[:3])}"
            f"{f' and {len(empty) - 3} more' if len(empty) > 3 else ''}; it is not a complete "
            "GGUF of this architecture"
        )
    width = 8 if weights == "int8" else None
    stored: dict[str, Stored] = {}
    for name, src in found.blocks.items():
        stored[name] = (lambda s=src: s.decode().widened(width)) if width else src.decode
    return ExportWeights(model, stored, found.notes, found.floats)


def from_model(model: torch.nn.Module, weights: str, dtype: torch.dtype) -> ExportWeights:
    """The export model of a loaded ``model`` whose Linear and Embedding weights are stored as
    ``weights`` (``int8``/``int4``: ONNX Runtime's round-to-nearest quantizer, blocks of 32,
    embedding tables in 8 bits as Gather takes them; ``fp16``: float16)."""
    layers = _layer_weights(model)
    owner = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner.setdefault(id(p), name)
    stored: dict[str, Stored] = {}
    for name, module in layers.items():
        source = owner.get(id(module.weight), name)
        if source in stored:
            continue
        w = module.weight
        if weights == "fp16":
            stored[source] = lambda w=w: w.detach().to(torch.float16).numpy()
            continue
        bits = EMBEDDING_BITS if isinstance(module, torch.nn.Embedding) else int(weights[3:])
        if w.shape[1] % 32:
            continue  # stays float: not whole blocks
        stored[source] = lambda w=w, b=bits: quantize_rtn(w.detach().float().numpy(), b)
    swap_in(model, set(stored), dtype)
    return ExportWeights(model, stored, [])
