"""What a build reads from MODEL: its description, tokenizer and generation config, the model it
exports (with stand-ins where it stores weights itself, :mod:`tqexport.weights`) and the float
model that calibration runs, loaded only when a build calibrates.

A GGUF built with its own blocks is never dequantized whole: the export model is built with
empty weights and filled from the file, matrix by matrix, as the graph takes them.
"""

from __future__ import annotations

from functools import cached_property

from tqexport.errors import TQExportError
from tqexport.models.config import describe_config, load_config
from tqexport.models.description import ModelDescription
from tqexport.models.loader import LoadedModel, load_model, load_tokenizer, source_path
from tqexport.spec import BuildRequest
from tqexport.weights.export import ExportWeights, from_gguf, from_model
from tqexport.weights.gguf_source import check_types
from tqexport.weights.precision import FLOAT_PRECISION, gguf_type_refusal, stores_blocks


class BuildSource:
    """MODEL for one build request (``lm`` and ``export`` load on first use)."""

    def __init__(self, name: str, request: BuildRequest):
        from tqexport.kvquant.codecs import MODEL_DTYPES
        from tqexport.models import builtins

        self.name, self.request = name, request
        self.config, source = load_config(name)
        shown = name if name in builtins.BUILTIN_NAMES else source_path(name).name
        self.description: ModelDescription = describe_config(
            self.config, shown, source, request.dtype
        )
        self.torch_dtype = MODEL_DTYPES[self.description.dtype]
        self.gguf = name not in builtins.TINY_CONFIGS and source_path(name).suffix == ".gguf"
        self.blocks = stores_blocks(request.weights, self.gguf)
        if self.blocks and self.description.dtype != "float32":
            if request.weights in ("int8", "int4"):
                raise TQExportError(
                    f"--weights {request.weights} stores matrices for float32 compute; drop "
                    f"--dtype {self.description.dtype}"
                )
            self.blocks = False  # auto with a 16-bit compute dtype: the GGUF is dequantized

    def check(self) -> None:
        """Refuse, before any weight loads, a GGUF matrix type ``--weights`` cannot store."""
        if self.blocks and self.gguf:
            weights = self.request.weights
            check_types(source_path(self.name), lambda t: gguf_type_refusal(t, weights))

    @cached_property
    def lm(self) -> LoadedModel:
        """The model in float (calibration and the float-weight export run it)."""
        return load_model(self.name, self.request.dtype)

    def release(self) -> None:
        """Drop the float model when the export does not need it (after calibration)."""
        if self.blocks and self.gguf:
            self.__dict__.pop("lm", None)

    @cached_property
    def tokens(self) -> tuple:
        """(tokenizer, generation config) without loading the weights where possible."""
        if "lm" in self.__dict__:
            return self.lm.tokenizer, self.lm.generation_config
        if self.gguf:
            return load_tokenizer(self.name, self.config)
        return self.lm.tokenizer, self.lm.generation_config

    @cached_property
    def export(self) -> ExportWeights | None:
        """The export model with its stored weights, or None when the graph keeps the float
        model's own weights (``--weights fp32``, ``auto`` on a float checkpoint)."""
        weights = self.request.weights
        if self.blocks and self.gguf:
            return from_gguf(source_path(self.name), self.config, self.torch_dtype, weights)
        if weights in ("fp16", "int8", "int4"):
            lm = self.lm
            self.__dict__.pop("lm", None)  # its modules become the export model's
            self.__dict__["tokens"] = (lm.tokenizer, lm.generation_config)
            return from_model(lm.model, weights, self.torch_dtype)
        return None

    @property
    def export_model(self):
        return self.export.model if self.export is not None else self.lm.model

    def weight_bytes(self) -> int:
        """What the artifact's weights take (the free-space check): the plan's exact bytes."""
        return sum(self.planned_weight_bytes().values())

    def planned_weight_bytes(self) -> dict[str, int]:
        """What the artifact's weights would take by precision (``plan``), from the GGUF's
        tensor index or the model's shapes alone: no weight is loaded."""
        from tqexport.weights.estimate import gguf_bytes, model_bytes

        self.check()
        dtype = self.description.dtype
        if self.gguf:
            return gguf_bytes(source_path(self.name), self.request.weights, self.blocks, dtype)
        return model_bytes(self.config, self.request.weights, dtype)

    def reference_model(self) -> LoadedModel:
        """The float model holding the weights this request stores, dequantized: what the
        artifact's torch reference computes with (``bench quality`` on a MODEL)."""
        if self.export is None:
            return self.lm
        import torch

        from tqexport.weights.blocks import BlockWeight

        lm = load_model(self.name, self.request.dtype)
        params = dict(lm.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, load in self.export.stored.items():
                value = load()
                dense = value.dequantize() if isinstance(value, BlockWeight) else value
                params[name].copy_(torch.from_numpy(dense.astype("float32", copy=False)))
        return lm

    @property
    def weights_label(self) -> str:
        """What the matrices are, in a word or two: ``int4 (GGUF blocks)``, ``int8 (RTN)``..."""
        weights = self.request.weights
        if self.blocks and self.gguf:
            return "GGUF blocks" if weights == "auto" else f"{weights} (GGUF blocks)"
        if weights in ("int8", "int4"):
            return f"{weights} (RTN)"
        return "fp16" if weights == "fp16" else FLOAT_PRECISION[self.description.dtype]

    def as_loaded(self) -> LoadedModel:
        """A LoadedModel view for calibration: the float model, loaded when first run."""
        return _Lazy(self)


class _Lazy(LoadedModel):
    def __init__(self, source: BuildSource):  # no dataclass init: the model loads on demand
        self._source = source
        self.description = source.description
        self.tokenizer, self.generation_config = source.tokens

    @property
    def model(self):
        return self._source.lm.model
