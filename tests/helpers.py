"""Shared test helpers: model descriptions built in tests (no config files, no weights),
single-node ONNX models of one tqexport op, and paged prefills compared by the product's
parity rule."""

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from tqexport.contract.caches import allocate_caches
from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
from tqexport.kvplan.resolve import resolve
from tqexport.kvquant.modes import kv_cache_dtype_names
from tqexport.kvquant.turboquant import vllm_twin
from tqexport.models.description import AttentionLayer, ModelDescription
from tqexport.models.paged import PagedCausalLM
from tqexport.ops.attributes import DOMAIN, DOMAIN_VERSION
from tqexport.spec import BuildRequest
from tqexport.verify.parity import compare_write

#: what the heavy per-dtype matrices run: every name but bfloat16 (ONNX Runtime's CPU provider
#: has no bf16 MatMul) and the native twins of vLLM layouts, whose codec test_turboquant pins
#: byte-identical to their twin's
MATRIX_DTYPES = [d for d in kv_cache_dtype_names() if d != "bfloat16" and not vllm_twin(d)]


def describe(windows, head_size=64, kv_heads=2, dtype="bfloat16", name="test-model"):
    """A model whose layer i has window ``windows[i]`` (None = full attention)."""
    layers = tuple(
        AttentionLayer(
            index=i,
            module=f"model.layers.{i}.self_attn",
            window=w,
            num_kv_heads=kv_heads,
            head_size=head_size,
            scale=head_size**-0.5,
        )
        for i, w in enumerate(windows)
    )
    return ModelDescription(name, "LlamaForCausalLM", dtype, 2 * kv_heads, layers)


def dense(n, **kw):
    return describe([None] * n, **kw)


def gemma_like(n=6, window=8, **kw):
    """Alternating sliding (even layers) and full (odd layers) attention, like Gemma-2."""
    return describe([window if i % 2 == 0 else None for i in range(n)], **kw)


OPSET = 21
ONNX_TYPES = {"float32": 1, "uint8": 2, "float16": 10, "int64": 7, "int32": 6}


def layer_for(dtype, window=None, heads=2, d=64):
    """Layer 0 of a one-layer float32 model with a ``dtype`` cache (block size 4)."""
    desc = describe([window], head_size=d, kv_heads=heads, dtype="float32")
    return resolve(
        desc, BuildRequest(dtype, boundary=False, block_size=4), kv_scales={0: (0.5, 2.0)}
    ).spec.layers[0]


def single_node_model(op, attrs, inputs, out_types, *, bodies=True, library=None, options=None):
    """An ONNX Runtime session over one tqexport node fed ``inputs`` (graph inputs ``in0``...,
    outputs ``out0``... of ``out_types`` (element type name, rank)): the node's function body
    in the model (``bodies``) and/or the native kernel ``library`` registered (without the
    bodies ORT knows the op from the library only, and the model exports in no time).
    ``options``: the SessionOptions to start from."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from tqexport.export.functions import function_for

    functions = []
    if bodies:
        fn, extra = function_for(op, attrs, OPSET)
        functions = [fn, *extra]
    names_in = [f"in{i}" for i in range(len(inputs))]
    names_out = [f"out{i}" for i in range(len(out_types))]
    node = helper.make_node(
        op, names_in, names_out, domain=DOMAIN, overload=attrs.get("variant", "")
    )
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    g = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(n, ONNX_TYPES[str(x.dtype)[6:]], [None] * x.dim())
            for n, x in zip(names_in, inputs)
        ],
        [
            helper.make_tensor_value_info(n, ONNX_TYPES[t], [None] * r)
            for n, (t, r) in zip(names_out, out_types)
        ],
    )
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=functions,
        ir_version=10,
    )
    if bodies:
        onnx.checker.check_model(m)
    opts = options or ort.SessionOptions()
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@dataclass
class Run:
    """One sequence prefilled through the paged caches: logits at every position, the caches,
    each layer's k/v as the hook saw them, and the slots the sequence's tokens went to."""

    logits: torch.Tensor
    caches: dict[str, torch.Tensor]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor


def prefill_chunks(lm, spec, tokens, chunk, num_blocks=12) -> Run:
    """Prefill ``tokens`` in chunks of ``chunk`` with contiguous block tables from block 1."""
    seen: dict[int, list] = {}
    pm = PagedCausalLM(lm.model, spec, mode="inplace", observer=lambda la, k, v: seen.setdefault(
        la.index, []).append((k, v)))  # fmt: skip
    caches = allocate_caches(spec, num_blocks)
    tables = [list(range(1, num_blocks)) for _ in spec.groups]
    out = []
    with torch.no_grad():
        for start in range(0, len(tokens), chunk):
            step = build_step(spec, [SeqChunk(tokens[start : start + chunk], start, tables, "all")])
            out.append(pm(*ordered_inputs(spec, step, caches))[0])
    kv = {i: tuple(torch.cat(x) for x in zip(*parts)) for i, parts in seen.items()}
    return Run(torch.cat(out), caches, kv, spec.block_size + torch.arange(len(tokens)))


def serve_on_torch(lm, spec, prompt, max_tokens=40):
    """Generate from ``prompt`` through the block manager (a torch executor of ``spec`` over
    the loaded ``lm``: 16 blocks, 2 sequences, 16-token steps): (executor, sequence)."""
    from tqexport.contract.artifact import Artifact
    from tqexport.runtime.executor import Executor
    from tqexport.runtime.sequence import SamplingParams
    from tqexport.spec import ModelSpec

    spec = ModelSpec(model={**spec.model, "path": spec.model["name"]}, dtype=spec.dtype,
                     block_size=spec.block_size, layers=spec.layers, groups=spec.groups,
                     request=spec.request, io=spec.graph_io())  # fmt: skip
    ex = Executor(Artifact(None, spec), "torch", num_blocks=16, max_num_seqs=2,
                  max_num_batched_tokens=16, source_model=lm)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_stop=True)
    return ex, ex.generate([prompt], params)[0]


def first_cache_difference(spec, a: Run, b: Run) -> tuple[int, bool, list[str]] | None:
    """The first layer whose quantized bytes differ between two runs of the same tokens, whether
    both runs' bytes there are what the reference writes for b's k/v but at rounding thresholds
    (the product's parity rule), and the details; None when every layer holds the same bytes."""
    for layer in spec.layers:
        codec = layer.cache.codec
        rows = [
            [run.caches[layer.onnx_input(t.role)].flatten(0, 1)[run.slots] for t in codec.tensors]
            for run in (a, b)
        ]
        if all(torch.equal(x, y) for x, y in zip(*rows) if x.dtype == torch.uint8):
            continue
        k, v = b.kv[layer.index]
        empty = [torch.zeros_like(r).unsqueeze(0) for r in rows[1]]
        ok, details = True, []
        for run, got in zip("ab", rows):
            fine, _, said = compare_write(
                codec, empty, k, v, torch.arange(len(k)), [r.unsqueeze(0) for r in got], 1e-4
            )
            ok &= fine
            details += [f"run {run} {x}" for x in said]
        return layer.index, ok, details
    return None


def assert_same_run(spec, a: Run, b: Run, tol=1e-4):
    """Two numeric paths over the same tokens agree: logits within ``tol``, or else the first
    layer whose cache bytes differ differs only at a rounding threshold (one flipped code there
    legitimately changes every later layer, whatever the CPU's summation order)."""
    if torch.allclose(a.logits, b.logits, atol=tol, rtol=tol):
        return
    diff = float((a.logits - b.logits).abs().max())
    first = first_cache_difference(spec, a, b)
    assert first is not None, f"logits differ by {diff:.2e} while every cache holds the same bytes"
    layer, ok, details = first
    assert ok, f"logits differ by {diff:.2e}; layer {layer} bytes differ away from thresholds: " + (
        "; ".join(details)
    )


#: top-2 logit gap below which a greedy choice is a near tie that last-bit differences, or one
#: code flipped at a rounding threshold (1e-4..1e-3 in a tiny model's logits), may decide
NEAR_TIE = 1e-2
#: the near tie of ONNX Runtime running block-quantized weights at accuracy level 4 (8-bit
#: inputs) against the float32 reference on the same weights: on SmolLM2's Q4_1/Q8_0 blocks,
#: 512 teacher-forced positions, the top-2 gap moved by at most 0.64 and every changed argmax
#: had a gap of at most 0.30 at level 0
BLOCK_WEIGHTS_NEAR_TIE = 1.0


def at_accuracy(art, level: int):
    """``art`` served with its block-quantized weights at ONNX Runtime accuracy level ``level``
    (0: float32 inputs, the weights exactly as the reference holds them)."""
    import dataclasses

    if art.spec.weights is None:
        return art
    weights = dataclasses.replace(art.spec.weights, accuracy_level=level)
    return dataclasses.replace(art, spec=dataclasses.replace(art.spec, weights=weights))


def teacher_forced(module, spec, prompt, generated) -> torch.Tensor:
    """The reference's logits that predicted each generated token: one prefill of prompt +
    generated through ``module`` (a PagedCausalLM)."""
    tokens = prompt + generated
    blocks = -(-len(tokens) // spec.block_size)
    caches = allocate_caches(spec, blocks + 1)
    tables = [list(range(1, blocks + 1))] * len(spec.groups)
    step = build_step(spec, [SeqChunk(tokens[:-1], 0, tables, "all")])
    with torch.no_grad():
        return module(*ordered_inputs(spec, step, caches))[0][len(prompt) - 1 :]


def assert_greedy(logits, generated, near_tie=NEAR_TIE) -> int:
    """Wherever the reference is decisive (top-2 gap above ``near_tie``) its argmax is the
    generated token; returns the number of decisive positions."""
    top2 = logits.topk(2, dim=-1)
    decisive = (top2.values[:, 0] - top2.values[:, 1]) > near_tie
    agree = top2.indices[:, 0] == torch.tensor(generated)
    assert bool(agree[decisive].all()), (agree.tolist(), decisive.tolist())
    return int(decisive.sum())


def assert_same_generation(logits, a, b, near_tie=NEAR_TIE):
    """Greedy outputs ``a`` (``logits``: its teacher-forced reference logits) and ``b`` of one
    prompt agree token for token, or up to a near tie: where they split, each token's
    reference logit is within ``near_tie`` of the best (the top two at the default near tie;
    a wider noise, such as 8-bit inputs', may also pick a third that close)."""
    split = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if split is None:
        assert len(a) == len(b), (a, b)
        return
    row = logits[split]
    behind = {t: float(row.max() - row[t]) for t in (a[split], b[split])}
    assert max(behind.values()) <= near_tie, (
        f"outputs split at token {split} ({a[split]} vs {b[split]}) where the reference's top "
        f"two are {row.topk(2).indices.tolist()} and the two tokens are "
        f"{', '.join(f'{v:.2e}' for v in behind.values())} behind the best, not a near tie"
    )


#: kv dtypes whose numeric tests also run at 2 ORT threads (a second summation order): one per
#: codec path (aliases and formats of one codec read the same ORT kernels)
TWO_THREAD_DTYPES = (
    "auto", "fp8", "int8_per_token_head", "int4_per_token_head", "nvfp4", "turboquant_k8v4",
    "turboquant_4bit_nc", "turboquant_3bit_nc", "tqx_k4v3_g32",
)  # fmt: skip


#: a chat template for byte-tokenizer artifacts: <role>content lines, then <assistant>
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel tokenizer's vocabulary uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def with_byte_tokenizer(artifact_dir, out_dir):
    """A copy of a 256-token artifact (tiny built-ins) with a byte-level tokenizer (token id =
    byte) and BYTE_CHAT_TEMPLATE, so text prompts, chat and stop strings can be served."""
    import json
    import shutil
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    shutil.copytree(artifact_dir, out)
    chars = _byte_to_unicode()
    tok = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": BYTE_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def with_spec(artifact_dir, out_dir, change):
    """A copy of an artifact (its other files hard-linked) whose spec, in tqexport.json and in
    the graph alike, is ``change(spec as a dict)`` applied: what another build would have
    written (an older one, say)."""
    import json
    import os
    from pathlib import Path

    import onnx

    from tqexport.contract.files import MODEL_FILE, SPEC_FILE, set_spec_metadata
    from tqexport.spec import spec_from_dict

    src, out = Path(artifact_dir), Path(out_dir)
    d = json.loads((src / SPEC_FILE).read_text())
    change(d)
    spec = spec_from_dict(d)
    out.mkdir()
    for f in src.iterdir():
        if f.name not in (MODEL_FILE, SPEC_FILE):
            os.link(f, out / f.name)
    graph = onnx.load(str(src / MODEL_FILE), load_external_data=False)
    set_spec_metadata(graph, spec)
    (out / MODEL_FILE).write_bytes(graph.SerializeToString())
    (out / SPEC_FILE).write_text(spec.to_json())
    return out


@contextmanager
def serving(app):
    """``app`` served by uvicorn in a thread on 127.0.0.1 (a free port): its base URL."""
    import threading
    import time

    import uvicorn

    from tqexport.serve.runner import listen

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def main_inproc(capsys, *args):
    """``tqexport ARGS`` in this process (the heavy imports are paid once): (code, out, err)."""
    from tqexport.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err
