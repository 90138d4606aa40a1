"""The engine process: load the engine once, then run one generation at a time from the pipe.

It is a separate process so that anything fatal inside the engine (a CUDA fault, an abort in a
kernel, the OOM killer) ends only this process; the supervisor notices, fails the request that
was running, and starts a new one. Between decode steps the worker looks for a Cancel of the
running request, so a cancel takes effect at the next step boundary. It proves it is not stuck
with a Heartbeat after every prefill chunk (decode steps send their tokens) and in answer to
the server's Ping, for the server's watchdog (supervisor.py).
"""

from __future__ import annotations

import os
import signal
import traceback
from collections import deque
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..errors import ConfigError, ContextLengthError, EngineOutOfMemory, FlashtreeError
from ..sampling_params import SamplingParams
from .logs import configure_logging
from .protocol import (Cancel, Done, Error, Event, Generate, Heartbeat, LoadFailed, Ping, Ready, Shutdown,
                       ToWorker, Tokens)


def _engine_info(engine: Any) -> dict[str, Any]:
    return {"model_id": engine.model_id, "model_path": str(engine.model_path),
            "max_ctx": engine.max_ctx, "config": asdict(engine.config), "mode": engine.mode,
            "block_size": engine.block_size, "has_draft": engine.draft is not None,
            "pid": os.getpid(), "cache": engine.cache_stats()}


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(exc, ConfigError):
        return "invalid_request_error"
    if isinstance(exc, EngineOutOfMemory):
        return "out_of_memory"
    return "engine_error"


class _Worker:
    """The request loop around one loaded engine."""

    def __init__(self, conn: Connection, engine: Any):
        self._conn = conn
        self._engine = engine
        self._backlog: deque[ToWorker] = deque()  # messages read while a generation ran
        self._running: Optional[str] = None  # req_id of the generation in progress
        # engine-wide happenings (e.g. a cache cleared after OOM) go to the server as Events
        engine.listeners.append(self._forward_event)
        engine.on_progress = lambda: self._conn.send(Heartbeat(self._running))

    def _forward_event(self, kind: str, data: dict[str, Any]) -> None:
        self._conn.send(Event(kind, dict(data), self._engine.cache_stats()))

    def serve(self) -> None:
        while True:
            msg = self._backlog.popleft() if self._backlog else self._conn.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Ping):
                self._conn.send(Heartbeat())
            elif isinstance(msg, Generate):
                self._running = msg.req_id
                self._generate(msg)
                self._running = None
            # a Cancel of a request that is not running has nothing left to stop

    def _drain(self, req_id: str) -> bool:
        """Read what arrived meanwhile; True when `req_id` is to be cancelled."""
        cancel = False
        while self._conn.poll():
            msg = self._conn.recv()
            if isinstance(msg, Cancel):
                cancel = cancel or msg.req_id == req_id
            else:
                cancel = cancel or isinstance(msg, Shutdown)
                self._backlog.append(msg)
        return cancel

    def _generate(self, msg: Generate) -> None:
        if self._drain(msg.req_id):
            self._conn.send(Done(msg.req_id, "cancelled"))
            return
        try:
            stream = self._engine.stream(msg.prompt_ids, sampling=SamplingParams(**msg.sampling),
                                         max_tokens=msg.max_tokens, stop_token_ids=msg.stop_ids,
                                         trace=msg.trace, grammar=msg.grammar)
            cancelled, sent, traced = False, 0, 0
            for ids in stream:
                if ids:
                    logprobs = stream.logprobs[sent:sent + len(ids)] if stream.logprobs is not None else None
                    sent += len(ids)
                    traces = None
                    if stream.traces is not None:  # the steps read since the last send: this one's
                        traces, traced = stream.traces[traced:], len(stream.traces)
                    self._conn.send(Tokens(msg.req_id, list(ids), logprobs, traces))
                if not cancelled and self._drain(msg.req_id):
                    stream.cancel()
                    cancelled = True
            result = stream.result
            self._conn.send(Done(msg.req_id, result.finish_reason, result.stats.to_dict(),
                                 self._engine.cache_stats()))
        except (BrokenPipeError, EOFError):
            raise
        except FlashtreeError as e:
            self._conn.send(Error(msg.req_id, _error_type(e), str(e)))
        except Exception as e:  # an engine bug must fail one request, not the worker
            traceback.print_exc()
            self._conn.send(Error(msg.req_id, "engine_error", f"{type(e).__name__}: {e}"))


def worker_main(conn: Connection, engine_config: dict[str, Any], log_level: str) -> None:
    """Process entry point (multiprocessing spawn target)."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group (or cgroup); the server
    # decides when the worker stops (Shutdown, or its pipe closing), so that it can finish the
    # request in flight instead of reporting a crash and restarting it mid-shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level)  # the engine's own lines (memory plan, OOM recovery) reach the log
    from .. import Engine  # only this process needs the models
    from ..config import EngineConfig

    try:
        engine = Engine.from_config(EngineConfig(**engine_config))
    except FlashtreeError as e:
        conn.send(LoadFailed(type(e).__name__, str(e)))
        return
    except Exception as e:
        traceback.print_exc()
        conn.send(LoadFailed(type(e).__name__, f"{type(e).__name__}: {e}"))
        return
    conn.send(Ready(_engine_info(engine)))
    try:
        _Worker(conn, engine).serve()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the server is gone; so is our reason to run
