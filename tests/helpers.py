"""Model descriptions built in tests (no config files, no weights)."""

from tqexport.resolve import AttentionLayer, ModelDescription


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
