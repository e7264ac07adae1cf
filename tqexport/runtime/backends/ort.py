"""Run artifact steps on ONNX Runtime (CPU EP; CUDA EP when onnxruntime-gpu and a GPU exist).

Caches are ORT values on the session's device, allocated once from the spec: on the CPU they
wrap numpy buffers (``caches``, the same memory), with the CUDA provider they live in device
memory and never cross the bus (``cache_array`` copies one to the host on request). With
``in_place`` (the default) every cache output is bound onto its input's value, so ORT's
ScatterND updates the cache where it lies instead of copying it each step; the binding is made
once and only the step inputs are rebound per step. ``in_place=False`` feeds and fetches host
copies every step (the reference the in-place path is tested against).
"""

from __future__ import annotations

import math
import re

import numpy as np
import onnx
import onnxruntime as ort
import torch

from tqexport.contract.artifact import Artifact
from tqexport.contract.caches import allocate_caches, cache_output_name
from tqexport.errors import TQExportError
from tqexport.native.kernel_choice import KernelChoice
from tqexport.native.kernel_choice import choose as choose_kernels
from tqexport.ops.attributes import DOMAIN

#: Session settings, chosen by measurement (README "Benchmarks", ``benchmarks/ort_options.py``):
#: every graph optimization (the common-subexpression pass that computes the layers' shared
#: step indices once, constant folding, MatMul + Transpose fusions; basic/extended measured
#: no better); no
#: memory-pattern planning (shapes change every step as the context grows, so a plan is never
#: reused: 1.2-1.3x slower with it); the CPU arena kept (1.1-1.5x slower without); intra-op
#: threads that sleep instead of spinning between kernels (spinning threads take the cores
#: from the ones working, from other sessions and other processes: up to 1.9x slower at
#: batch 8 on 2 shared cores). Threads: ORT's default (one per physical core).
#: the session config entry naming the folder an in-memory model's external initializers are
#: read from (a graph edited in memory keeps reading the artifact's weights in place)
EXTERNAL_FOLDER_ENTRY = "session.model_external_initializers_file_folder_path"

DEFAULT_OPTIONS = {
    "graph_optimization_level": "all",
    "enable_mem_pattern": False,
    "enable_cpu_mem_arena": True,
    "allow_spinning": False,
}

_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


#: node domains ONNX Runtime implements (ONNX's own, ONNX-ML, its contrib ops); any other
#: node must call one of the model's local functions (tqexport's ops do)
ORT_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")


def check_ops(model_file) -> None:
    """Refuse a graph with a node ONNX Runtime cannot resolve (an unknown domain, no local
    function of that name): one line naming the node and its domain instead of ORT's error."""
    model = onnx.load(str(model_file), load_external_data=False)
    functions = {(f.domain, f.name, f.overload) for f in model.functions}
    graphs, nodes = [model.graph], [n for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            nodes.extend(graphs.pop().node)
            continue
        node = nodes.pop()
        if node.domain not in ORT_DOMAINS and (
            (node.domain, node.op_type, node.overload) not in functions
        ):
            raise TQExportError(
                f"{model_file}: node {node.name[:80]!r} ({node.op_type[:80]}) is in domain "
                f"{node.domain[:80]!r}, which neither ONNX Runtime nor the model's functions "
                "define; rebuild the artifact"
            )
        for a in node.attribute:
            graphs.extend([a.g] * a.HasField("g") + list(a.graphs))


#: ORT's log severity for our sessions (4: fatal only): its default logger prints a coloured
#: line to stderr for every node that fails; the exception carries the same text, which the
#: failure we raise includes (:func:`ort_failure`)
QUIET_SEVERITY = 4
ort.set_default_logger_severity(QUIET_SEVERITY)  # the environment's logger, before any session


def ort_failure(e: Exception) -> str:
    """ONNX Runtime's message of ``e`` without its status prefixes ("[ONNXRuntimeError] : 6 :
    RUNTIME_EXCEPTION :", "Error in execution:"), on one line."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    return text.removeprefix("Error in execution: ")


#: how ONNX Runtime words a kernel's refusal at session start (the native kernels check their
#: attributes there) and how the kernels name the node: "tqexport OP (layer N): why"
_INIT_REFUSAL = "Exception during initialization:"
_KERNEL_NODE = re.compile(r"tqexport (\w+) \(layer (\d+)\): ")


def open_session(model, opts, session_providers, model_file) -> ort.InferenceSession:
    """An ORT session over ``model`` (a path, or the graph's bytes read from ``model_file``).
    ORT refusing the graph, or a kernel refusing a node's attributes at start-up (a graph
    changed after its build), becomes one line naming the layer and attribute."""
    opts.log_severity_level = QUIET_SEVERITY  # ORT's own line of the refusal: ours says it
    try:
        return ort.InferenceSession(model, opts, providers=session_providers)
    except Exception as e:  # onnxruntime's own types (Fail, InvalidGraph, RuntimeException)
        if not type(e).__module__.startswith("onnxruntime"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        if _INIT_REFUSAL in first:
            why = first.split(_INIT_REFUSAL, 1)[1].strip()
            raise TQExportError(
                f"ONNX Runtime refused {model_file} at start-up: {_refusal(why, model_file)}; "
                "the graph was changed after its build, rebuild the artifact"
            ) from None
        if " failed:" not in first:
            raise  # not the graph: a provider or the machine
        raise TQExportError(
            f"ONNX Runtime cannot load {model_file}: "
            f"{first.split(' failed:', 1)[1].strip()}; rebuild the artifact"
        ) from None


def _refusal(why: str, model_file) -> str:
    """A kernel's refusal, its node named by layer and op and the attributes out of range (a
    negative integer, a float not finite) shown with their values."""
    m = _KERNEL_NODE.search(why)
    if m is None:
        return why
    op, layer = m[1], int(m[2])
    model = onnx.load(str(model_file), load_external_data=False)
    values = []
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.domain != DOMAIN or node.op_type != op or attrs.get("layer") != layer:
            continue
        values += [
            f"{name}={v:g}" if isinstance(v, float) else f"{name}={v}"
            for name, v in attrs.items()
            if (isinstance(v, int) and v < 0) or (isinstance(v, float) and not math.isfinite(v))
        ]
    shown = f" (it has {', '.join(sorted(set(values)))})" if values else ""
    return f"layer {layer}'s {op} node: {why[m.end() :]}{shown}"


def providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def session_options(threads: int | None = None, /, **overrides) -> ort.SessionOptions:
    """SessionOptions from :data:`DEFAULT_OPTIONS` updated with ``overrides``: the keys there
    (``allow_spinning``: intra-op threads spin while waiting for work), ``threads``
    (overrides ``threads``), ``profile`` (a file prefix: ORT's per-node profile is written
    there at the end of the session)."""
    cfg = {**DEFAULT_OPTIONS, **overrides}
    unknown = set(cfg) - {*DEFAULT_OPTIONS, "threads", "profile"}
    if unknown:
        raise TQExportError(f"unknown ORT session option(s): {', '.join(sorted(unknown))}")
    opts = ort.SessionOptions()
    opts.log_severity_level = QUIET_SEVERITY
    threads = cfg.get("threads", threads)
    if threads:
        opts.intra_op_num_threads = threads
    opts.graph_optimization_level = _LEVELS[cfg["graph_optimization_level"]]
    opts.enable_mem_pattern = bool(cfg["enable_mem_pattern"])
    opts.enable_cpu_mem_arena = bool(cfg["enable_cpu_mem_arena"])
    opts.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if cfg["allow_spinning"] else "0"
    )
    if cfg.get("profile"):
        opts.enable_profiling = True
        opts.profile_file_prefix = str(cfg["profile"])
    return opts


#: the session entry holding the accuracy level ORT gives the MatMulNBits it fuses from a
#: blocked DequantizeLinear feeding a MatMul (how an artifact stores quantized weights)
WEIGHTS_ACCURACY_ENTRY = "session.qdq_matmulnbits_accuracy_level"


def apply_weights(opts: ort.SessionOptions, spec, accuracy_level: int | None = None) -> None:
    """Run the artifact's block-quantized matrices at its spec's accuracy level (or
    ``accuracy_level``: parity checks at 0, float32 inputs)."""
    if spec.weights is not None:
        level = spec.weights.accuracy_level if accuracy_level is None else accuracy_level
        opts.add_session_config_entry(WEIGHTS_ACCURACY_ENTRY, str(level))


def session_summary(opts: ort.SessionOptions) -> dict:
    """What a session runs with, as ORT holds it (``session.get_session_options()``), to set
    beside another system's: threads (0: ORT's default, one per physical core), whether idle
    intra-op threads spin (ORT's default unless a config entry says "0"), graph optimization
    and memory planning."""
    try:
        spin = opts.get_session_config_entry("session.intra_op.allow_spinning")
    except RuntimeError:  # never set: ORT spins
        spin = "1"
    return {
        "intra_op_num_threads": opts.intra_op_num_threads,
        "inter_op_num_threads": opts.inter_op_num_threads,
        "execution_mode": opts.execution_mode.name,
        "graph_optimization_level": opts.graph_optimization_level.name,
        "enable_mem_pattern": bool(opts.enable_mem_pattern),
        "enable_cpu_mem_arena": bool(opts.enable_cpu_mem_arena),
        "allow_spinning": spin != "0",
    }


class OrtBackend:
    name = "ort"

    def __init__(
        self,
        artifact: Artifact,
        num_blocks: int | list[int],
        threads: int | None = None,
        in_place=True,
        device: str | None = None,
        options: dict | None = None,
        kernels: str = "auto",
    ):
        """``device``: where caches live, ``"cpu"`` or ``"cuda"`` (default: cuda when the CUDA
        provider is available, else cpu). ``options``: overrides of :data:`DEFAULT_OPTIONS`
        (see :func:`session_options`). ``kernels``: what runs the tqexport nodes on the CPU
        (:data:`tqexport.native.kernel_choice.KERNEL_CHOICES`; ``kernel_choice`` says what did)."""
        available = providers()
        if device is None:
            device = "cuda" if "CUDAExecutionProvider" in available else "cpu"
        if device not in ("cpu", "cuda"):
            raise TQExportError(f"unknown ORT device {device!r}; use cpu or cuda")
        if device == "cuda" and "CUDAExecutionProvider" not in available:
            raise TQExportError("device cuda needs onnxruntime-gpu with a CUDA device")
        session_providers = available if device == "cuda" else ["CPUExecutionProvider"]
        if artifact.spec.dtype == "bfloat16" and device == "cpu":
            raise TQExportError(
                "this artifact is bfloat16, a GPU target: ONNX Runtime's CPU provider has no "
                "bf16 MatMul; rebuild with --dtype float32 or float16 for CPU"
            )
        self.spec = artifact.spec
        self.in_place = in_place
        self.device = device
        check_ops(artifact.model_file)
        opts = session_options(threads, **(options or {}))
        apply_weights(opts, artifact.spec)
        if device == "cpu":
            self.kernel_choice = choose_kernels(artifact.spec, kernels)
        elif kernels == "native":
            raise TQExportError("--kernels native runs on the CPU only; use --kernels bodies")
        else:
            self.kernel_choice = KernelChoice("bodies", None, "function bodies (CUDA provider)")
        if self.kernel_choice.library is not None:
            opts.register_custom_ops_library(str(self.kernel_choice.library))
        self.session = open_session(str(artifact.model_file), opts, session_providers,
                                    artifact.model_file)  # fmt: skip
        self.input_names = [i.name for i in self.session.get_inputs()]
        host = {n: t.numpy() for n, t in allocate_caches(self.spec, num_blocks).items()}
        #: cache input name -> its buffer as an OrtValue on ``device`` (CPU: wraps ``caches``)
        self.cache_values: dict[str, ort.OrtValue] = {}
        if in_place:
            for n, arr in host.items():
                self.cache_values[n] = ort.OrtValue.ortvalue_from_numpy(arr, device, 0)
        self._host = host if device == "cpu" or not in_place else None
        self._binding = None

    @property
    def caches(self) -> dict[str, np.ndarray]:
        """Cache input name -> host array: on the CPU the live buffers themselves; for
        device-resident caches, host copies made now (use :meth:`cache_array` for one)."""
        if self._host is not None:
            return self._host
        return {n: v.numpy() for n, v in self.cache_values.items()}

    def cache_array(self, name: str) -> np.ndarray:
        return self._host[name] if self._host is not None else self.cache_values[name].numpy()

    def _bound(self) -> ort.IOBinding:
        """The session's binding with every cache input and output bound onto its value."""
        if self._binding is None:
            binding = self.session.io_binding()
            binding.bind_output("logits")  # first: outputs come back in binding order
            self._output_names = ["logits"]
            for name, value in self.cache_values.items():
                out_name = cache_output_name(name)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(out_name, value)
                self._output_names.append(out_name)
            self._binding = binding
        return self._binding

    def run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step; caches are updated; returns logits ``[L, vocab]``. A node that fails
        raises TQExportError with ONNX Runtime's message (its logger prints nothing)."""
        try:
            return self._run(step)
        except TQExportError:
            raise
        except Exception as e:
            if not type(e).__module__.startswith("onnxruntime") and "status code" not in str(e):
                raise
            raise TQExportError(f"ONNX Runtime failed in a step: {ort_failure(e)}") from None

    def _run(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.in_place:
            feed = {n: step[n].numpy() if n in step else self._host[n] for n in self.input_names}
            names = [o.name for o in self.session.get_outputs()]
            out = dict(zip(names, self.session.run(names, feed), strict=True))
            for n in self._host:
                self._host[n] = out[cache_output_name(n)]
            return torch.from_numpy(out["logits"])
        binding = self._bound()
        keep = []
        for name in self.input_names:
            if name not in self.cache_values:
                arr = np.ascontiguousarray(step[name].numpy())
                keep.append(arr)
                binding.bind_cpu_input(name, arr)
        # rebinding keeps logits' place; host memory, allocated by ORT for this step's shape
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(self._output_names, binding.get_outputs(), strict=True))
        #: output buffer address per cache output, to check the update happened in place
        self.last_output_ptrs = {n: v.data_ptr() for n, v in outputs.items() if n != "logits"}
        return torch.from_numpy(outputs["logits"].numpy())
