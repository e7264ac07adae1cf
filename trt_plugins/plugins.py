"""Register the tqexport plugins with TensorRT's Python plugin API (needs ``tensorrt``).

Thin glue only, never run against TensorRT on the development machines (none there; the tests
drive it through a recording stand-in for ``tensorrt.plugin`` to check its argument binding):
every decision (plugin per op and cache arity, attributes, kernel, grid, int32 scalars, aliasing) is
made by :mod:`trt_plugins.contract` and :mod:`trt_plugins.ptx`, which are tested on CPU. Each
plugin has ``register`` (symbolic output shapes; caches aliased to their inputs), ``aot_impl``
(the Triton kernel's PTX: the engine runs without Python) and a JIT ``impl`` calling the torch
op, for debugging with ``NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS``.
"""

from __future__ import annotations

import inspect

import tensorrt.plugin as trtp

from trt_plugins import contract
from trt_plugins.ptx import compile_plan


def _attrs(plugin: str, sig: inspect.Signature, args, kwargs) -> tuple[list, dict, tuple]:
    """Split a call into (tensors, attributes, trailing args) by the declared signature."""
    names = contract.inputs_of(plugin)
    bound = sig.bind(*args, **kwargs).arguments
    tensors = [bound[n] for n in names]
    attrs = {n: bound[n] for n in contract.attrs_of(plugin)}
    rest = tuple(v for n, v in bound.items() if n not in attrs and n not in names)
    return tensors, attrs, rest


def _gpu_arch() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _define(plugin: str) -> None:
    op_id = f"{contract.NAMESPACE}::{plugin}"
    reg_sig = contract.register_signature(plugin, trtp.TensorDesc)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = list(reg_sig.parameters.values())
    n_out = len(contract.outputs_of(plugin))

    def describe(*args, **kwargs):
        tensors, attrs, _ = _attrs(plugin, reg_sig, args, kwargs)
        plan = contract.launch_plan(plugin, attrs)  # refuses unsupported layers at build time
        if plan.aliases:
            outs = tuple(tensors[plan.aliases[i]].aliased() for i in range(n_out))
        else:
            outs = (tensors[0].like(),)
        return outs[0] if n_out == 1 else outs

    describe.__signature__ = reg_sig
    trtp.register(op_id)(describe)

    aot_sig = inspect.Signature(
        params + [inspect.Parameter("outputs", kind), inspect.Parameter("tactic", kind)],
        return_annotation=tuple[str | bytes, str | bytes, trtp.KernelLaunchParams,
                                trtp.SymIntExprs],
    )  # fmt: skip

    def aot_impl(*args, **kwargs):
        tensors, attrs, _ = _attrs(plugin, aot_sig, args, kwargs)
        plan = contract.launch_plan(plugin, attrs)
        kernel = compile_plan(plan, _gpu_arch())
        shapes = [t.shape_expr for t in tensors]
        grid = plan.grid(shapes)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = grid
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared
        scalars = [trtp.SymInt32(e) for e in plan.scalar_values(shapes)]
        extra = trtp.SymIntExprs.from_tuple(scalars) if scalars else trtp.SymIntExprs(0)
        return kernel.name, kernel.ptx, launch, extra

    aot_impl.__signature__ = aot_sig
    trtp.aot_impl(op_id)(aot_impl)

    jit_params = [p.replace(annotation=inspect.Parameter.empty) for p in params]
    jit_sig = inspect.Signature(
        jit_params + [inspect.Parameter("outputs", kind), inspect.Parameter("stream", kind)]
    )

    def impl(*args, **kwargs):
        import torch

        tensors, attrs, (outputs, stream) = _attrs(plugin, jit_sig, args, kwargs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            ins = [torch.as_tensor(t, device="cuda") for t in tensors]
            outs = [torch.as_tensor(t, device="cuda") for t in outputs]
            _run_torch_op(plugin, attrs, ins, outs)

    impl.__signature__ = jit_sig
    trtp.impl(op_id)(impl)


def _run_torch_op(plugin: str, attrs: dict, ins: list, outs: list) -> None:
    """The JIT path: the tqexport torch ops on TensorRT's buffers (caches written in place)."""
    import torch

    scales = (attrs["kv_cache_dtype"], attrs["model_dtype"], attrs["k_scale"], attrs["v_scale"])
    op, n, recent = contract.PLUGINS[plugin]
    if op == contract.CACHE_WRITE:
        caches = outs  # aliased: the same memory as the cache inputs
        if any(o.data_ptr() != i.data_ptr() for o, i in zip(outs, ins, strict=False)):
            for o, i in zip(outs, ins[:n], strict=True):
                o.copy_(i)
        k, v, slots = ins[n:]
        torch.ops.tqexport.cache_write(caches, k, v, slots, *scales)
        return
    q, caches, steps, extra = ins[0], ins[1 : 1 + n], ins[1 + n : 5 + n], ins[5 + n :]
    window = (
        (extra[:2], extra[2], attrs["recent_window"], attrs.get("sink_tokens", 0))
        if recent
        else ([], None, 0, 0)
    )
    out = torch.ops.tqexport.paged_attention(
        q, caches, *steps, *scales, attrs["scale"], attrs["softcap"], attrs["window"], *window
    )
    outs[0].copy_(out)


for _plugin in contract.PLUGINS:
    _define(_plugin)
