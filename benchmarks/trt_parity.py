"""TensorRT engine vs ONNX Runtime on one artifact: step logits side by side, then decode speed.

Both backends get identical step tensors (ORT's greedy tokens are fed to both, so they never
drift apart); per step the max |logit difference| is printed. Then each backend serves the same
continuous batch and decode tokens/s are printed side by side with their ratio. Needs an
artifact with ``engine.plan`` (``tqexport engine``), a GPU and tensorrt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from tqexport.contract.artifact import open_artifact
from tqexport.contract.files import PROFILE_FILE
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.runtime.backends.ort import OrtBackend
from tqexport.runtime.backends.trt import TrtBackend
from tqexport.runtime.executor import Executor
from tqexport.runtime.sequence import SamplingParams


def logits_parity(art, prompts: list[list[int]], steps: int, num_blocks: int) -> float:
    """Prefill every prompt in one step, then ``steps`` decode steps; returns the worst error."""
    ort, trt = OrtBackend(art, num_blocks), TrtBackend(art, num_blocks)
    bs, groups = art.spec.block_size, len(art.spec.groups)
    per_seq = (num_blocks - 1) // len(prompts)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(prompts))]
    assert max(len(p) for p in prompts) + steps <= per_seq * bs, "raise --num-blocks"
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(s, 0, [t] * groups) for s, t in zip(seqs, tables, strict=True)]
    worst = 0.0
    for i in range(steps + 1):
        step = build_step(art.spec, chunks)
        a, b = ort.run(step).float(), trt.run(step).float()
        err = (a - b).abs().max().item()
        same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        print(f"step {i}: max |ORT - TRT| logit {err:.2e}, same greedy token {same:.0%}")
        worst = max(worst, err)
        nxt = a.argmax(-1).tolist()
        chunks = []
        for s, t, tok in zip(seqs, tables, nxt, strict=True):
            s.append(tok)
            chunks.append(SeqChunk([tok], len(s) - 1, [t] * groups))
    return worst


def decode_rate(art, backend: str, prompts, max_tokens: int, num_blocks: int) -> float:
    limits = json.loads((art.path / PROFILE_FILE).read_text())
    ex = Executor(art, backend, num_blocks=num_blocks, max_num_seqs=len(prompts),
                  max_num_batched_tokens=limits["max_num_batched_tokens"])  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_stop=True)
    ex.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_stop=True))  # warm-up
    start = time.perf_counter()
    seqs = ex.generate(prompts, params)
    return sum(len(s.output) for s in seqs) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    args = ap.parse_args()
    art = open_artifact(args.artifact)
    vocab = int(art.spec.model.get("vocab_size") or 100)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt_len - i,), generator=g).tolist()
               for i in range(args.batch)]  # fmt: skip
    worst = logits_parity(art, prompts, args.steps, args.num_blocks)
    rates = {
        b: decode_rate(art, b, prompts, args.max_tokens, args.num_blocks) for b in ("ort", "trt")
    }
    ratio = rates["trt"] / rates["ort"]
    print(f"decode tokens/s (batch {args.batch}, {args.max_tokens} tokens each): "
          f"ORT {rates['ort']:.1f}, TRT {rates['trt']:.1f} (TRT/ORT {ratio:.2f}x)")  # fmt: skip
    ok = worst <= args.tolerance
    print(f"parity: {'PASS' if ok else 'FAIL'} (worst {worst:.2e}, tolerance {args.tolerance:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
