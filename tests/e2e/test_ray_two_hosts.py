"""Scale-out that survives a lost host: two hosts on this machine (network namespaces joined by a
veth pair, 10.201.0.1 and 10.201.0.2, nothing else reachable from them), a Ray head on one and a
worker on the other, and the README's multi-host recipe run on them: ``tqexport serve --ray
--replicas 2 --max-replicas-per-node 1``, one replica per host. During a bounded load every
process of the worker host is killed (the host is lost), then Ray is started there again."""

import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

#: network namespaces of this test are named PREFIX + "<pid>-head" / "<pid>-worker"
PREFIX = "tqxray-"
HEAD_IP, WORKER_IP = "10.201.0.1", "10.201.0.2"
RAY_PORT, HTTP_PORT = 6379, 8000
#: requests in flight per replica (the engine's batch, Ray Serve's max_ongoing_requests)
MAX_NUM_SEQS = 4
#: seconds any one request may take (a hung request fails the test, never blocks it)
REQUEST_TIMEOUT = 60.0
#: seconds for Ray and the deployment to come up (a loaded 2-core machine starts them slowly)
START_TIMEOUT = 240.0
CLIENT = str(Path(__file__).with_name("ray_host_client.py"))
RAY = str(Path(sys.executable).with_name("ray"))


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                          timeout=30).stdout  # fmt: skip


def host_pids(ns: str) -> list[int]:
    """Every process in the namespace (``ip netns pids``); none once it is deleted."""
    try:
        return [int(p) for p in ip("netns", "pids", ns).split()]
    except subprocess.CalledProcessError:
        return []


def kill_host(ns: str) -> None:
    """SIGKILL every process of the host, until none is left (bounded)."""
    for _ in range(100):
        pids = host_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes of {ns} survived SIGKILL: {host_pids(ns)}")


def remove_host(ns: str) -> None:
    kill_host(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def sweep_stale_hosts() -> None:
    """Removes the namespaces a crashed earlier run of this test left (its pid is gone)."""
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = int(name[len(PREFIX) :].split("-")[0])
        try:
            alive = pid != os.getpid() and (os.kill(pid, 0) or True)
        except ProcessLookupError:
            alive = False
        if not alive:
            remove_host(name)


def namespaces_or_skip() -> None:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_NET_ADMIN) to make network namespaces")


class Hosts:
    """The two hosts: namespaces ``head`` and ``worker`` with one veth link between them."""

    def __init__(self) -> None:
        self.head = f"{PREFIX}{os.getpid()}-head"
        self.worker = f"{PREFIX}{os.getpid()}-worker"
        self.inode = {}
        self.children: list[subprocess.Popen] = []

    def make(self) -> None:
        for ns in (self.head, self.worker):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            self.inode[ns] = os.stat(f"/run/netns/{ns}").st_ino
        link = f"tqx{os.getpid()}"
        ip("link", "add", link + "h", "netns", self.head, "type", "veth", "peer", "name",
           link + "w", "netns", self.worker)  # fmt: skip
        ends = ((self.head, link + "h", HEAD_IP), (self.worker, link + "w", WORKER_IP))
        for ns, dev, addr in ends:
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")

    def remove(self) -> None:
        for ns in (self.head, self.worker):
            remove_host(ns)
        for child in self.children:  # killed with their host: reaped here
            child.wait(30)
            if child.stdout is not None:
                child.stdout.close()

    def of(self, pid: int) -> str | None:
        """The host a process runs on: its network namespace."""
        try:
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except FileNotFoundError:
            return None
        return next((ns for ns, i in self.inode.items() if i == ino), None)

    def popen(self, ns: str, cmd: list[str], env: dict, stdout) -> subprocess.Popen:
        child = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=stdout,
                                 stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        self.children.append(child)
        return child

    def run(self, ns: str, cmd: list[str], env: dict, timeout: float) -> str:
        r = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                           env=env, timeout=timeout)  # fmt: skip
        assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
        return r.stdout


@pytest.fixture
def hosts():
    namespaces_or_skip()
    sweep_stale_hosts()
    h = Hosts()
    try:
        h.make()
    except subprocess.CalledProcessError as e:
        h.remove()
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    try:
        yield h
    finally:
        h.remove()


def pid_of(rec: dict) -> int:
    return int(rec["replica"].partition(" pid=")[2])


def test_a_lost_host_fails_only_its_replicas_requests_and_its_replica_returns_with_it(
    hosts, artifacts, tmp_path
):
    art = artifacts("tiny-llama", "turboquant_4bit_nc")
    key = secrets.token_hex(16)
    # Ray's socket paths must stay under 108 bytes: a short temporary directory of its own
    ray_tmp = tempfile.mkdtemp(prefix="tqx-ray-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # the recipe's token auth (one token for the cluster), and no usage reports
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")  # fmt: skip
    base = f"http://{HEAD_IP}:{HTTP_PORT}"
    address = f"{HEAD_IP}:{RAY_PORT}"
    # README: the multi-host recipe. Test-only: --num-cpus (2 a node: CPUs alone would let the
    # head take both replicas, so --max-replicas-per-node is what keeps one on each host),
    # --temp-dir, and the tiny engine sizes.
    head = [RAY, "start", "--head", "--node-ip-address", HEAD_IP, "--port", str(RAY_PORT),
            "--num-cpus", "2", "--temp-dir", ray_tmp]  # fmt: skip
    worker = [RAY, "start", "--address", address, "--num-cpus", "2"]
    serve = [sys.executable, "-m", "tqexport.cli", "serve", str(art), "--ray", "--ray-address",
             address, "--replicas", "2", "--max-replicas-per-node", "1", "--host", "0.0.0.0",
             "--port", str(HTTP_PORT), "--api-key", key,
             "--served-model-name", "tiny", "--num-blocks", "64",
             "--max-num-seqs", str(MAX_NUM_SEQS), "--threads", "1",
             "--grace-seconds", "5"]  # fmt: skip

    def load(n: int, concurrency: int, max_tokens: int) -> subprocess.Popen:
        cmd = [sys.executable, CLIENT, "load", base, key, str(n), str(concurrency),
               str(max_tokens), str(REQUEST_TIMEOUT)]  # fmt: skip
        return hosts.popen(hosts.head, cmd, env, subprocess.PIPE)

    def burst(n: int = 8) -> list[dict]:
        out = hosts.run(hosts.head, [sys.executable, CLIENT, "load", base, key, str(n), str(n),
                                     "1", str(REQUEST_TIMEOUT)], env,
                        timeout=REQUEST_TIMEOUT + 30)  # fmt: skip
        return [json.loads(line) for line in out.splitlines()]

    def serving_hosts(rs: list[dict]) -> dict[str, int]:
        """{host: replica pid} of the requests that succeeded."""
        return {hosts.of(pid_of(r)): pid_of(r) for r in rs if r["status"] == 200}

    def both_hosts_serve() -> dict[str, int] | None:
        """serving_hosts of a burst that all succeeded on both hosts, else None."""
        rs = burst()
        ok = all(r["status"] == 200 for r in rs)
        return serving_hosts(rs) if ok and len(serving_hosts(rs)) == 2 else None

    def replica_states() -> dict:
        out = hosts.run(hosts.head, [sys.executable, CLIENT, "status", address, "tqexport"], env,
                        timeout=120)  # fmt: skip
        # the client's one JSON line; Ray's own log lines (a raylet's warning) may follow it
        line = next((x for x in out.splitlines() if x.startswith("{")), "")
        return json.loads(line) if line else {}

    def until(what: str, check, deadline: float):
        while True:
            assert server.poll() is None, (server.returncode, server_log.read_text()[-3000:])
            got = check()
            if got:
                return got
            assert time.monotonic() < deadline, what
            time.sleep(1)

    try:
        hosts.run(hosts.head, head, env, timeout=START_TIMEOUT)
        hosts.run(hosts.worker, worker, env, timeout=START_TIMEOUT)
        server_log = tmp_path / "serve.log"
        with open(server_log, "w") as log:  # the child keeps its own copy
            server = hosts.popen(hosts.head, serve, env, log)
        start = time.monotonic()

        # one replica on each host; the head's proxy learns of both by a long poll
        before = until("the deployment did not serve from both hosts", both_hosts_serve,
                       start + START_TIMEOUT)  # fmt: skip
        assert before.keys() == {hosts.head, hosts.worker}
        up = time.monotonic() - start

        # the load: 64 requests of 32 to 63 tokens, 12 at a time (more than the 2 x MAX_NUM_SEQS
        # both replicas take, so both stay busy); once 12 have ended on both hosts, at the end
        # of one on the head (not one on the worker, whose replica may then be empty), the
        # worker host is lost: every one of its processes killed
        n, concurrency = 64, 12
        client = load(n, concurrency, 32)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in client.stdout], daemon=True)
        reader.start()
        results: list[dict] = []
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while (len(results) < concurrency or len(serving_hosts(results)) < 2
               or serving_hosts(results[-1:]).keys() != {hosts.head}):  # fmt: skip
            left = deadline - time.monotonic()
            assert left > 0 and client.poll() is None, f"no time to lose a host: {results}"
            try:
                results.append(json.loads(lines.get(timeout=min(left, 1.0))))
            except queue.Empty:
                pass
        kill_host(hosts.worker)
        killed = time.monotonic()
        # every request ends within its timeout: at most ceil(n / concurrency) rounds of them
        client.wait(-(-n // concurrency) * REQUEST_TIMEOUT)
        reader.join(30)
        while not lines.empty():
            results.append(json.loads(lines.get()))
        assert len(results) == n, f"{n - len(results)} requests never ended"
        host_of = {pid: host for host, pid in before.items()}
        timeline = "request, start and end (s from the loss), status, host:\n" + "\n".join(
            f"{r['i']} {r['start'] - killed:+.2f} {r['end'] - killed:+.2f} {r['status']} "
            f"{host_of.get(pid_of(r)) if r.get('replica') else '-'}"
            for r in sorted(results, key=lambda r: r["start"])
        )

        # no request hung: each one got an HTTP status (a transport error is a failure here)
        assert [r for r in results if r["status"] is None] == [], timeline
        failed = [r for r in results if r["status"] != 200]
        # failures are 5xx, at the loss, and no more than the lost replica had in flight
        assert all(500 <= r["status"] < 600 for r in failed), timeline
        assert len(failed) <= MAX_NUM_SEQS, timeline
        assert all(r["end"] > killed for r in failed), timeline
        # once the lost replica's requests have failed, every request succeeds on the survivor
        after = [r for r in results if r["start"] > max([killed] + [r["end"] for r in failed])]
        assert after, timeline
        assert all(r["status"] == 200 for r in after), timeline
        assert {hosts.of(pid_of(r)) for r in after} == {hosts.head}, timeline
        assert serving_hosts(after) == {hosts.head: before[hosts.head]}

        # the host returns: Serve places the missing replica there again, and both serve
        hosts.run(hosts.worker, worker, env, timeout=START_TIMEOUT)
        returned = time.monotonic()
        until("Serve did not report 2 running replicas again",
              lambda: replica_states() == {"RUNNING": 2}, returned + START_TIMEOUT)  # fmt: skip
        later = until("the returned host's replica did not serve", both_hosts_serve,
                      returned + START_TIMEOUT)  # fmt: skip
        assert later.keys() == {hosts.head, hosts.worker}
        assert later[hosts.head] == before[hosts.head]
        assert later[hosts.worker] != before[hosts.worker]
        restored = time.monotonic() - returned
        print(f"\nray two hosts: up in {up:.1f} s, {n} requests, {len(failed)} failed at the "
              f"loss of the worker host, {len(after)} after it all on the head, replica back "
              f"{restored:.1f} s after the host")  # fmt: skip

        # SIGTERM: the application is removed from the cluster, exit 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server_log.read_text()[-3000:]
    finally:
        hosts.remove()
        shutil.rmtree(ray_tmp, ignore_errors=True)
