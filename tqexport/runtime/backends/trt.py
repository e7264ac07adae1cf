"""Run artifact steps on the TensorRT engine built by ``tqexport engine`` (needs a GPU).

Caches live on the GPU, allocated from the spec; each cache output is bound to its input's
buffer, so the CacheWrite plugins (outputs aliased to inputs) update the caches in place. The
engine's profile limits (``engine.json``) are checked against the executor's before serving.
"""

from __future__ import annotations

import json

import torch

from tqexport.contract.artifact import Artifact
from tqexport.contract.caches import allocate_caches, cache_output_name
from tqexport.contract.files import ENGINE_FILE, PROFILE_FILE, artifact_file, read_artifact_file
from tqexport.errors import TQExportError
from trt_plugins.toolchain import require_gpu, require_tensorrt

_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                 "INT32": torch.int32, "INT64": torch.int64, "UINT8": torch.uint8}  # fmt: skip


def torch_dtype_of(trt_dtype) -> torch.dtype:
    """torch dtype of a ``tensorrt.DataType`` (by name, e.g. ``DataType.HALF``)."""
    return _TORCH_DTYPES[str(trt_dtype).rsplit(".", 1)[-1]]


class TrtBackend:
    name = "trt"

    def __init__(self, artifact: Artifact, num_blocks: int | list[int]):
        """``num_blocks``: per cache group, or one count for all."""
        plan = artifact_file(artifact.path, ENGINE_FILE)
        raw_limits = read_artifact_file(artifact.path, PROFILE_FILE)
        for name, found in ((ENGINE_FILE, plan), (PROFILE_FILE, raw_limits)):
            if found is None:
                raise TQExportError(f"{artifact.path} has no {name}; run `tqexport engine` first")
        try:
            limits = json.loads(raw_limits)
            int(limits["max_blocks"])
        except (ValueError, TypeError, KeyError):
            raise TQExportError(
                f"{artifact.path / PROFILE_FILE} is not an engine's limits; run `tqexport engine` "
                "again"
            ) from None
        if max(num_blocks if isinstance(num_blocks, list) else [num_blocks]) > limits["max_blocks"]:
            raise TQExportError(
                f"{num_blocks} cache blocks exceed the engine's --max-blocks "
                f"{limits['max_blocks']}; lower --num-blocks or rebuild the engine"
            )
        trt = require_tensorrt()
        require_gpu()
        import trt_plugins.plugins  # noqa: F401  (plugin creators, should the engine need them)

        self.spec = artifact.spec
        self.limits = limits
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            read_artifact_file(artifact.path, ENGINE_FILE)
        )
        if self.engine is None:
            raise TQExportError(f"TensorRT could not load {plan} (built by another version?)")
        self.context = self.engine.create_execution_context()
        self.caches = {n: t.cuda() for n, t in allocate_caches(self.spec, num_blocks).items()}

    def run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step; caches are updated in place; returns logits ``[L, vocab]`` on the CPU."""
        ctx, keep = self.context, []
        for name in self.spec.input_names:
            if name in self.caches:
                buf = self.caches[name]
                ctx.set_input_shape(name, tuple(buf.shape))
                ctx.set_tensor_address(name, buf.data_ptr())
                ctx.set_tensor_address(cache_output_name(name), buf.data_ptr())
                continue
            t = step[name].cuda().contiguous()
            keep.append(t)
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise TQExportError(
                    f"step input {name} {tuple(t.shape)} is outside the engine's profile "
                    f"{self.limits}; rebuild with larger limits or lower the executor's"
                )
            ctx.set_tensor_address(name, t.data_ptr())
        shape = tuple(ctx.get_tensor_shape("logits"))
        logits = torch.empty(shape, dtype=torch_dtype_of(self.engine.get_tensor_dtype("logits")),
                             device="cuda")  # fmt: skip
        ctx.set_tensor_address("logits", logits.data_ptr())
        stream = torch.cuda.current_stream()
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return logits.cpu()
