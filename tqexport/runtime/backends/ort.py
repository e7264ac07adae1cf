"""Run artifact steps on ONNX Runtime (CPU EP; CUDA EP when onnxruntime-gpu and a GPU exist).

Caches live in numpy buffers allocated from the spec. With ``in_place`` (the default) every
cache output is bound onto its input's buffer, so ORT's ScatterND updates the cache where it
lies instead of copying it each step.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from tqexport.errors import TQExportError
from tqexport.runtime.artifact import Artifact
from tqexport.runtime.caches import allocate_caches


def providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OrtBackend:
    name = "ort"

    def __init__(
        self,
        artifact: Artifact,
        num_blocks: int | list[int],
        threads: int | None = None,
        in_place=True,
    ):
        if artifact.spec.dtype == "bfloat16" and providers() == ["CPUExecutionProvider"]:
            raise TQExportError(
                "this artifact is bfloat16, a GPU target: ONNX Runtime's CPU provider has no "
                "bf16 MatMul; rebuild with --dtype float32 or float16 for CPU"
            )
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.spec = artifact.spec
        self.in_place = in_place
        # IO binding below uses CPU buffers; the CUDA EP copies them (no device-side cache yet).
        self.session = ort.InferenceSession(str(artifact.model_file), opts, providers=providers())
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.caches = {n: t.numpy() for n, t in allocate_caches(self.spec, num_blocks).items()}

    def run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step; caches are updated; returns logits ``[L, vocab]``."""
        if not self.in_place:
            feed = {n: step[n].numpy() if n in step else self.caches[n] for n in self.input_names}
            names = [o.name for o in self.session.get_outputs()]
            out = dict(zip(names, self.session.run(names, feed), strict=True))
            for n in self.caches:
                self.caches[n] = out[n.replace("cache.", "cache_out.", 1)]
            return torch.from_numpy(out["logits"])
        binding = self.session.io_binding()
        binding.bind_output("logits")  # first: outputs come back in binding order
        keep, bound = [], []
        for name in self.input_names:
            if name in self.caches:
                buf = self.caches[name]
                for bind, n in (
                    (binding.bind_input, name),
                    (binding.bind_output, name.replace("cache.", "cache_out.", 1)),
                ):
                    bind(n, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
                bound.append(name.replace("cache.", "cache_out.", 1))
            else:
                arr = np.ascontiguousarray(step[name].numpy())
                keep.append(arr)
                binding.bind_cpu_input(name, arr)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        #: output buffer address per cache output, to check the update happened in place
        self.last_output_ptrs = {n: v.data_ptr() for n, v in zip(bound, outputs[1:], strict=True)}
        return torch.from_numpy(outputs[0].numpy())
