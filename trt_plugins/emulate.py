"""Launch a plan's TensorRT-order kernel from torch exactly as the AOT plugin would.

Arguments are the node's input tensors, the int32 scalars and the output tensors, in that
order (bound by name: parameters a plan fixes as constexpr may sit between them), on the
plan's grid; an aliased output is passed as its input's own tensor. This runs the TensorRT
entry points in Triton's interpreter (CPU tests) or on a GPU without TensorRT.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trt_plugins.contract import LaunchPlan, output_shapes


def launch(plan: LaunchPlan, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run the plan on ``inputs`` (contiguous); returns the outputs (aliases are the inputs)."""
    inputs = [t.contiguous() for t in inputs]
    shapes = [tuple(t.shape) for t in inputs]
    outs = []
    for i, shape in enumerate(output_shapes(plan.plugin, shapes)):
        if i in plan.aliases:
            outs.append(inputs[plan.aliases[i]])
        else:
            outs.append(torch.empty(shape, dtype=inputs[0].dtype, device=inputs[0].device))
    args = dict(zip(plan.arg_names, [*inputs, *plan.scalar_values(shapes), *outs], strict=True))
    plan.kernel[plan.grid(shapes)](**args, **plan.constexprs, **plan.options)
    return outs
