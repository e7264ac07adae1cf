"""The one engine loop behind every HTTP request: continuous batching across connections.

A single thread owns the :class:`~tqexport.runtime.engine.Engine` and only steps it: prompts
are tokenized and chat templates rendered on worker threads (:meth:`EngineLoop.prepare`), and
the prepared token ids and aborts reach the engine thread through a queue and join the running
batch between two steps; each step's outputs go back to their request's asyncio queue. The
backend's run releases the GIL, so the event loop keeps serving connections while a step runs.
A request that fails while it runs ends alone (its output's finish_reason is "error").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tqexport.errors import TQExportError
from tqexport.runtime.engine import Engine, RequestOutput

log = logging.getLogger("tqexport.serve")

#: ``build(engine) -> (request id, prompt token ids)``, run on the engine thread
Build = Callable[[Engine], tuple[str, list[int]]]
#: worker threads that tokenize prompts and render chat templates
PREPARE_WORKERS = 4
#: prompts of more characters than this are prepared by their own worker (one), so a few
#: megabyte-sized prompts never delay the short ones behind them
LARGE_PROMPT_CHARS = 64 * 1024


class EngineFailed(Exception):
    """The engine itself raised during a step (not one request); every request in flight then
    ends with this error."""


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | Exception], None]] = {}
        self._thread = threading.Thread(target=self._run, name="tqexport-engine", daemon=True)
        self._workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="tqexport-prepare")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="tqexport-prepare-large")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop: requests still in flight are aborted."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, work: Callable[[], list[int]], chars: int = 0) -> list[int]:
        """Run ``work`` (tokenizing, a chat template) on a worker thread, never the engine's;
        work on more than :data:`LARGE_PROMPT_CHARS` characters queues on the large prompts'
        own worker, never before a short prompt."""
        workers = self._large if chars > LARGE_PROMPT_CHARS else self._workers
        return await asyncio.get_running_loop().run_in_executor(workers, work)

    async def submit(self, build: Build) -> tuple[str, list[int], asyncio.Queue]:
        """Admit a request on the engine thread; returns its id, prompt ids and output queue.
        Raises what ``build`` raised (TQExportError: the request can never run)."""
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future = loop.create_future()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(item):
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        def settle(result):
            if admitted.cancelled():  # the client left while it was admitted
                if not isinstance(result, BaseException):
                    self.abort(result[0])
            elif isinstance(result, BaseException):
                admitted.set_exception(result)
            else:
                admitted.set_result(result)

        def done(result):
            loop.call_soon_threadsafe(settle, result)

        self._commands.put(("add", build, sink, done))
        rid, prompt = await admitted
        return rid, prompt, outputs

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            try:
                cmd = self._commands.get(block=not busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._fail_all(EngineFailed("the server is shutting down"))
                    return
                self._command(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                self._step()

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._sinks.pop(cmd[1], None)
            return
        _, build, sink, done = cmd
        try:
            rid, prompt = build(self.engine)
        except TQExportError as e:
            done(e)
            return
        except Exception as e:  # one bad request never stops the loop
            log.exception("admitting a request failed")
            done(e)
            return
        self._sinks[rid] = sink
        done((rid, prompt))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(EngineFailed(f"the engine failed: {e}"))
            return
        for out in outputs:
            if out.error is not None:
                log.error("request %s failed", out.request_id, exc_info=out.error)
            sinks = self._sinks
            sink = sinks.pop(out.request_id, None) if out.finished else sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def _fail_all(self, error: Exception) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink(error)
        self._sinks.clear()
