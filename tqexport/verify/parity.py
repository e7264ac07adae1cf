"""``tqexport parity``: the artifact on ONNX Runtime against the torch reference, layer by layer.

One prefill (several sequences of different lengths) and N decode steps run on ORT with a
session that also exposes every tqexport node's inputs. For every layer and step the torch
reference ops are run on exactly the q/k/v ORT fed its nodes, and must reproduce ORT's cache
bytes and attention outputs (within 1e-4 for float32 models, two ulps for 16-bit ones). A byte
may differ only in a token-head whose encoding sits at a rounding threshold: one that a
perturbation of ``NEAR_THRESHOLD`` times its rms changes in at least one of ``PROBES`` seeded
draws (the last-bit differences of ORT's and torch's arithmetic are about 10x smaller). Judging
whole-model logits of a quantized model instead would be meaningless: ORT's and torch's matmuls
differ in the last bits, one code that flips at a rounding threshold changes that layer's output
by a quantization step, and the difference grows through the remaining layers (measured on
SmolLM2 with 4-bit keys: 1 flipped byte in layer 5, over a thousand by layer 17). End-to-end
logits are still compared, and judged when no layer is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch

from tqexport import validate
from tqexport.contract.artifact import Artifact
from tqexport.contract.caches import allocate_caches, cache_output_name
from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
from tqexport.errors import TQExportError
from tqexport.models.paged import PagedCausalLM
from tqexport.native import KERNEL_CHOICES
from tqexport.native.kernel_choice import choose as choose_kernels
from tqexport.ops import reference
from tqexport.ops.attributes import CACHE_WRITE, DOMAIN, PAGED_ATTENTION, attention_segments
from tqexport.runtime.backends.ort import (
    EXTERNAL_FOLDER_ENTRY,
    QUIET_SEVERITY,
    apply_weights,
    check_ops,
    open_session,
    providers,
)
from tqexport.runtime.backends.torch import load_source_model
from tqexport.runtime.engine import position_limit
from tqexport.spec import ModelSpec, block_tables_name, slot_mapping_name

#: parity's sizes: it runs every layer twice (ORT and the reference) on every step
MAX_PARITY_STEPS, MAX_PARITY_PROMPT_LEN, MAX_PARITY_BATCH = 1024, 8192, 64
TOL = 1e-4
#: the accuracy level parity runs block-quantized weights at: float32 inputs, so ORT computes
#: with exactly the dequantized weights the reference holds (serving runs the spec's level)
EXACT_WEIGHTS = 0
#: relative size (to each token-head's rms) and number of the perturbations that find
#: token-heads whose encoding sits at a rounding threshold
NEAR_THRESHOLD, PROBES = 1e-5, 16


@dataclass
class Check:
    what: str
    max_abs: float
    detail: str
    ok: bool


@dataclass
class ParityReport:
    logits: list[Check] = field(default_factory=list)
    layers: list[Check] = field(default_factory=list)
    logits_judged: bool = True
    #: how close the logits must be (max abs and relative, :func:`tolerance`)
    logits_tolerance: float = TOL
    #: what ran the tqexport nodes on ORT (native kernels or function bodies), in words
    kernels: str = ""

    @property
    def ok(self) -> bool:
        layers_ok = all(c.ok for c in self.layers)
        return layers_ok and (not self.logits_judged or all(c.ok for c in self.logits))


#: how much further block-quantized weights may take the logits: ORT sums a block's codes times
#: its scale, then adds a block offset (the min of Q4_1/Q4_K blocks) as a separate product of
#: the input's block sums, which cancels and rounds unlike the reference's dense product
#: (SmolLM2 Q4_1, 11 steps: at most 2.0e-4 against 1.4e-4 with the same weights in float32)
BLOCK_WEIGHTS_FACTOR = 4


def tolerance(model_dtype: str, block_weights: bool = False) -> float:
    """1e-4 for float32 models; two ulps of the model dtype for 16-bit ones; times
    :data:`BLOCK_WEIGHTS_FACTOR` for logits through block-quantized weights."""
    tol = max(TOL, 2 * torch.finfo(getattr(torch, model_dtype)).eps)
    return tol * (BLOCK_WEIGHTS_FACTOR if block_weights else 1)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[bool, float]:
    diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    return bool(torch.isclose(a.float(), b.float(), atol=tol, rtol=tol).all()), diff


class _TapSession:
    """ORT session over the artifact with every tqexport node's q/k/v and output exposed."""

    def __init__(self, artifact: Artifact, threads: int | None = None, kernels: str = "auto"):
        check_ops(artifact.model_file)
        self.kernels = choose_kernels(artifact.spec, kernels)
        # the graph alone: its weights stay in the artifact's data file, which ORT reads from
        # the artifact's folder (no copy of the weights on disk)
        model = onnx.load(str(artifact.model_file), load_external_data=False)
        self.taps: dict[tuple[int, str], str] = {}
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(artifact.spec.dtype))
        for node in model.graph.node:
            if node.domain != DOMAIN or node.op_type not in (CACHE_WRITE, PAGED_ATTENTION):
                continue  # AddBlockOffsets, RotateHalf: no layer's cache
            layer = next(a.i for a in node.attribute if a.name == "layer")
            if node.op_type == CACHE_WRITE:
                self.taps[(layer, "k")] = node.input[-3]
                self.taps[(layer, "v")] = node.input[-2]
            elif node.op_type == PAGED_ATTENTION:
                self.taps[(layer, "q")] = node.input[0]
                self.taps[(layer, "out")] = node.output[0]
        for name in self.taps.values():
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
        self.output_names = [o.name for o in model.graph.output]
        opts = ort.SessionOptions()
        opts.log_severity_level = QUIET_SEVERITY
        opts.add_session_config_entry(EXTERNAL_FOLDER_ENTRY, str(artifact.model_file.parent))
        apply_weights(opts, artifact.spec, EXACT_WEIGHTS)
        if threads:
            opts.intra_op_num_threads = threads
        if self.kernels.library is not None:
            opts.register_custom_ops_library(str(self.kernels.library))
        self.session = open_session(model.SerializeToString(), opts, providers(),
                                    artifact.model_file)  # fmt: skip
        self.input_names = [i.name for i in self.session.get_inputs()]

    def run(self, step, caches):
        feed = {n: (step[n] if n in step else caches[n]).numpy() for n in self.input_names}
        out = dict(zip(self.output_names, self.session.run(self.output_names, feed), strict=True))
        return {k: torch.from_numpy(np.asarray(v)) for k, v in out.items()}


def near_threshold(codec, cache_in, k, v, slots, ref_cache, seed=0) -> list[torch.Tensor]:
    """Per cache tensor, ``[blocks, block_size, kv_heads]``: the token-heads whose bytes change
    when k and v move by ``NEAR_THRESHOLD`` of their rms (seeded, ``PROBES`` draws)."""
    g = torch.Generator().manual_seed(seed)
    k, v = k.float(), v.float()
    rms = [x.pow(2).mean(-1, keepdim=True).sqrt() for x in (k, v)]
    unstable = [torch.zeros(r.shape[:3], dtype=torch.bool) for r in ref_cache]
    for _ in range(PROBES):
        pk, pv = (
            x + NEAR_THRESHOLD * s * torch.randn(x.shape, generator=g)
            for x, s in zip((k, v), rms, strict=True)
        )
        moved = reference.write_cache(codec, cache_in, pk, pv, slots)
        for u, a, b in zip(unstable, moved, ref_cache, strict=True):
            u |= (a != b).reshape(*u.shape, -1).any(-1)
    return unstable


def compare_write(codec, cache_in, k, v, slots, got, tol) -> tuple[bool, float, list[str]]:
    """Does ``got`` hold what the reference writes for k/v? Bytes may differ only in token-heads
    at a rounding threshold; float tensors (model-dtype caches, scales) agree within ``tol``."""
    ref_cache = reference.write_cache(codec, cache_in, k, v, slots)
    ok, worst, details, unstable = True, 0.0, [], None
    for i, (fmt, r, g) in enumerate(zip(codec.tensors, ref_cache, got, strict=True)):
        if r.dtype != torch.uint8:
            fine, diff = _close(r, g, max(tol, torch.finfo(r.dtype).eps))
            ok, worst = ok and fine, max(worst, diff)
            continue
        differ = (r != g).reshape(*r.shape[:3], -1).any(-1)
        n = int(differ.sum())
        if n and unstable is None:
            unstable = near_threshold(codec, cache_in, k, v, slots, ref_cache)
        at_threshold = int((differ & unstable[i]).sum()) if n else 0
        ok &= at_threshold == n
        details.append(
            f"{fmt.role}: {n} token-heads differ"
            + (f", {at_threshold} at a threshold" if n else "")
        )
    return ok, worst, details


def _check_layers(spec: ModelSpec, step, caches, out, taps, step_no):
    checks = []
    tol = tolerance(spec.dtype)
    for layer in spec.layers:
        k, v = out[taps[(layer.index, "k")]], out[taps[(layer.index, "v")]]
        ok, worst, details = True, 0.0, []
        written, tables = [], []
        for b in layer.bindings:
            roles = [role for role, _ in b.tensors]
            cache_in = [caches[layer.onnx_input(r)] for r in roles]
            cache_out = [out[layer.onnx_output(r)] for r in roles]
            written.append(cache_out)
            tables.append(step[block_tables_name(b.group)])
            slots = step[slot_mapping_name(b.group)]
            fine, diff, said = compare_write(b.cache.codec, cache_in, k, v, slots, cache_out, tol)
            ok &= fine
            worst = max(worst, diff)
            details += [f"{b.prefix}{x}" for x in said]
        q = out[taps[(layer.index, "q")]]
        ref_attn = reference.paged_attention(
            layer.cache.codec,
            q,
            written[0],
            tables[0],
            step["seq_lens"],
            step["query_start_loc"],
            step["positions"],
            scale=layer.scale,
            softcap=layer.softcap,
            window=layer.window,
            **attention_segments(layer, written, tables),
        )
        fine, diff = _close(ref_attn, out[taps[(layer.index, "out")]], tol)
        ok &= fine
        details.append(f"attention max abs {diff:.1e}")
        checks.append(
            Check(f"step {step_no} layer {layer.index} {layer.kv_cache_dtype}", max(worst, diff),
                  "; ".join(details), ok)
        )  # fmt: skip
    return checks


def check_options(steps: int, prompt_len: int, batch: int, seed: int, kernels: str) -> None:
    """``parity``'s sizes, seed and ``--kernels``, before the artifact is opened."""
    validate.integer(steps, "--steps", 0, MAX_PARITY_STEPS)
    validate.integer(prompt_len, "--prompt-len", 1, MAX_PARITY_PROMPT_LEN)
    validate.integer(batch, "--batch", 1, MAX_PARITY_BATCH)
    validate.seed(seed)
    validate.choice(kernels, "--kernels", KERNEL_CHOICES)


def check_position_limit(artifact: Artifact, steps: int, prompt_len: int) -> None:
    """The longest sequence parity runs must fit the model's position limit."""
    limit = position_limit(artifact)
    if limit is not None and prompt_len + steps > limit:
        raise TQExportError(
            f"--prompt-len {prompt_len} + --steps {steps} is more than the model's position "
            f"limit of {limit} tokens; lower them"
        )


def run_parity(
    artifact: Artifact,
    steps: int = 4,
    prompt_len: int = 24,
    batch: int = 3,
    seed: int = 0,
    threads: int | None = None,
    kernels: str = "auto",
) -> ParityReport:
    """Prefill + ``steps`` decode steps; see the module docstring for what is compared.
    ``threads``: ORT intra-op threads (None = ORT's default), which sets its summation order;
    ``kernels``: what runs the tqexport nodes on ORT (``--kernels``)."""
    if threads is not None:
        validate.threads(threads, "threads")
    spec = artifact.spec
    if prompt_len < 1 or batch < 1 or steps < 0:
        raise TQExportError("--prompt-len and --batch must be >= 1, --steps >= 0")
    if spec.dtype == "bfloat16":
        raise TQExportError("parity runs on ONNX Runtime's CPU provider, which has no bf16 MatMul")
    lm = load_source_model(artifact)
    tapped = _TapSession(artifact, threads, kernels)
    reference_model = PagedCausalLM(lm.model, spec, mode="functional")
    g = torch.Generator().manual_seed(seed)
    vocab = int(spec.model["vocab_size"])
    lengths = [max(1, prompt_len - 5 * i) for i in range(batch)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    per_seq = [-(-(n + steps) // spec.block_size) for n in lengths]
    starts = [1 + sum(per_seq[:i]) for i in range(batch)]
    tables = [
        [list(range(s, s + n))] * len(spec.groups) for s, n in zip(starts, per_seq, strict=True)
    ]
    cache_names = [n for n in spec.input_names if n.startswith("cache.")]
    ref_caches = allocate_caches(spec, 1 + sum(per_seq))
    ort_caches = {k: v.clone() for k, v in ref_caches.items()}
    quantized = any(la.mode.is_quantized for la in spec.layers)
    report = ParityReport(logits_judged=not quantized, kernels=tapped.kernels.reason)
    blocks = spec.weights is not None and any(t.block_size for t in spec.weights.tensors)
    logits_tol = report.logits_tolerance = tolerance(spec.dtype, blocks)
    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    positions = list(lengths)
    for i in range(steps + 1):
        step = build_step(spec, chunks)
        with torch.no_grad():
            ref_out = reference_model(*ordered_inputs(spec, step, ref_caches))
        ref_caches = dict(zip(cache_names, ref_out[1:], strict=True))
        out = tapped.run(step, ort_caches)
        report.layers += _check_layers(spec, step, ort_caches, out, tapped.taps, i)
        ort_caches = {n: out[cache_output_name(n)] for n in cache_names}
        ok, diff = _close(ref_out[0], out["logits"], logits_tol)
        same_top1 = float((ref_out[0].argmax(-1) == out["logits"].argmax(-1)).float().mean())
        report.logits.append(Check(f"step {i}", diff, f"top-1 agreement {same_top1:.0%}", ok))
        nxt = ref_out[0].argmax(-1).tolist()
        chunks = [SeqChunk([t], p, tb) for t, p, tb in zip(nxt, positions, tables, strict=True)]
        positions = [p + 1 for p in positions]
    return report
