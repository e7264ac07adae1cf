"""Ahead-of-time compilation of a launch plan to PTX, and the argument-order contract check.

Triton compiles for ``sm_90`` without a GPU. The PTX ``.entry`` must list exactly the plan's
arguments (node inputs, int32 scalars, outputs) followed by the parameters Triton appends to
every kernel (triton 3.9: a global-scratch and a profile-scratch pointer). TensorRT's AOT launch
passes only the plan's arguments; how it fills the trailing ones is unverified, so the check
also requires that no scratch is allocated and that the PTX never reads those parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trt_plugins.contract import LaunchPlan

#: Parameters Triton appends after the declared ones (triton/backends/nvidia/driver.c).
HIDDEN_PARAMS = ("global_scratch", "profile_scratch")
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.global\s+\.align\s+\d+)?\s+(\w+)")
#: Triton signature type -> PTX parameter type.
_PTX_TYPE = {"i32": "u32", "i64": "u64", "fp32": "f32"}


class ContractError(AssertionError):
    """The compiled kernel's parameters do not match what the TensorRT launch passes."""


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int
    global_scratch_size: int
    profile_scratch_size: int

    @property
    def block_x(self) -> int:
        """Threads per program: TensorRT's ``block_x``."""
        return self.num_warps * 32


def compile_plan(plan: LaunchPlan, arch: int = 90) -> CompiledKernel:
    """PTX of the plan's kernel for ``sm_<arch>`` (cached per kernel, signature, constexprs)."""
    key = (plan.kernel.__name__, tuple(plan.signature.items()), _freeze(plan.constexprs),
           tuple(sorted(plan.options.items())), arch)  # fmt: skip
    return _compile(key, plan, arch)


def _freeze(consts: dict) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in consts.items())


_CACHE: dict = {}


def _compile(key, plan: LaunchPlan, arch: int) -> CompiledKernel:
    if key in _CACHE:
        return _CACHE[key]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=plan.kernel, signature=plan.signature, constexprs=plan.constexprs)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=plan.options)
    m = c.metadata
    _CACHE[key] = CompiledKernel(m.name, c.asm["ptx"], m.num_warps, m.shared,
                                 m.global_scratch_size, m.profile_scratch_size)  # fmt: skip
    return _CACHE[key]


def entry_params(ptx: str) -> tuple[str, list[tuple[str, str]]]:
    """(kernel name, [(ptx type, param name)]) of the PTX's ``.entry``."""
    m = _ENTRY.search(ptx)
    if m is None:
        raise ContractError("no .entry in the PTX")
    return m[1], [(t, n) for t, n in _PARAM.findall(m[2])]


def params_read(ptx: str) -> set[str]:
    """Parameter names the kernel body loads."""
    return set(re.findall(r"ld\.param\.\w+\s+%\w+,\s*\[(\w+)(?:\+\d+)?\]", ptx))


def check_contract(plan: LaunchPlan, kernel: CompiledKernel) -> None:
    """Raise :class:`ContractError` unless the PTX takes exactly what TensorRT passes."""
    name, params = entry_params(kernel.ptx)
    if name != kernel.name:
        raise ContractError(f".entry {name} is not the kernel {kernel.name}")
    args = plan.arg_names
    layout = [*plan.inputs, *plan.scalars, *plan.outputs]
    if len(args) != len(layout):
        raise ContractError(f"{name}: {len(args)} kernel args for {len(layout)} TensorRT args")
    if len(params) != len(args) + len(HIDDEN_PARAMS):
        raise ContractError(
            f"{name}: {len(params)} PTX params, expected {len(args)} + {len(HIDDEN_PARAMS)} hidden"
        )
    for i, arg in enumerate(args):
        t = plan.signature[arg]
        want = "u64" if t.startswith("*") else _PTX_TYPE[t]
        scalar = not t.startswith("*")
        if params[i][0] != want or scalar != (layout[i] in plan.scalars):
            raise ContractError(f"{name}: param {i} ({arg} -> {layout[i]}) is .{params[i][0]}")
    hidden = [n for _, n in params[len(args) :]]
    if any(t != "u64" for t, _ in params[len(args) :]):
        raise ContractError(f"{name}: hidden params {hidden} are not all pointers")
    if kernel.global_scratch_size or kernel.profile_scratch_size:
        raise ContractError(f"{name}: needs scratch memory, which the TensorRT launch lacks")
    if read := params_read(kernel.ptx) & set(hidden):
        raise ContractError(f"{name}: the kernel reads hidden params {sorted(read)}")
