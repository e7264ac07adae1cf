"""Export stand-ins for the matrices a build stores itself: each ``nn.Linear`` and
``nn.Embedding`` whose weight the build quantizes (or stores in fp16) becomes a module that
exports as one node of a private domain naming its weight; :mod:`tqexport.weights.graph`
replaces those nodes with standard ONNX ops over the stored initializers. The float weight
never enters the graph (nor, for a GGUF, memory): only biases and norms stay torch tensors.
"""

from __future__ import annotations

import torch

#: the private domain of the stand-in nodes (none survives the build)
PLACEHOLDER_DOMAIN = "tqexport.weights"
MATMUL, GATHER = "MatMul", "Gather"


class PlaceholderLinear(torch.nn.Module):
    """``x @ W.T (+ b)`` for the stored weight ``weight`` (``transposed``: the stored matrix is
    ``W`` itself as an embedding table holds it, read by a tied output head)."""

    def __init__(self, weight: str, in_features: int, out_features: int, bias, dtype):
        super().__init__()
        self.weight_name = weight
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.onnx.ops.symbolic(
            f"{PLACEHOLDER_DOMAIN}::{MATMUL}",
            [x],
            {"weight": self.weight_name, "in_features": self.in_features},
            dtype=self.dtype,
            shape=(*x.shape[:-1], self.out_features),
        )
        return y if self.bias is None else y + self.bias


class PlaceholderEmbedding(torch.nn.Module):
    """Rows of the stored table ``weight`` (times ``scale`` where the model scales its
    embeddings, as Gemma's does inside the embedding module)."""

    def __init__(self, weight: str, dim: int, dtype, scale: torch.Tensor | None = None):
        super().__init__()
        self.weight_name = weight
        self.dim = dim
        self.dtype = dtype
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.onnx.ops.symbolic(
            f"{PLACEHOLDER_DOMAIN}::{GATHER}",
            [ids],
            {"weight": self.weight_name, "dim": self.dim},
            dtype=self.dtype,
            shape=(*ids.shape, self.dim),
        )
        return out if self.scale is None else out * self.scale.to(self.dtype)


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def swap_in(model: torch.nn.Module, stored: set[str], dtype: torch.dtype) -> dict[str, str]:
    """Replace every Linear and Embedding whose ``<module>.weight`` is in ``stored`` by its
    stand-in; a Linear whose weight is tied to a stored embedding table reads that table.
    Returns each replaced module's weight name -> the stored name it reads."""
    owner = {}  # a parameter (by identity) -> the first name it has: ties share one
    for name, p in model.named_parameters(remove_duplicate=False):
        owner.setdefault(id(p), name)
    reads = {}
    for name, module in list(model.named_modules()):
        weight = f"{name}.weight" if name else "weight"
        if not isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            continue
        source = owner.get(id(module.weight), weight)
        if source not in stored:
            continue
        parent, attr = _parent(model, name)
        if isinstance(module, torch.nn.Embedding):
            scale = getattr(module, "embed_scale", None)
            setattr(parent, attr, PlaceholderEmbedding(source, module.embedding_dim, dtype, scale))
        else:
            stand_in = PlaceholderLinear(source, module.in_features, module.out_features,
                                         module.bias, dtype)  # fmt: skip
            setattr(parent, attr, stand_in)
        reads[weight] = source
    return reads
