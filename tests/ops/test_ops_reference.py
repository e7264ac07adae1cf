"""The paged reference ops inside real transformers models (tiny, seeded random weights)."""

import pytest
import torch
from helpers import Run, assert_same_run, prefill_chunks

from tqexport.contract.caches import allocate_caches
from tqexport.contract.steps import SeqChunk, build_step, ordered_inputs
from tqexport.kvplan.resolve import resolve
from tqexport.models.loader import load_model
from tqexport.models.paged import PagedCausalLM
from tqexport.spec import BuildRequest

TINY = ["tiny-llama", "tiny-llama-d128", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-mistral"]


@pytest.fixture(scope="module")
def models():
    return {}


def get(models, name):
    if name not in models:
        models[name] = load_model(name)
    return models[name]


def eager_logits(model, tokens):
    impl = model.config._attn_implementation
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float()
    finally:
        for m in model.modules():
            if hasattr(m, "config"):
                m.config._attn_implementation = impl


@pytest.mark.parametrize("name", TINY)
def test_hook_reproduces_transformers_forward(models, name):
    lm = get(models, name)
    spec = resolve(lm.description, BuildRequest("auto")).spec
    tokens = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    got = prefill_chunks(lm, spec, tokens, 64).logits
    if name in ("tiny-gemma2", "tiny-gemma3", "tiny-mistral"):
        assert 8 in {la.window for la in spec.layers}  # windows shorter than the prompt
    torch.testing.assert_close(got, eager_logits(lm.model, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["auto", "turboquant_4bit_nc", "fp8"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_chunking_never_changes_results(models, name, dtype):
    lm = get(models, name)
    spec = resolve(lm.description, BuildRequest(dtype, boundary=False)).spec
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = prefill_chunks(lm, spec, tokens, 40)
    for chunk in (7, 1):
        assert_same_run(spec, prefill_chunks(lm, spec, tokens, chunk), whole)


def test_mixed_batch_equals_sequences_alone(models):
    lm = get(models, "tiny-gemma2")
    spec = resolve(lm.description, BuildRequest("turboquant_k3v4_nc", boundary=False)).spec
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (20,), generator=g).tolist()
    b = torch.randint(0, 256, (9,), generator=g).tolist()
    alone_a, alone_b = prefill_chunks(lm, spec, a, 20), prefill_chunks(lm, spec, b, 9)
    seen = {}
    pm = PagedCausalLM(lm.model, spec, mode="inplace", observer=lambda la, k, v: seen.setdefault(
        la.index, []).append((k, v)))  # fmt: skip
    caches = allocate_caches(spec, 12)
    ta = [[1, 2, 3, 4] for _ in spec.groups]
    tb = [[5, 6, 7] for _ in spec.groups]
    with torch.no_grad():
        # prefill a (19 tokens) and b's first 5 in one step, then a decode for a + 4 more of b
        s1 = build_step(spec, [SeqChunk(a[:19], 0, ta, "all"), SeqChunk(b[:5], 0, tb, "all")])
        l1 = pm(*ordered_inputs(spec, s1, caches))[0]
        s2 = build_step(spec, [SeqChunk(a[19:], 19, ta, "all"), SeqChunk(b[5:], 5, tb, "all")])
        l2 = pm(*ordered_inputs(spec, s2, caches))[0]
    batched_a = Run(torch.cat([l1[:19], l2[:1]]), caches, {}, 16 + torch.arange(20))
    batched_b = Run(torch.cat([l1[19:], l2[1:]]), caches, {}, 5 * 16 + torch.arange(9))
    for i, parts in seen.items():
        k, v = (torch.cat(x) for x in zip(*parts))  # step 1: a[:19], b[:5]; step 2: a[19], b[5:]
        batched_a.kv[i] = (torch.cat([k[:19], k[24:25]]), torch.cat([v[:19], v[24:25]]))
        batched_b.kv[i] = (torch.cat([k[19:24], k[25:]]), torch.cat([v[19:24], v[25:]]))
    assert_same_run(spec, batched_a, alone_a)
    assert_same_run(spec, batched_b, alone_b)


def test_padding_tokens_and_rows_leave_other_caches_untouched(models):
    lm = get(models, "tiny-llama")
    spec = resolve(lm.description, BuildRequest("turboquant_4bit_nc", boundary=False)).spec
    pm = PagedCausalLM(lm.model, spec, mode="inplace")
    caches = allocate_caches(spec, 8)
    tables = [[1, 2] for _ in spec.groups]
    with torch.no_grad():
        pm(*ordered_inputs(spec, build_step(spec, [SeqChunk(list(range(20)), 0, tables)]), caches))
        before = {n: t.clone() for n, t in caches.items()}
        other = [[3] for _ in spec.groups]
        step = build_step(spec, [SeqChunk([7, 8], 0, other)], pad_tokens=3, pad_seqs=2)
        assert step["slot_mapping_0"].tolist()[-3:] == [-1, -1, -1]
        logits = pm(*ordered_inputs(spec, step, caches))[0]
    assert logits.shape == (1, 256) and bool(torch.isfinite(logits).all())
    for name, t in caches.items():
        assert torch.equal(t[1:3], before[name][1:3]), name  # sequence 1's blocks
        assert torch.equal(t[4:], before[name][4:]), name


def test_strict_hook_rejects_unknown_attention_arguments(models):
    from tqexport.models.hook import UnsupportedModelError, tqexport_attention

    class Ctx:
        def layer(self, i):
            return spec.layers[i]

    lm = get(models, "tiny-llama")
    spec = resolve(lm.description, BuildRequest("auto")).spec
    module = lm.model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 2, 64)
    with pytest.raises(UnsupportedModelError, match="'s_aux'"):
        tqexport_attention(module, q, q, q, None, tq_step=Ctx(), s_aux=torch.zeros(4))
    with pytest.raises(UnsupportedModelError, match="window"):
        tqexport_attention(module, q, q, q, None, tq_step=Ctx(), sliding_window=4)
    with pytest.raises(UnsupportedModelError, match="scale"):
        tqexport_attention(module, q, q, q, None, tq_step=Ctx(), scaling=1.0)


def test_hook_reproduces_transformers_on_smollm2(models):
    lm = get(models, "smollm2")
    spec = resolve(lm.description, BuildRequest("auto")).spec
    text = "The quick brown fox jumps over the lazy dog. " * 8
    tokens = lm.tokenizer(text)["input_ids"][:64]
    assert len(tokens) == 64
    got = prefill_chunks(lm, spec, tokens, 64, num_blocks=6).logits
    torch.testing.assert_close(got, eager_logits(lm.model, tokens), atol=1e-4, rtol=1e-4)
