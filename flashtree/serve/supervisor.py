"""The server's side of the worker pipe: spawn the engine process, queue requests, route messages,
cancel, and restart the worker when it dies or stops responding.

All state lives on the asyncio loop thread; a reader thread only blocks on the pipe and hands
each message to the loop. As many generations run at once as the engine has live sequences (its
Ready says how many; the worker advances them in turn); the rest wait in a bounded queue so an
overloaded server answers 429 at once instead of letting clients hang. Each message is routed by
`req_id` to a running request only; anything else is stale and dropped.

A worker can also hang without dying (a stuck kernel, a deadlock, `kill -STOP`): its pipe stays
open and nothing would ever end the request. So every message from a ready worker counts as a
heartbeat (it sends one per prefill chunk and tokens per decode step, and answers a ping when
idle), and one silent for longer than --worker-timeout is killed; its death then takes the same
path as a crash: 503 engine_restarting for the request, a restart with backoff.

A model that cannot be loaded ends the server (`on_fatal`; `flashtree serve` exits with 1 and
the error): at start-up at once, and after a restart once MAX_FAILED_RELOADS workers in a row
failed to load it (the first failures may be passing, e.g. GPU memory that the dead worker's
driver context has not given back yet). A worker that dies while serving is restarted however
often it dies: a request that crashes it must not be able to take the server down. Meanwhile
`status_message` says what the engine is doing and, while it restarts, after what.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Any, Callable, Optional, Union

from ..config import EngineConfig, ServerConfig
from ..errors import FlashtreeError
from .metrics import Metrics
from .protocol import (Cancel, Done, Error, Event, FromWorker, Generate, Heartbeat, LoadFailed, Ping,
                       Ready, Shutdown, Tokens, ToWorker)
from .worker import worker_main

log = logging.getLogger("flashtree.serve")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a worker that served this long resets the restart backoff
MAX_FAILED_RELOADS = 3  # workers in a row that fail to load the model again before the server gives up
WATCH_TICK_MAX_S = 1.0  # how often the watchdog looks, at most (a quarter of the timeout when shorter)


class QueueFull(FlashtreeError):
    """Every queue slot is taken; the client should retry later."""


class EngineUnavailable(FlashtreeError):
    """The engine cannot take or finish the request: `code` is model_loading, engine_restarting
    or engine_failed."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


class RequestFailed(FlashtreeError):
    """The worker reported an error for this request (`error_type` as in protocol.Error)."""

    def __init__(self, error_type: str, message: str, param: Optional[str] = None):
        self.error_type = error_type
        self.param = param
        super().__init__(message)


class RequestHandle:
    """One submitted generation: `await next()` yields Tokens then a final Done, or raises."""

    def __init__(self, supervisor: "Supervisor", msg: Generate):
        self.msg = msg
        self.req_id = msg.req_id
        self._supervisor = supervisor
        self._inbox: asyncio.Queue[Union[Tokens, Done, Exception]] = asyncio.Queue()
        self.finished = False
        self.cancel_requested = False

    async def next(self) -> Union[Tokens, Done]:
        item = await self._inbox.get()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        """Stop generating; the final Done (reason cancelled) still arrives through next()."""
        self._supervisor._cancel(self)

    def _deliver(self, item: Union[Tokens, Done, Exception]) -> None:
        if isinstance(item, (Done, Exception)):
            self.finished = True
        self._inbox.put_nowait(item)


class Supervisor:
    """Owns the worker process and the request queue. Use from one asyncio loop."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, metrics: Metrics,
                 on_fatal: Optional[Callable[[str], None]] = None):
        self._engine_config = asdict(engine_config)
        self._log_level = server_config.log_level
        self._max_queue = server_config.max_queue
        self._timeout_s = server_config.worker_timeout
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._ctx = mp.get_context("spawn")
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._proc: Any = None
        self._conn: Any = None
        self._generation = 0  # bumped per spawned worker: messages of a dead one are ignored
        self._queue: deque[RequestHandle] = deque()
        self._running: dict[str, RequestHandle] = {}  # sent to the worker, not finished
        self._backoff = BACKOFF_START_S
        self._ready_at: Optional[float] = None  # when the current worker became ready (None: not yet)
        self._load_error: Optional[str] = None  # why the current worker could not load the model
        self._failed_reloads = 0  # workers in a row that did not load the model after a restart
        self._restart_reason = ""  # after what the engine is restarting
        self._restart_timer: Optional[asyncio.TimerHandle] = None
        self._watch_timer: Optional[asyncio.TimerHandle] = None
        self._heard_at = 0.0  # when the ready worker last sent anything, or was sent a request
        self._watched_at = time.monotonic()  # the watchdog's last tick
        self.state = "loading"  # loading | ready | restarting | failed | stopped
        self.info: dict[str, Any] = {}
        self.first_ready = asyncio.Event()
        self.fatal_error: Optional[str] = None
        self.started_at = time.time()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._watch()

    async def stop(self) -> None:
        """Ask the worker to exit, then make sure it has."""
        self.state = "stopped"
        for timer in (self._restart_timer, self._watch_timer):
            if timer is not None:
                timer.cancel()
        self._fail_all(EngineUnavailable("engine_failed", "the server is shutting down"))
        proc = self._proc
        if proc is None:
            return
        self._send(Shutdown())
        await asyncio.to_thread(proc.join, 5.0)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5.0)
        log.info("engine worker stopped (exit code %s)", proc.exitcode)

    def kill_worker(self) -> None:
        """Kill the worker if it is still alive: for a server that ended without its lifespan's
        shutdown (a forced exit), since the worker ignores SIGTERM and multiprocessing's exit
        handler would wait for it."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)

    @property
    def status_message(self) -> str:
        """What the engine is doing, for /health: loading, restarting and after what, or the
        error it gave up on."""
        if self.state in ("failed", "stopped"):
            return self.fatal_error or "the engine is not running"
        if self.state == "restarting":
            return f"the engine worker is restarting: {self._restart_reason}; retry shortly"
        return "the model is loading" if self.state == "loading" else "ready"

    @property
    def worker_pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self.state == "ready" else None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def _spawn(self) -> None:
        self._restart_timer = None
        if self.state in ("stopped", "failed"):
            return
        self._generation += 1
        self._ready_at = self._load_error = None
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=worker_main, args=(child, self._engine_config, self._log_level),
                                 name="flashtree-worker", daemon=True)
        proc.start()
        child.close()  # the worker holds the only other end: its death reads as EOF here
        self._proc, self._conn = proc, parent
        threading.Thread(target=self._read, args=(parent, proc, self._generation),
                         name="flashtree-pipe-reader", daemon=True).start()

    def _read(self, conn: Any, proc: Any, generation: int) -> None:
        """Reader thread: hand every message to the loop, then report the end of the worker
        (with its exit code: the pipe closes a moment before the process is reaped)."""
        assert self._loop is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._on_message, generation, msg)
            except RuntimeError:  # loop closed: the server is gone
                return
        proc.join(5.0)
        try:
            self._loop.call_soon_threadsafe(self._on_worker_exit, generation, proc.exitcode)
        except RuntimeError:
            pass

    def _send(self, msg: ToWorker) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError):  # the worker died; the reader thread reports it
            pass

    # --- requests ----------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], sampling: dict[str, Any], max_tokens: int,
               stop_ids: Optional[list[int]] = None, grammar: Optional[str] = None,
               trace: bool = False) -> RequestHandle:
        """Queue one generation (`stop_ids` None: the model's EOS tokens; `trace`: its Tokens
        carry each step's tree). Raises QueueFull, or EngineUnavailable when it can never run."""
        if self.state in ("failed", "stopped"):
            raise EngineUnavailable("engine_failed", self.fatal_error or "the engine is not running")
        if len(self._queue) >= self._max_queue:
            raise QueueFull(f"all {self._max_queue} queue slots are taken; retry shortly")
        handle = RequestHandle(self, Generate("req-" + uuid.uuid4().hex, list(prompt_ids),
                                              sampling, max_tokens, stop_ids, grammar, trace))
        self._queue.append(handle)
        self._metrics.queue_depth.set(len(self._queue))
        self._dispatch()
        return handle

    @property
    def capacity(self) -> int:
        """How many generations the worker runs at once: its engine's live sequences."""
        return int(self.info.get("max_sequences", 1))

    @property
    def running(self) -> list[str]:
        """The request ids the worker is running now."""
        return list(self._running)

    def _dispatch(self) -> None:
        while self.state == "ready" and self._queue and len(self._running) < self.capacity:
            handle = self._queue.popleft()
            self._metrics.queue_depth.set(len(self._queue))
            self._running[handle.req_id] = handle
            self._metrics.running.set(len(self._running))
            if len(self._running) == 1:  # the request's first heartbeat is due a timeout from now
                self._heard_at = time.monotonic()
            self._send(handle.msg)

    def _cancel(self, handle: RequestHandle) -> None:
        if handle.finished or handle.cancel_requested:
            return
        handle.cancel_requested = True
        if handle in self._queue:
            self._queue.remove(handle)
            self._metrics.queue_depth.set(len(self._queue))
            self._metrics.generations.labels(finish_reason="cancelled").inc()
            handle._deliver(Done(handle.req_id, "cancelled"))
        elif handle.req_id in self._running:
            self._send(Cancel(handle.req_id))

    def _finish(self, req_id: str, item: Union[Done, Exception]) -> None:
        handle = self._running.pop(req_id, None)
        self._metrics.running.set(len(self._running))
        if handle is not None:
            handle._deliver(item)
        self._dispatch()

    def _finish_running(self, exc: Exception) -> None:
        """Fail every running request with `exc` (its worker is gone)."""
        running, self._running = self._running, {}
        self._metrics.running.set(0)
        for handle in running.values():
            handle._deliver(exc)

    def _fail_all(self, exc: Exception) -> None:
        self._finish_running(exc)
        while self._queue:
            self._queue.popleft()._deliver(exc)
        self._metrics.queue_depth.set(0)

    # --- messages from the worker ------------------------------------------------------------

    def _on_message(self, generation: int, msg: FromWorker) -> None:
        if generation != self._generation:
            return
        self._heard_at = time.monotonic()
        if isinstance(msg, Heartbeat):
            return  # being heard was all it was for
        if isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, LoadFailed):
            if not self.first_ready.is_set():
                self.fail(f"cannot load the model: {msg.message}")
            else:  # it loaded before: retry (with backoff) when this worker exits
                self._load_error = msg.message
                log.error("engine worker could not reload the model: %s", msg.message)
        elif isinstance(msg, Event):
            self._metrics.observe_event(msg.kind, msg.data, msg.cache)
            log.warning("engine event %s %s", msg.kind, msg.data)
        elif msg.req_id not in self._running:
            return  # stale: its request is finished or was never ours
        elif isinstance(msg, Tokens):
            self._running[msg.req_id]._deliver(msg)
        elif isinstance(msg, Done):
            self._metrics.generations.labels(finish_reason=msg.finish_reason).inc()
            self._metrics.observe_generation(msg.stats)
            self._metrics.observe_cache(msg.cache)
            self._finish(msg.req_id, msg)
        elif isinstance(msg, Error):
            self._finish(msg.req_id, RequestFailed(msg.error_type, msg.message, msg.param))

    def _on_ready(self, msg: Ready) -> None:
        self.info = msg.info
        self._metrics.observe_cache(msg.info.get("cache", {}))
        self.state = "ready"
        self._ready_at = self._heard_at = time.monotonic()
        self._failed_reloads = 0
        self.first_ready.set()
        log.info("engine ready: %s (max_ctx %s, pid %s)", msg.info.get("model_id"),
                 msg.info.get("max_ctx"), msg.info.get("pid"))
        self._dispatch()

    def fail(self, message: str) -> None:
        """Give up for good: fail every request and tell the server to exit."""
        self.fatal_error = message
        self.state = "failed"
        log.error("%s", message)
        self._fail_all(EngineUnavailable("engine_failed", message))
        if self._on_fatal is not None:
            self._on_fatal(message)

    def _on_worker_exit(self, generation: int, code: Optional[int]) -> None:
        if generation != self._generation or self.state in ("stopped", "failed"):
            return
        self._conn.close()
        if not self.first_ready.is_set():
            self.fail(f"the engine worker exited while loading the model (exit code {code})")
            return
        if self._ready_at is None:  # this worker was restarted and did not load the model again
            self._failed_reloads += 1
            error = self._load_error or f"the worker exited while loading it (exit code {code})"
            if self._failed_reloads >= MAX_FAILED_RELOADS:
                self.fail(f"cannot load the model again after the engine worker restarted "
                          f"({self._failed_reloads} attempts in a row): {error}")
                return
            self._restart_reason = (f"its reload of the model failed ({self._failed_reloads} of "
                                    f"{MAX_FAILED_RELOADS} attempts): {error}")
        else:
            if self.state != "restarting":  # else the watchdog killed it, and has said why
                self._restart_reason = f"it died (exit code {code})"
            if time.monotonic() - self._ready_at > STABLE_AFTER_S:
                self._backoff = BACKOFF_START_S
        self.state = "restarting"
        self._metrics.worker_restarts.inc()
        log.error("engine worker ended: %s; restarting in %.1fs", self._restart_reason, self._backoff)
        self._finish_running(EngineUnavailable(
            "engine_restarting", "the engine worker died during this request; it is restarting, retry shortly"))
        assert self._loop is not None
        self._restart_timer = self._loop.call_later(self._backoff, self._spawn)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    # --- watchdog ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Runs every tick: kill a ready worker silent past the timeout, and ping an idle one
        (which sends nothing of its own) once it has been quiet for half of it."""
        assert self._loop is not None
        self._watch_timer = self._loop.call_later(min(WATCH_TICK_MAX_S, self._timeout_s / 4), self._watch)
        now = time.monotonic()
        if now - self._watched_at > self._timeout_s / 2:  # this loop was stalled and could not ping:
            self._heard_at = max(self._heard_at, now - self._timeout_s / 2)  # the worker gets its chance
        self._watched_at = now
        if self.state != "ready":
            return  # loading (a download, a graph capture) has no heartbeat to wait for
        silent = now - self._heard_at
        if silent > self._timeout_s:
            self._kill_silent(silent)
        elif not self._running and silent > self._timeout_s / 2:
            self._send(Ping())

    def _kill_silent(self, silent: float) -> None:
        log.error("engine worker (pid %s) silent for %.1fs, longer than --worker-timeout %gs: killing it",
                  self._proc.pid, silent, self._timeout_s)
        self.state = "restarting"  # /health says so from now; the exit then restarts it
        self._restart_reason = f"it stopped responding (nothing for {silent:.0f}s) and was killed"
        self._proc.kill()
        self._finish_running(EngineUnavailable(
            "engine_restarting", f"the engine worker stopped responding during this request (nothing "
                                 f"for {silent:.0f}s); it is restarting, retry shortly"))
