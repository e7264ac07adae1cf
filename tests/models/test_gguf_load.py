"""Loading a GGUF model: the first load converts it to a safetensors copy in the cache, parsing
the file's metadata once for the config (kept as JSON) and once with its tensors; later loads
read the copy. Checked on a tiny Llama GGUF written here (float32 tensors, a byte vocabulary)."""

from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel

from tqexport.models.loader import load_model

VOCAB, DIM, LAYERS, HEADS, FF = 256, 16, 2, 2, 32
#: the byte-level vocabulary: token i is the i-th character of the byte alphabet
TOKENS = sorted(ByteLevel.alphabet())


def write_tiny_llama(path) -> dict[str, np.ndarray]:
    """A valid 2-layer Llama GGUF with a byte-level vocabulary; returns its tensors by name."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, DIM), "output.weight": (VOCAB, DIM),
              "output_norm.weight": (DIM,)}  # fmt: skip
    for i in range(LAYERS):
        for name, shape in (("attn_q", (DIM, DIM)), ("attn_k", (DIM, DIM)),
                            ("attn_v", (DIM, DIM)), ("attn_output", (DIM, DIM)),
                            ("ffn_gate", (FF, DIM)), ("ffn_up", (FF, DIM)),
                            ("ffn_down", (DIM, FF)), ("attn_norm", (DIM,)),
                            ("ffn_norm", (DIM,))):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * VOCAB)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture
def parses(monkeypatch):
    """Counts gguf.GGUFReader instances (transformers' GGUF loader parses a file with one)."""
    count = Counter()
    init = gguf.GGUFReader.__init__

    def counted(self, path, *args, **kwargs):
        count[str(path)] += 1
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    return count


def test_gguf_conversion_parses_the_file_once_with_its_tensors(tmp_path, monkeypatch, parses):
    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    tensors = write_tiny_llama(path)
    lm = load_model(str(path), "float32")
    # once for the config (kept as JSON beside the copy), once with the tensors; the model's
    # config and the tokenizer's reuse them (they parsed it twice more)
    assert parses == {str(path): 2}
    emb = lm.model.get_input_embeddings().weight
    assert torch.equal(emb, torch.from_numpy(tensors["token_embd.weight"]))
    assert torch.equal(lm.model.lm_head.weight, torch.from_numpy(tensors["output.weight"]))
    ids = lm.tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert ids == [TOKENS.index("h"), TOKENS.index("i")]
    load_model(str(path), "float32")  # the converted copy: no parse at all
    assert parses == {str(path): 2}


def test_gguf_tokens_before_conversion_match_the_converted_copy(tmp_path, monkeypatch):
    """A build that never converts the GGUF (stored weight blocks) reads its tokenizer and
    generation config from the file: the same generation config the converted copy keeps (the
    file holds no generation_config.json: transformers' defaults from the model's config)."""
    from tqexport.models.cache import gguf_cache
    from tqexport.models.config import load_config
    from tqexport.models.loader import load_tokenizer

    monkeypatch.setenv("TQEXPORT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    config, _ = load_config(str(path))
    tok, gen = load_tokenizer(str(path), config)
    assert not (gguf_cache(path) / "model.safetensors").exists()  # nothing converted
    assert (gen.bos_token_id, gen.eos_token_id) == (0, 1)
    lm = load_model(str(path), "float32")
    assert gen.to_dict() == lm.generation_config.to_dict()
    ids = tok("hi", add_special_tokens=False)["input_ids"]
    assert ids == [TOKENS.index("h"), TOKENS.index("i")]
    tok2, gen2 = load_tokenizer(str(path), config)  # now from the converted copy
    assert gen2.to_dict() == gen.to_dict() and tok2.get_vocab() == tok.get_vocab()
