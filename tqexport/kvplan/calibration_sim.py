"""One layer's cache simulated in an unpaged forward: the cheap measurement ``calibrate`` uses.

The model runs with an attention function that, in one chosen layer, reads its keys and values
round-tripped through that layer's candidate codec (encoded, then decoded), except the recent
window (``p - j < W``) and the first S tokens, which stay exact, as the paged caches hold them;
every other layer attends exactly. With a key transform the chosen layer's queries and keys are
transformed first, both segments alike, as the executor does before every cache write. Each
layer attends as the model does: causally, within its sliding window if it has one, scores
softcapped if the model caps them (with nothing quantized the logits are the model's own,
tested). Layers before the chosen one do not change, so their output is kept from the baseline
pass and only the chosen layer and those after it run again.
(``benchmarks/quantizer_sim.py`` showed this reproduces ``bench quality``'s perplexities.)
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from tqexport.errors import TQExportError
from tqexport.kvquant.codecs import make_codec

NAME = "tqexport_calibrate"
#: query rows per score block (bounds the [heads, rows, T] score matrix)
ROWS = 1024


class LayerSimulation:
    """Baseline logits of ``ids`` and, per (layer, dtype, window, sinks, key transform), the
    logits with only that layer's cache quantized."""

    def __init__(self, lm, ids: list[int]):
        desc = lm.description
        core = getattr(lm.model, "model", None)
        if core is None or not hasattr(core, "layers") or not hasattr(lm.model, "lm_head"):
            raise TQExportError(f"calibrate needs a decoder with .model.layers; {desc.name} is "
                                f"{desc.architecture}")  # fmt: skip
        self.model, self.core = lm.model.eval(), core
        self.ids = torch.tensor([ids])
        self.layers = {la.index: la for la in desc.layers}
        self.active: tuple | None = None  # (layer, codec, window, sinks, key transform)
        AttentionInterface.register(NAME, self._attention)
        for m in self.model.modules():
            if hasattr(m, "config"):
                m.config._attn_implementation = NAME
        self.inputs: list[tuple] = []
        hooks = [
            layer.register_forward_pre_hook(self._keep, with_kwargs=True) for layer in core.layers
        ]
        try:
            with torch.no_grad():
                self.baseline = self.model(self.ids, use_cache=False).logits[0]
        finally:
            for h in hooks:
                h.remove()

    def _keep(self, module, args, kwargs):
        self.inputs.append((args, kwargs))

    def logits(
        self, layer: int, dtype: str, window: int, sinks: int, transform=None
    ) -> torch.Tensor:
        """``transform``: the layer's fitted :class:`~tqexport.kvquant.transforms.KeyTransform`
        (None: plain keys)."""
        codec = make_codec(dtype, self.layers[layer].head_size, model_dtype="float32")
        self.active = (layer, codec, window, sinks, transform)
        try:
            with torch.no_grad():
                args, kwargs = self.inputs[layer]
                h = args[0] if args else kwargs["hidden_states"]
                for i in range(layer, len(self.core.layers)):
                    # each layer its own arguments (Gemma 3: local or global rotary, mask)
                    rest = {k: v for k, v in self.inputs[i][1].items() if k != "hidden_states"}
                    out = self.core.layers[i](h, **rest)
                    h = out[0] if isinstance(out, tuple) else out
                logits = self.model.lm_head(self.core.norm(h))
                cap = getattr(self.model.config, "final_logit_softcapping", None)
                if cap:
                    logits = torch.tanh(logits / cap) * cap
        finally:
            self.active = None
        return logits[0]

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        la = self.layers[module.layer_idx]
        q = query[0]  # [H, T, D]
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
        window = sinks = 0
        if self.active is not None and module.layer_idx == self.active[0]:
            _, codec, window, sinks, transform = self.active
            if transform is not None:
                qt, k = transform.apply(q.transpose(0, 1), k)
                q = qt.transpose(0, 1)
            kq, vq = codec.decode(codec.encode(k, v))
        else:
            kq, vq = k, v
            window = k.shape[0]  # every entry exact
        scale = scaling if scaling is not None else la.scale
        out = mixed_attention(q, k, v, kq, vq, window, sinks, scale, la.window, la.softcap)
        return out.transpose(0, 1).unsqueeze(0), None


def mixed_attention(
    q, k, v, kq, vq, window: int, sinks: int, scale: float,
    sliding: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of ``q`` [H, T, D] (only over ``p - j < sliding`` for a sliding layer,
    scores capped at ``softcap``) that reads exact ``k``/``v`` [T, KVH, D] where the paged
    caches keep them (``p - j < window`` or ``j < sinks``) and ``kq``/``vq`` elsewhere, in
    blocks of ``ROWS`` query rows; [H, T, D]."""
    groups = q.shape[0] // k.shape[1]

    def heads(x):
        return x.permute(1, 0, 2).repeat_interleave(groups, 0)

    kh, vh, kqh, vqh = heads(k), heads(v), heads(kq), heads(vq)
    out = torch.empty_like(q)
    pos = torch.arange(q.shape[1])
    for a in range(0, q.shape[1], ROWS):
        b = min(q.shape[1], a + ROWS)
        p, j = pos[a:b, None], pos[None, :]
        exact = (p - j < window) | (j < sinks)
        s = torch.where(exact, q[:, a:b] @ kh.transpose(1, 2), q[:, a:b] @ kqh.transpose(1, 2))
        s = s * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        hidden = (j > p) if sliding is None else (j > p) | (p - j >= sliding)
        pr = torch.softmax(s.masked_fill(hidden, float("-inf")), -1)
        out[:, a:b] = (pr * exact) @ vh + (pr * ~exact) @ vqh
    return out
