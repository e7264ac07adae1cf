"""What the tool knows about a model from its config alone: its attention layers (window, kv
heads, head size, scale, softcap) and identity, which resolution turns into the per-layer spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqexport.spec import AttentionType


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer as the model config describes it (no weights needed)."""

    index: int
    module: str
    window: int | None
    num_kv_heads: int
    head_size: int
    scale: float
    softcap: float | None = None

    @property
    def attention_type(self) -> AttentionType:
        return AttentionType.FULL if self.window is None else AttentionType.SLIDING_WINDOW


@dataclass(frozen=True)
class ModelDescription:
    """What resolution needs to know about a model."""

    name: str
    architecture: str
    dtype: str
    num_heads: int
    layers: tuple[AttentionLayer, ...]
    config_digest: str = ""
    source: str = ""
    vocab_size: int = 0
    #: weights estimated from the config (0: unknown); what loading them takes is checked
    parameters: int = 0
    #: the model's position limit, its config's max_position_embeddings (None: it has none);
    #: recorded in the artifact, it sizes the memory plan when no --max-model-len is given
    max_position_embeddings: int | None = None

    def identity(self) -> dict:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "source": self.source,
            "config_digest": self.config_digest,
            "num_layers": len(self.layers),
            "num_heads": self.num_heads,
            "vocab_size": self.vocab_size,
            **({} if self.max_position_embeddings is None
               else {"max_position_embeddings": self.max_position_embeddings}),
        }  # fmt: skip
