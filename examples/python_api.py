"""Build an artifact and generate from it with the Python API (no command line involved).

python examples/python_api.py                      # SmolLM2, turboquant_4bit_nc
python examples/python_api.py --model tiny-llama --kv-cache-dtype fp8 --out /tmp/art
"""

import argparse
import tempfile
from pathlib import Path

from tqexport.export.artifact_build import build_artifact
from tqexport.runtime.engine import Engine, EngineConfig
from tqexport.runtime.sequence import SamplingParams
from tqexport.spec import BuildRequest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="HF dir, .gguf or built-in name")
    p.add_argument("--kv-cache-dtype", default="turboquant_4bit_nc")
    p.add_argument("--out", type=Path, help="artifact directory (default: a temporary one)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    args = p.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="tqexport-")) / "artifact"
    built = build_artifact(args.model, out, BuildRequest(kv_cache_dtype=args.kv_cache_dtype))
    for layer in built.spec.layers:  # which layer got which cache
        print(f"layer {layer.index}: {layer.kv_cache_dtype} ({layer.skipped_by or 'as asked'})")

    engine = Engine.from_artifact(built.out_dir, EngineConfig(kv_cache_memory="64MiB"))
    # a tokenizer-less artifact (the tiny built-ins) takes token ids instead of text
    prompts = args.prompt or (
        ["What is the capital of France?", "Name three primary colours."]
        if engine.tokenizer is not None
        else [[5, 9, 200, 3], [7, 1, 99]]
    )
    for done in engine.generate(prompts, SamplingParams(max_tokens=24)):
        print(f"{done.request_id}: {len(done.token_ids)} tokens, {done.finish_reason}: "
              f"{done.text!r}")  # fmt: skip


if __name__ == "__main__":
    main()
