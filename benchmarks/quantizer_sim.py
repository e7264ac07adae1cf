"""Perplexity of K/V quantizers by simulation: the exploration behind the ``_mse`` presets.

SmolLM2 scores one window of ``bench quality``'s text with eager attention in which every layer
reads round-tripped (quantized, then decoded) keys and values, except the recent window
(``p - j < W``) and the first S tokens, which stay exact, as the paged caches hold them. Keys
can be centred by the calibrated mean (``center``, the product's calibration). Quantizers are
the product's codecs (``tq:NAME`` keys or values) or candidates not shipped as presets
(``uniform:BITS`` values, ``mse:BITS`` rotated Lloyd-Max with norm correction, ``ls:BITS`` the
same with the least-squares scale, ``centered-mse:BITS`` values centred by their calibrated
mean). It reproduces ``bench quality`` (tqx_k4v2_mse recent 60 + sink 4 + center: +1.45% here
and through the caches) at a fraction of the set-up, so candidates are screened here and only
what earns its bytes becomes a preset.

    python benchmarks/quantizer_sim.py --keys tq:tqx_k4v4 --values mse:2 --recent 60 --sink 4
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import AttentionInterface

from tqexport.bench.evaltext import pydoc_topics
from tqexport.kvplan.calibration_sim import mixed_attention
from tqexport.kvplan.fitting import held_out_calibration_text, key_statistics
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import make_codec
from tqexport.models.loader import load_model

NAME = "tqexport_sim"


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def codec_keys(name: str, d: int):
    codec = make_codec(name, d, model_dtype="float32")
    return lambda k: codec.decode_keys(codec.encode(k, torch.zeros_like(k))["kv"])


def codec_values(name: str, d: int):
    codec = make_codec(name, d, model_dtype="float32")
    return lambda v: codec.decode_values(codec.encode(torch.ones_like(v), v)["kv"])


def uniform(bits: int):
    """vLLM's value rule: min/max per vector, fp16 scale and zero."""

    def f(v):
        lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
        scale = _fp16(((hi - lo) / (2**bits - 1)).clamp(min=1e-8))
        lo = _fp16(lo)
        return torch.clamp(torch.floor((v - lo) / scale + 0.5), 0, 2**bits - 1) * scale + lo

    return f


def rotated(bits: int, d: int, least_squares: bool = False):
    """Rotated unit vector as Lloyd-Max codes; fp16 norm (norm-corrected) or LS scale."""
    cents = tq.centroids(d, bits)
    th, rot = tq.thresholds(cents), tq.hadamard(d)

    def f(x):
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        y = (x / (n + 1e-8)) @ rot
        c = cents[torch.bucketize(y, th, right=True)]
        if least_squares:  # the stored scalar is the scale itself
            s = _fp16(n * (y * c).sum(-1, keepdim=True) / ((c * c).sum(-1, keepdim=True) + 1e-16))
        else:  # the stored scalar is the norm; the read divides by |c| (the presets' rule)
            s = _fp16(n) / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        return s * (c @ rot)

    return f


class Simulation:
    def __init__(self, chunk: int):
        self.lm = load_model("smollm2", "float32")
        self.model = self.lm.model.eval()
        tok = self.lm.tokenizer
        self.ids = tok(pydoc_topics().text, add_special_tokens=False)["input_ids"][:chunk]
        self.layers = len(self.lm.description.layers)
        self.cfg: dict = {}
        self.collect: dict | None = None
        AttentionInterface.register(NAME, self._attention)
        self.baseline = self.nll()

    def key_centers(self) -> dict[int, torch.Tensor]:
        stats = key_statistics(self.lm, held_out_calibration_text())
        return {i: torch.tensor((s.k_sum / s.count).numpy(), dtype=torch.float32)
                for i, s in stats.items()}  # fmt: skip

    def value_means(self, max_tokens: int = 4096, window: int = 2048) -> dict[int, torch.Tensor]:
        """Per-layer mean value (each window's first 4 tokens left out), held-out text."""
        ids = self.lm.tokenizer(held_out_calibration_text())["input_ids"][:max_tokens]
        self.collect, self.cfg = {}, {}
        for at in range(0, len(ids), window):
            self._forward(ids[at : at + window])
        means = {i: torch.cat([v[4:] for v in vs]).mean(0) for i, vs in self.collect.items()}
        self.collect = None
        return means

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kw):
        layer = module.layer_idx
        c = self.cfg.get(layer, {})
        q = query[0]  # [H, T, D]
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
        if self.collect is not None:
            self.collect.setdefault(layer, []).append(v.clone())
        if c.get("center") is not None:
            k = k - c["center"]
        kq = c["keys"](k) if c.get("keys") else k
        vq = c["values"](v, layer) if c.get("values") else v
        out = mixed_attention(q, k, v, kq, vq, c.get("recent", 0), c.get("sink", 0), scaling)
        return out.transpose(0, 1).unsqueeze(0), None

    def _forward(self, ids):
        for m in self.model.modules():
            if hasattr(m, "config"):
                m.config._attn_implementation = NAME
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0]

    def nll(self) -> torch.Tensor:
        logits = self._forward(self.ids)[:-1].double()
        target = torch.tensor(self.ids[1:])
        return -torch.log_softmax(logits, -1)[torch.arange(len(target)), target]

    def score(self, cfg: dict) -> float:
        """Perplexity change against exact attention."""
        self.cfg = cfg
        try:
            n = self.nll()
        finally:
            self.cfg = {}
        return math.exp(n.mean()) / math.exp(self.baseline.mean()) - 1


def quantizer(spec: str | None, d: int, role: str, sim: Simulation):
    if not spec or spec == "exact":
        return None
    kind, _, arg = spec.partition(":")
    if kind == "tq":
        f = (codec_keys if role == "keys" else codec_values)(arg, d)
    elif kind == "uniform":
        f = uniform(int(arg))
    elif kind in ("mse", "ls"):
        f = rotated(int(arg), d, least_squares=kind == "ls")
    elif kind == "centered-mse" and role == "values":
        means, g = sim.value_means(), rotated(int(arg), d)
        return lambda v, layer: g(v - means[layer]) + means[layer]
    else:
        raise SystemExit(f"unknown {role} quantizer {spec!r}")
    return f if role == "keys" else (lambda v, layer: f(v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--keys", default="tq:tqx_k4v4")
    ap.add_argument("--values", default="mse:2")
    ap.add_argument("--recent", type=int, default=60)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--no-center", action="store_true")
    ap.add_argument("--chunk", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(2)
    sim = Simulation(args.chunk)
    d = sim.lm.description.layers[0].head_size
    centers = None if args.no_center else sim.key_centers()
    keys = quantizer(args.keys, d, "keys", sim)
    values = quantizer(args.values, d, "values", sim)
    cfg = {
        i: dict(keys=keys, values=values, recent=args.recent, sink=args.sink,
                center=None if centers is None else centers[i])
        for i in range(sim.layers)
    }  # fmt: skip
    t = time.time()
    change = sim.score(cfg)
    print(f"keys {args.keys}, values {args.values}, recent {args.recent} + sink {args.sink}"
          f"{'' if centers is None else ', center'}: ppl {100 * change:+.2f}% "
          f"({time.time() - t:.0f} s, {len(sim.ids) - 1} predictions)")  # fmt: skip


if __name__ == "__main__":
    main()
