"""Run artifact steps with the torch reference ops, mutating the caches in place.

The graph holds no torch weights, so this backend reloads the source model the artifact was
built from (``model.path`` in the spec) and refuses one whose config digest differs.
"""

from __future__ import annotations

import torch

from tqexport.contract.artifact import Artifact
from tqexport.contract.caches import allocate_caches
from tqexport.contract.steps import ordered_inputs
from tqexport.errors import TQExportError
from tqexport.models.loader import load_model
from tqexport.models.paged import PagedCausalLM


def load_source_model(artifact: Artifact):
    """The torch model an artifact was built from, refused if its config digest differs; the
    matrices the artifact stores quantized (or in fp16) hold the artifact's own weights,
    dequantized, so torch and ONNX Runtime compute with the same ones."""
    spec = artifact.spec
    lm = load_model(spec.model["path"], spec.dtype)
    if lm.description.config_digest != spec.model["config_digest"]:
        raise TQExportError(
            f"the source model at {spec.model['path']} is not the one this artifact was "
            "built from (config digest differs)"
        )
    if spec.weights is not None:
        import onnx

        from tqexport.weights.graph import read_stored

        params = dict(lm.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, w in read_stored(onnx.load(str(artifact.model_file))).items():
                params[name].copy_(torch.from_numpy(w))
    return lm


class TorchBackend:
    name = "torch"

    def __init__(self, artifact: Artifact, num_blocks: int | list[int], source_model=None):
        """``source_model``: an already loaded model (a LoadedModel) instead of reloading."""
        spec = artifact.spec
        lm = source_model or load_source_model(artifact)
        self.spec = spec
        self.module = PagedCausalLM(lm.model, spec, mode="inplace")
        self.caches = allocate_caches(spec, num_blocks)

    def run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self.module(*ordered_inputs(self.spec, step, self.caches))[0]
