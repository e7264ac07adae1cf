"""Scale-out on Ray Serve: the app of ``tqexport serve`` as a Ray Serve deployment, one engine
and its caches per replica, behind Ray Serve's HTTP proxy.

Ray does the distributed part: it places replicas on the cluster's nodes, routes each request
to a replica with room (at most ``max_num_seqs`` in flight per replica, the engine's batch),
and replaces a replica whose process dies. Every replica loads the artifact from the same path,
so on several machines it must lie on shared storage or be copied to that path on each node.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path

from tqexport.errors import TQExportError
from tqexport.runtime.engine_config import EngineConfig

#: the Ray Serve application (and deployment) name
APP_NAME = "tqexport"
#: seconds ``--ray-address`` has to accept a connection (``ray.init`` itself retries forever)
JOIN_TIMEOUT = 10.0
log = logging.getLogger("tqexport.serve")


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise TQExportError(
            "--ray needs Ray Serve, which is not installed: pip install 'ray[serve]'"
        ) from None
    return ray, serve


def application(
    artifact: str | Path,
    config: EngineConfig,
    served_model_name: str,
    api_key: str | None,
    replicas: int,
    replica_cpus: float,
    grace_seconds: float,
    metrics_public: bool = False,
    max_replicas_per_node: int | None = None,
):
    """The bound Ray Serve application: ``replicas`` copies of the app, each building its own
    engine from ``artifact`` when Ray starts it (a replacement replica does the same), at most
    ``max_replicas_per_node`` on one node (None: no limit)."""
    _, serve = _ray()
    path = str(Path(artifact).resolve())

    def build_app():
        from tqexport.runtime.engine import Engine
        from tqexport.serve.app import create_app

        replica = f"{serve.get_replica_context().replica_id.unique_id} pid={os.getpid()}"
        engine = Engine.from_artifact(path, config)
        return create_app(
            engine, served_model_name, api_key, replica=replica, metrics_public=metrics_public
        )

    deployment = serve.deployment(
        serve.ingress(build_app)(),
        name=APP_NAME,
        num_replicas=replicas,
        max_ongoing_requests=config.max_num_seqs,
        graceful_shutdown_timeout_s=grace_seconds,
        ray_actor_options={"num_cpus": replica_cpus},
        max_replicas_per_node=max_replicas_per_node,
    )
    return deployment.bind()


def check_reachable(address: str) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) cluster address must accept a TCP connection
    within :data:`JOIN_TIMEOUT` seconds, else one line; other forms (``auto``) are Ray's."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return
    host = host.removeprefix("[").removesuffix("]")
    try:
        socket.create_connection((host, int(port)), timeout=JOIN_TIMEOUT).close()
    except OSError as e:
        timed_out = isinstance(e, TimeoutError)
        why = f"no answer within {JOIN_TIMEOUT:g} s" if timed_out else (e.strerror or str(e))
        raise TQExportError(
            f"cannot join the Ray cluster at {address}: {why}; start one there (`ray start "
            "--head`) or give its address"
        ) from None


def _free_port(host: str) -> int:
    from tqexport.serve.runner import listen

    sock = listen(host, 0)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def serve_on_ray(
    artifact: str | Path,
    config: EngineConfig,
    host: str,
    port: int,
    served_model_name: str,
    api_key: str | None,
    replicas: int,
    address: str | None,
    replica_cpus: float,
    grace_seconds: float,
    metrics_public: bool = False,
    max_replicas_per_node: int | None = None,
) -> None:
    """Serve ``artifact`` on Ray Serve until SIGTERM/SIGINT. Without ``address`` a local Ray
    instance is started on 127.0.0.1 and shut down at the end; with one, the cluster is
    joined and only this application is removed at the end (in-flight requests get
    ``grace_seconds``)."""
    ray, serve = _ray()
    from ray.serve.config import HTTPOptions

    if address is not None:
        check_reachable(address)

    if port == 0:
        port = _free_port(host)
    stop = threading.Event()
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in handled}
    try:
        if address is None:
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1",
                     logging_level=logging.WARNING)  # fmt: skip
        else:
            try:
                ray.init(address=address, logging_level=logging.WARNING)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise TQExportError(f"cannot join the Ray cluster at {address}: {e}") from None
        for s in handled:  # Ray's core worker installs handlers of its own that abort
            signal.signal(s, lambda *_: stop.set())
        try:
            serve.start(http_options=HTTPOptions(host=host, port=port))
            app = application(
                artifact, config, served_model_name, api_key, replicas, replica_cpus,
                grace_seconds, metrics_public, max_replicas_per_node,
            )  # fmt: skip
            try:
                serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            except Exception as e:  # Ray reports a replica that cannot start as its own error
                first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise TQExportError(f"the Ray Serve deployment failed: {first}") from None
            where = f"[{host}]" if ":" in host else host
            print(
                f"serving {served_model_name!r} on http://{where}:{port}/v1 with {replicas} "
                "Ray Serve replica(s) (SIGTERM or CTRL+C stops it)",
                flush=True,
            )
            while not stop.wait(0.5):
                pass
            print("stopping: in-flight requests may finish", flush=True)
            serve.delete(APP_NAME)
        finally:
            if address is None:
                serve.shutdown()
            ray.shutdown()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
