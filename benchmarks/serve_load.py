"""Load on ``tqexport serve`` over loopback: concurrency 1/4/16/64, per kv dtype.

For each kv dtype the server runs in a subprocess on 127.0.0.1 (a free port) and asyncio
clients stream chat completions (every request the same max_tokens, eos ignored) at each
concurrency level, a bounded number of requests per level and a time cap. Printed per level:
requests/s, output tokens/s, time to first token and latency p50/p99, errors. Then the same
prompts' batch ``Engine.generate`` in this process (the server idle), and the ratio of the
server's output tokens/s at concurrency 16 to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from tqexport.bench.speed import artifact_for

TOPICS = (
    "rivers", "bread", "the moon", "trains", "chess", "rain", "honey", "glass", "maps",
    "owls", "copper", "tea", "bridges", "snow", "violins", "salt",
)  # fmt: skip
SERVER = """
import sys
from tqexport.runtime.engine import EngineConfig
from tqexport.serve import serve
serve(sys.argv[1], EngineConfig(kv_cache_memory=sys.argv[2]), port=0, served_model_name="bench",
      log_level="info")
"""


def prompts(n: int) -> list[str]:
    return [f"Write two sentences about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def start_server(path: Path, memory: str, timeout: float = 180.0):
    """The server subprocess and its base URL, once it accepts requests."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(path), memory],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    found: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m and not found:
                found.append(m[1])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not found:
        proc.kill()
        raise SystemExit(f"the server for {path} did not start")
    return proc, found[0]


async def one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, latency, output tokens, or the error."""
    body = {
        "model": "bench", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    n = len(chunk["choices"][0].get("token_ids") or [])
                    if n and ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += n
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    if not done or tokens != max_tokens:
        return {"error": f"{tokens} tokens, [DONE] {'seen' if done else 'missing'}"}
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": tokens}


def percentile(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def level(base: str, concurrency: int, texts: list[str], max_tokens: int, cap: float):
    """Serve ``texts`` with ``concurrency`` requests in flight; stop issuing after ``cap`` s."""
    results: list[dict] = []
    todo = iter(texts)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def worker():
            for text in todo:
                if time.perf_counter() - start > cap:
                    return
                results.append(await one(client, base, text, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    lat = [r["latency"] for r in ok]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "seconds": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "latency_p50": percentile(lat, 50),
        "latency_p99": percentile(lat, 99),
    }


def batch_generate(path: Path, memory: str, texts: list[str], max_tokens: int) -> float:
    """Output tokens/s of one batch ``Engine.generate`` of ``texts`` (eos ignored)."""
    from tqexport.runtime.engine import Engine, EngineConfig
    from tqexport.runtime.sequence import SamplingParams

    engine = Engine.from_artifact(path, EngineConfig(kv_cache_memory=memory))
    messages = [[{"role": "user", "content": t}] for t in texts]
    engine.generate(messages[:1], SamplingParams(max_tokens=2, ignore_stop=True))  # warm-up
    t0 = time.perf_counter()
    done = engine.generate(messages, SamplingParams(max_tokens=max_tokens, ignore_stop=True))
    wall = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / wall


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="auto,turboquant_4bit_nc")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", default="4,8,32,64", help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--level-seconds", type=float, default=90.0, help="time cap per level")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--workdir", type=Path, default=Path("out/bench"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(levels) != len(counts) or min(levels + counts) < 1:
        raise SystemExit("--concurrency and --requests need as many positive values each")
    console = Console(width=160)
    table = Table(title=f"tqexport serve over loopback, {args.model}, {args.max_tokens} tokens")
    for col in ("kv dtype", "conc", "requests", "errors", "req/s", "out tok/s",
                "TTFT p50", "TTFT p99", "lat p50", "lat p99"):  # fmt: skip
        table.add_column(col, justify="right")
    summary = []
    for dtype in args.dtypes.split(","):
        path = artifact_for(args.model, dtype, args.workdir).path
        proc, base = start_server(path, args.kv_cache_memory)
        try:
            # one short warm-up request (ORT's first runs are slower)
            asyncio.run(level(base, 1, prompts(1), 2, args.level_seconds))
            rows = []
            for c, n in zip(levels, counts, strict=True):
                rows.append(asyncio.run(level(base, c, prompts(n), args.max_tokens,
                                              args.level_seconds)))  # fmt: skip
                r = rows[-1]
                table.add_row(
                    dtype, str(c), str(r["requests"]), str(r["errors"]),
                    f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                    f"{r['ttft_p50']:.2f} s", f"{r['ttft_p99']:.2f} s",
                    f"{r['latency_p50']:.2f} s", f"{r['latency_p99']:.2f} s",
                )  # fmt: skip
                console.print(f"{dtype} concurrency {c}: {json.dumps(r)}")
        finally:
            proc.terminate()
            proc.wait(60)
        by_c = {r["concurrency"]: r for r in rows}
        base16 = batch_generate(path, args.kv_cache_memory, prompts(16), args.max_tokens)
        entry = {"kv_cache_dtype": dtype, "levels": rows, "batch_generate_16_tok_s": base16}
        if 16 in by_c:
            entry["server16_vs_generate"] = by_c[16]["output_tokens_per_s"] / base16
        if 16 in by_c and 1 in by_c:
            entry["c16_vs_c1"] = by_c[16]["output_tokens_per_s"] / by_c[1]["output_tokens_per_s"]
        summary.append(entry)
    console.print(table)
    for e in summary:
        console.print(
            f"{e['kv_cache_dtype']}: batch generate of the 16 prompts "
            f"{e['batch_generate_16_tok_s']:.1f} output tok/s; server at concurrency 16 / "
            "generate = "
            f"{e.get('server16_vs_generate', float('nan')):.2f}x; concurrency 16 / 1 = "
            f"{e.get('c16_vs_c1', float('nan')):.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
