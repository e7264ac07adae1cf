"""Client that tests/e2e/test_ray_two_hosts.py runs inside a host's network namespace.

``load BASE KEY N CONCURRENCY MAX_TOKENS TIMEOUT``: N greedy completions of model "tiny",
CONCURRENCY at a time, request i asking for MAX_TOKENS + i * 7 % MAX_TOKENS tokens (staggered:
a replica's requests do not all end at once); one JSON line per request as it ends (its
monotonic start and end, HTTP status or transport error, and the replica header).
``status ADDRESS APP``: one JSON line, the replica states Ray Serve reports for the
application's deployment (no line if it is not deployed yet).
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def load(base: str, key: str, n: int, concurrency: int, max_tokens: int, timeout: float) -> None:
    import httpx

    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {key}"}

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": [5 + i % 64, 9, 200, 3],
                "max_tokens": max_tokens + i * 7 % max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        start = time.monotonic()
        rec: dict = {"i": i, "start": start}
        try:
            r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=timeout)
            rec.update(status=r.status_code, replica=r.headers.get("x-tqexport-replica"))
        except httpx.HTTPError as e:
            rec.update(status=None, error=f"{type(e).__name__}: {e}")
        rec["end"] = time.monotonic()
        with lock:
            print(json.dumps(rec), flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))


def status(address: str, app: str) -> None:
    import logging

    import ray
    from ray import serve

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    deployment = serve.status().applications.get(app)
    if deployment is not None and app in deployment.deployments:
        states = deployment.deployments[app].replica_states
        print(json.dumps({str(getattr(k, "value", k)): v for k, v in states.items()}))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "load":
        base, key, n, concurrency, max_tokens, timeout = args
        load(base, key, int(n), int(concurrency), int(max_tokens), float(timeout))
    else:
        status(*args)
