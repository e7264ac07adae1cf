"""``tqexport serve``: one engine behind uvicorn, stopped gracefully by SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path

import uvicorn

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.runtime.engine import Engine, EngineConfig

#: seconds in-flight requests may take to finish after SIGTERM before they are cancelled
GRACE_SECONDS = 30.0
#: hosts only this machine can reach
LOOPBACK = ("127.0.0.1", "localhost", "::1")
log = logging.getLogger("uvicorn.error")


class _Server(uvicorn.Server):
    """uvicorn's server on our own socket, saying where it serves once it accepts requests."""

    def __init__(self, config: uvicorn.Config, banner: str):
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("%s", self.banner)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or one error saying why not."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except (OSError, OverflowError) as e:
        if sock is not None:
            sock.close()
        why = getattr(e, "strerror", None) or str(e)
        raise TQExportError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(
    artifact: str | Path,
    config: EngineConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    grace_seconds: float = GRACE_SECONDS,
    log_level: str = "info",
    metrics_public: bool = False,
) -> None:
    """Serve ``artifact`` until SIGTERM/SIGINT: then stop accepting, let in-flight requests
    finish (at most ``grace_seconds``) and return (the process exits 0). ``metrics_public``
    leaves /metrics open when ``api_key`` guards the rest."""
    from tqexport.serve.app import create_app

    if not 0 <= port <= 65535:
        raise TQExportError(f"--port must be from 0 to 65535, got {port}")
    validate.api_key(api_key)
    sock = listen(host, port)  # before loading the model: a busy port fails at once
    try:
        engine = Engine.from_artifact(artifact, config)
        name = served_model_name or str(artifact)
        app = create_app(engine, name, api_key, metrics_public=metrics_public)
        bound = sock.getsockname()[1]
        where = f"[{host}]" if ":" in host else host
        banner = (
            f"serving {name!r} on http://{where}:{bound}/v1 (SIGTERM or CTRL+C stops it); "
            f"layers run on {engine.executor.kernels}"
        )
        uconfig = uvicorn.Config(
            app,
            host=host,
            port=bound,
            log_level=log_level,
            timeout_graceful_shutdown=grace_seconds,
            lifespan="on",
        )
        server = _Server(uconfig, banner)  # uvicorn's logging is set up from here on
        if engine.limit_note:
            log.warning("%s", engine.limit_note)
        if api_key is None and host not in LOOPBACK:
            log.warning("serving on %s without --api-key: anyone who reaches it can use it", host)
        # uvicorn re-raises the signal it stopped on after restoring the handlers it found:
        # no-op handlers here make that a plain return, so the process exits 0
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.signal(s, lambda *_: None) for s in handled}
        try:
            server.run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        sock.close()
