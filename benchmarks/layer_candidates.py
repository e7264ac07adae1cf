"""Would a cache the calibration table lacks earn its bytes under ``--kv-bits``? A screen in the
calibration simulation, before any format is built.

Two families are screened against a base candidate and its upgrade (by default
``tqx_k3v2_mse:w24:s8`` and ``tqx_k4v2_mse:w24:s8``, what ``--kv-bits 3.0`` mixes):

- outlier-channel keys (``--split HI:LO:N``): per kv head, the N key channels of largest mean
  square on the calibration text (after the key transform) are rotated, normed and coded on
  their own at HI bits, the other channels at LO bits; values as the base candidate's. Its bits
  are the base's with its key codes and norm replaced by the two parts' codes and norms (with
  4:2:32 at head size 64 and 3-bit base keys: one fp16 norm more per token and kv head).
- a candidate per kv head: each kv head of a layer takes the base or the upgrade on its own,
  at a third of the layer's bits (SmolLM2: 3 kv heads).

Costs are the calibration's (:mod:`tqexport.kvplan.calibration`: mean KL against the
unquantized model with only that layer, or that kv head, changed); plans under each budget come
from the exact knapsack ``--kv-bits`` solves (:func:`tqexport.kvplan.kv_budget.least_cost`).
Printed: the predicted KL of the best plan per budget, per layer from {base, upgrade}, with the
split added, and per kv head.

    python benchmarks/layer_candidates.py --budgets 2.875,3.0,3.125 --json out/screen.json
"""

from __future__ import annotations

import argparse
import json
import time
from fractions import Fraction
from pathlib import Path

import torch

from tqexport.kvplan import calibration_sim
from tqexport.kvplan.calibration import BaselineKL
from tqexport.kvplan.fitting import calibrate_key_transforms, held_out_calibration_text
from tqexport.kvplan.kv_budget import candidate_bits, layer_elements, least_cost
from tqexport.kvquant import transforms
from tqexport.kvquant import turboquant as tq
from tqexport.kvquant.codecs import NC_EPS, NORM_EPS, make_codec
from tqexport.models.loader import load_model
from tqexport.spec.kv_layers import parse_kv_layers


def mse_round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """TurboQuant's MSE keys on vectors ``x [..., n]`` (n a power of two): the unit vector
    Hadamard-rotated, each coordinate to its Lloyd-Max centroid, norm-corrected, fp16 norm."""
    n = x.shape[-1]
    rotation, book = tq.hadamard(n), tq.centroids(n, bits)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    c = book[tq.centroid_index((x / (norm + NORM_EPS)) @ rotation, tq.thresholds(book))]
    c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS)
    return norm.half().float() * (c @ rotation)


class ScreenCodec:
    """A round trip for the simulation: ``dtype``'s codec, with outlier-split keys (``split``:
    HI, LO, N) and/or only kv head ``head`` quantized (the others exact)."""

    def __init__(self, dtype: str, split: tuple[int, int, int] | None = None,
                 head: int | None = None):  # fmt: skip
        self.dtype, self.split, self.head = dtype, split, head

    def encode(self, k, v):
        return k, v

    def decode(self, kv):
        k, v = kv
        codec = make_codec(self.dtype, k.shape[-1], model_dtype="float32")
        kq, vq = codec.decode(codec.encode(k, v))
        if self.split is not None:
            hi, lo, n = self.split
            kq = torch.empty_like(k)
            for h in range(k.shape[1]):
                x = k[:, h].float()
                order = torch.argsort((x * x).mean(0), descending=True)
                kq[:, h, order[:n]] = mse_round_trip(x[:, order[:n]], hi)
                kq[:, h, order[n:]] = mse_round_trip(x[:, order[n:]], lo)
        if self.head is not None:
            exact = torch.arange(k.shape[1]) != self.head
            kq, vq = kq.clone(), vq.clone()
            kq[:, exact], vq[:, exact] = k[:, exact], v[:, exact]
        return kq, vq


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--base", default="tqx_k3v2_mse:w24:s8")
    ap.add_argument("--upgrade", default="tqx_k4v2_mse:w24:s8")
    ap.add_argument("--split", default="4:2:32", help="HI:LO:N outlier-split keys")
    ap.add_argument("--key-transform", default="center")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budgets", default="2.875,3.0,3.125")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    start = time.monotonic()
    hi, lo, n = (int(x) for x in args.split.split(":"))
    kinds = transforms.parse_key_transform(args.key_transform)
    lm = load_model(args.model, "float32")
    desc = lm.description
    text = held_out_calibration_text()
    fitted = calibrate_key_transforms(lm, text, kinds) if kinds else {}
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    sim = calibration_sim.LayerSimulation(lm, ids)
    kl = BaselineKL(sim.baseline)
    base, upgrade = (parse_kv_layers(f"0:{c}")[0] for c in (args.base, args.upgrade))
    if (base.recent_window, base.sink_tokens) != (upgrade.recent_window, upgrade.sink_tokens):
        ap.error("--base and --upgrade must share their window and sinks (one simulation each)")
    kvh = desc.layers[0].num_kv_heads
    screened = {"base": ScreenCodec(base.dtype), "upgrade": ScreenCodec(upgrade.dtype),
                "split": ScreenCodec(base.dtype, (hi, lo, n))}  # fmt: skip
    for h in range(kvh):
        screened[f"base h{h}"] = ScreenCodec(base.dtype, head=h)
        screened[f"upgrade h{h}"] = ScreenCodec(upgrade.dtype, head=h)
    made = calibration_sim.make_codec
    calibration_sim.make_codec = lambda dtype, *a, **kw: (
        screened.get(dtype) or made(dtype, *a, **kw)
    )
    cost = []
    try:
        for pos, la in enumerate(desc.layers):
            row = {name: max(kl(sim.logits(pos, name, base.recent_window or 0,
                                           base.sink_tokens or 0, fitted.get(la.index))), 0.0)
                   for name in screened}  # fmt: skip
            cost.append(row)
            print(f"layer {pos}: " + ", ".join(f"{k} {v:.5f}" for k, v in row.items()), flush=True)
    finally:
        calibration_sim.make_codec = made
    bits = candidate_bits(desc, [args.base, args.upgrade])  # [layer][auto, base, upgrade]
    d, key_bits = desc.layers[0].head_size, tq.preset(base.dtype).key_bits
    split_extra = kvh * (hi * n + lo * (d - n) + 32 - (key_bits * d + 16))  # per token
    elements = sum(layer_elements(desc))
    plans = {
        "per layer": ([[b[1], b[2]] for b in bits],
                      [[c["base"], c["upgrade"]] for c in cost]),
        "per layer + split": ([[b[1], b[2], b[1] + split_extra] for b in bits],
                              [[c["base"], c["upgrade"], c["split"]] for c in cost]),
        "per kv head": ([[b[1] / kvh, b[2] / kvh] for b in bits for _ in range(kvh)],
                        [[c[f"base h{h}"], c[f"upgrade h{h}"]] for c in cost for h in range(kvh)]),
    }  # fmt: skip
    results = []
    print("| bits per element | " + " | ".join(plans) + " |")
    print("|---" * (len(plans) + 1) + "|")
    for budget in (float(b) for b in args.budgets.split(",")):
        cells = {}
        for name, (b, c) in plans.items():
            best = least_cost(b, c, Fraction(budget) * elements)
            cells[name] = None if best is None else best[1]
        results.append({"bits": budget, "predicted_kl": cells})
        print(f"| {budget:g} | " + " | ".join("-" if v is None else f"{v:.4f}"
                                              for v in cells.values()) + " |")  # fmt: skip
    seconds = round(time.monotonic() - start, 1)
    print(f"{len(ids)} calibration tokens, {seconds} s")
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "base": args.base, "upgrade": args.upgrade, "split": args.split,
            "key_transform": args.key_transform, "tokens": len(ids), "cost": cost,
            "budgets": results, "seconds": seconds}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
