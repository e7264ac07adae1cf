"""Run artifact steps on ONNX Runtime (CPU EP; CUDA EP when onnxruntime-gpu and a GPU exist)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from tqexport.errors import TQExportError
from tqexport.runtime.artifact import Artifact


def providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OrtRunner:
    """One ORT session over the artifact's graph; caches are passed and returned per step."""

    def __init__(self, artifact: Artifact, threads: int | None = None):
        if artifact.spec.dtype == "bfloat16" and providers() == ["CPUExecutionProvider"]:
            raise TQExportError(
                "this artifact is bfloat16, a GPU target: ONNX Runtime's CPU provider has no "
                "bf16 MatMul; rebuild with --dtype float32 or float16 for CPU"
            )
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.spec = artifact.spec
        self.session = ort.InferenceSession(str(artifact.model_file), opts, providers=providers())
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, step: dict[str, torch.Tensor], caches: dict[str, torch.Tensor]):
        """Returns (logits, new caches keyed by input name)."""
        feed = {n: _np(step[n] if n in step else caches[n]) for n in self.input_names}
        out = self.session.run(self.output_names, feed)
        new = {
            o.replace("cache_out.", "cache.", 1): torch.from_numpy(np.asarray(v))
            for o, v in zip(self.output_names[1:], out[1:], strict=True)
        }
        return torch.from_numpy(out[0]), new


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()
