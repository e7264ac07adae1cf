"""A two-layer llama GGUF with every block type tqexport maps (and one it does not), written in
seconds: SmolLM2's tokenizer fields, seeded random blocks, tied embeddings.

Weights are random (gguf's own quantizer for the types it writes, random bytes with small
scales for the K-quants), so the model means nothing; what tests read is that every type
round-trips through a build against gguf's own dequantization.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 256, 2, 4, 2
#: every matrix's block type, by GGUF name (ffn_gate of layer 1: Q3_K, which has no mapping)
TYPES = {
    "token_embd.weight": "Q4_0",
    "blk.0.attn_q.weight": "Q4_1",
    "blk.0.attn_k.weight": "Q5_0",
    "blk.0.attn_v.weight": "Q5_1",
    "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q5_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q4_K",
    "blk.1.attn_k.weight": "Q4_1",
    "blk.1.attn_v.weight": "Q8_0",
    "blk.1.attn_output.weight": "Q4_0",
    "blk.1.ffn_gate.weight": "Q3_K",
    "blk.1.ffn_up.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q5_K",
}
#: the byte offsets of each K-quant block's float16 scales (the rest is random codes)
K_SCALES = {"Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.05) -> np.ndarray:  # fmt: skip
    """`rows` x `cols` weights of about `scale` in GGUF blocks of `type_name`, as raw bytes."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in K_SCALES:
        return quants.quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32),
                               qtype)  # fmt: skip
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for off in K_SCALES[type_name]:
        d = rng.uniform(scale / 250, scale / 50, (rows, cols // per)).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, source: Path, types: dict[str, str] = TYPES, seed: int = 0,
                    drop: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """Write the tiny GGUF to ``path`` with ``source``'s tokenizer (a llama GGUF: SmolLM2's);
    ``drop``: tensors to leave out (a damaged file)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer.add_vocab_size(vocab)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types_ = field.types
        value = field.contents()
        if types_[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, types_[0], sub_type=types_[-1])
        else:
            writer.add_key_value(key, value, types_[0])
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, HIDDEN)}
    kv = KV_HEADS * HIDDEN // HEADS
    per_layer = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
                 "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
                 "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.{n}.weight": shape for n, shape in per_layer.items()}
    for name, (rows, cols) in shapes.items():
        if name in drop:
            continue
        qtype = gguf.GGMLQuantizationType[types[name]]
        writer.add_tensor(name, random_blocks(types[name], rows, cols, rng), raw_dtype=qtype)
    for name in [f"blk.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "ffn")]:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
