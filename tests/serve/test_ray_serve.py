"""``tqexport serve --ray``: 2 Ray Serve replicas of the tiny artifact on a local Ray instance
bound to 127.0.0.1 (started and stopped by the CLI process the test runs), 16 concurrent
requests, one replica's process killed mid-load and brought back by Ray."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from helpers import main_inproc, with_byte_tokenizer

from tqexport.serve.app import REPLICA_HEADER
from tqexport.serve.runner import listen

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

MODEL = "tiny"
#: seconds any one request may take (a hung request fails the test, never blocks it)
REQUEST_TIMEOUT = 60.0
START_TIMEOUT = 150.0


def free_port() -> int:
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def complete(base: str, prompt: list[int], max_tokens: int = 16) -> httpx.Response | Exception:
    """One completion (greedy); a transport failure is returned, never raised."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    try:
        return httpx.post(base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    except httpx.HTTPError as e:
        return e


def concurrently(base: str, n: int, max_tokens: int = 16) -> list:
    """n completions at once, each bounded by REQUEST_TIMEOUT; returns them in order."""
    results: list = [None] * n

    def one(i):
        results[i] = complete(base, [5 + i, 9, 200, 3], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def replica_of(r: httpx.Response) -> tuple[str, int]:
    """(replica id, pid) from the response header."""
    rid, _, pid = r.headers[REPLICA_HEADER].partition(" pid=")
    return rid, int(pid)


def serving_replicas(base: str) -> set[tuple[str, int]]:
    """The replicas that answered 4 concurrent one-token requests."""
    rs = concurrently(base, 4, 1)
    return {replica_of(r) for r in rs if isinstance(r, httpx.Response) and r.status_code == 200}


def wait_serving(base: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        assert proc.poll() is None, f"the server exited: {proc.stdout.read()}"
        r = complete(base, [1, 2, 3], 1)
        if isinstance(r, httpx.Response) and r.status_code == 200:
            return
        assert time.monotonic() < deadline, "the Ray Serve deployment did not come up"
        time.sleep(1)


@pytest.fixture(scope="module")
def texty(artifacts, tmp_path_factory):
    tiny = artifacts("tiny-llama", "turboquant_4bit_nc")
    return with_byte_tokenizer(tiny, tmp_path_factory.mktemp("ray") / "art")


def test_two_replicas_share_load_and_survive_a_killed_replica(texty):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Ray's socket paths must stay under 108 bytes: a short temporary directory of its own
    ray_tmp = tempfile.mkdtemp(prefix="tqx-ray-", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": ray_tmp}
    cmd = [sys.executable, "-m", "tqexport.cli", "serve", str(texty), "--ray", "--replicas", "2",
           "--replica-cpus", "0", "--port", str(port), "--served-model-name", MODEL,
           "--num-blocks", "64", "--max-num-seqs", "4", "--threads", "1",
           "--grace-seconds", "5"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        start = time.monotonic()
        wait_serving(base, proc, start + START_TIMEOUT)
        up = time.monotonic() - start
        # Ray's proxy learns of each running replica by a long poll: until it knows both, it
        # routes everything to one. Bounded rounds of small requests until both have answered.
        while len(serving_replicas(base)) < 2:
            assert time.monotonic() < start + START_TIMEOUT, "one replica never served"
            time.sleep(1)

        # 16 concurrent requests: every one succeeds, both replicas serve some
        first = concurrently(base, 16)
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in first), first
        assert all(r.json()["usage"]["completion_tokens"] == 16 for r in first)
        replicas = {replica_of(r) for r in first}
        assert len(replicas) == 2, replicas

        # kill one replica's process while 16 longer requests are in flight
        victim_id, victim_pid = sorted(replicas)[0]
        results: list = []
        load = threading.Thread(target=lambda: results.extend(concurrently(base, 16, 48)))
        load.start()
        time.sleep(1.0)
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        load.join(REQUEST_TIMEOUT + 20)
        assert not load.is_alive() and len(results) == 16, "a request hung"
        for r in results:  # each one either succeeded or failed cleanly with a status
            assert isinstance(r, httpx.Response), r
            assert r.status_code == 200 or r.status_code >= 500, (r.status_code, r.text)
        assert any(r.status_code == 200 for r in results)

        # Ray brings a replacement up; later requests succeed on two live replicas again
        while True:
            later = concurrently(base, 8, 4)
            ok = [r for r in later if isinstance(r, httpx.Response) and r.status_code == 200]
            live = {replica_of(r) for r in ok}
            if len(ok) == 8 and len(live) == 2 and (victim_id, victim_pid) not in live:
                break
            # bounded; generous, since a loaded 2-core machine starts a replica slowly
            assert time.monotonic() < killed + 240, "the killed replica was not replaced"
            time.sleep(1)
        recovered = time.monotonic() - killed
        print(f"\nray serve: up in {up:.1f} s, 2 replicas, 16 + 16 requests, "
              f"{sum(r.status_code != 200 for r in results)} failed at the kill, "
              f"replaced in {recovered:.1f} s")  # fmt: skip

        # SIGTERM: the app is removed, Ray shut down, exit 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_an_unreachable_ray_address_is_one_line_not_a_retry_forever(artifacts, capsys,
                                                                     monkeypatch):  # fmt: skip
    """ray.init retries an address nothing listens at forever: it is probed first (only
    127.0.0.1 is ever contacted here)."""
    from tqexport.serve import ray_serve

    monkeypatch.setattr(ray_serve.socket, "create_connection", _loopback_only(
        ray_serve.socket.create_connection))  # fmt: skip
    art = artifacts("tiny-llama", "fp8")
    start = time.monotonic()
    code, out, err = main_inproc(capsys, "serve", art, "--ray", "--ray-address", "127.0.0.1:1")
    assert time.monotonic() - start < ray_serve.JOIN_TIMEOUT
    assert (code, out) == (2, "")
    assert err == (
        "error: cannot join the Ray cluster at 127.0.0.1:1: Connection refused; start one "
        "there (`ray start --head`) or give its address\n"
    )


def _loopback_only(connect):
    def guarded(address, *args, **kwargs):
        assert address[0] == "127.0.0.1", address
        return connect(address, *args, **kwargs)

    return guarded
