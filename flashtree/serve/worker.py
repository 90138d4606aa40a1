"""The engine process: load the engine once, then run generations from the pipe, several at once.

It is a separate process so that anything fatal inside the engine (a CUDA fault, an abort in a
kernel, the OOM killer) ends only this process; the supervisor notices, fails the requests that
were running, and starts a new one.

Up to the engine's live sequences' count of generations run side by side: the loop advances each
by one prefill chunk or one decode step in turn (the engine's streams yield at those
boundaries), so a long prefill delays the others by a chunk a turn, not by the whole prompt.
Between turns the worker reads the pipe: a new Generate starts at once if a sequence is free
(the supervisor sends no more than that), a Cancel takes effect at its generation's next
boundary. It proves it is not stuck with a Heartbeat after every prefill chunk (decode steps
send their tokens) and in answer to the server's Ping, for the server's watchdog (supervisor.py).
"""

from __future__ import annotations

import os
import signal
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Iterator, Optional

from ..errors import (ConfigError, ContextLengthError, EngineOutOfMemory, FlashtreeError, GrammarError,
                      NonFiniteLogits)
from ..sampling_params import SamplingParams
from .logs import configure_logging
from .protocol import (Cancel, Done, Error, Event, Generate, Heartbeat, LoadFailed, Ping, Ready, Shutdown,
                       ToWorker, Tokens)


def _engine_info(engine: Any) -> dict[str, Any]:
    return {"model_id": engine.model_id, "model_path": str(engine.model_path),
            "max_ctx": engine.max_ctx, "config": asdict(engine.config), "mode": engine.mode,
            "block_size": engine.block_size, "has_draft": engine.draft is not None,
            "max_sequences": len(engine.sequences),
            "pid": os.getpid(), "cache": engine.cache_stats()}


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, ContextLengthError):
        return "context_length_exceeded"
    if isinstance(exc, GrammarError):
        return "invalid_grammar"
    if isinstance(exc, ConfigError):
        return "invalid_request_error"
    if isinstance(exc, EngineOutOfMemory):
        return "out_of_memory"
    if isinstance(exc, NonFiniteLogits):
        return "non_finite_logits"
    return "engine_error"


@dataclass
class _Running:
    """One generation in progress: its stream and what has been sent of it."""
    msg: Generate
    stream: Any
    steps: Iterator[list[int]]
    sent: int = 0
    traced: int = 0
    cancelled: bool = False


class _Worker:
    """The request loop around one loaded engine."""

    def __init__(self, conn: Connection, engine: Any):
        self._conn = conn
        self._engine = engine
        self._waiting: deque[Generate] = deque()  # Generates read while the engine admitted none (can_admit)
        self._running: dict[str, _Running] = {}
        self._stop = False
        # engine-wide happenings (e.g. a cache cleared after OOM) go to the server as Events
        engine.listeners.append(self._forward_event)
        self._advancing: Optional[str] = None  # the generation being advanced (its heartbeats' id)
        engine.on_progress = lambda: self._conn.send(Heartbeat(self._advancing))

    def _forward_event(self, kind: str, data: dict[str, Any]) -> None:
        self._conn.send(Event(kind, dict(data), self._engine.cache_stats()))

    def serve(self) -> None:
        while not self._stop or self._running:
            if not self._running and not self._waiting:
                if self._stop:
                    return
                self._receive(self._conn.recv())
            while self._conn.poll():
                self._receive(self._conn.recv())
            while (self._waiting and not self._stop
                   and self._engine.can_admit(len(self._running), self._waiting[0].prompt_ids)):
                self._start(self._waiting.popleft())
            for run in list(self._running.values()):
                self._advance(run)

    def _receive(self, msg: ToWorker) -> None:
        if isinstance(msg, Shutdown):
            self._stop = True  # the running generations are cancelled and finish
            for run in self._running.values():
                self._cancel(run)
        elif isinstance(msg, Ping):
            self._conn.send(Heartbeat())
        elif isinstance(msg, Generate):
            self._waiting.append(msg)
        elif isinstance(msg, Cancel):
            if msg.req_id in self._running:
                self._cancel(self._running[msg.req_id])
            elif any(g.req_id == msg.req_id for g in self._waiting):
                self._waiting = deque(g for g in self._waiting if g.req_id != msg.req_id)
                self._conn.send(Done(msg.req_id, "cancelled"))
            # a Cancel of a request that is not here has nothing left to stop

    @staticmethod
    def _cancel(run: _Running) -> None:
        if not run.cancelled:
            run.stream.cancel()
            run.cancelled = True

    def _start(self, msg: Generate) -> None:
        try:
            stream = self._engine.stream(msg.prompt_ids, sampling=SamplingParams(**msg.sampling),
                                         max_tokens=msg.max_tokens, stop_token_ids=msg.stop_ids,
                                         trace=msg.trace, grammar=msg.grammar, request_id=msg.req_id)
        except Exception as e:  # noqa: BLE001 (validation: before any work)
            self._fail(msg.req_id, e)
            return
        run = self._running[msg.req_id] = _Running(msg, stream, iter(stream))
        self._advance(run)  # it takes its sequence, and the next admission counts its prompt

    def _advance(self, run: _Running) -> None:
        """One turn of a generation: a prefill chunk or a decode step, and its tokens sent."""
        req_id = self._advancing = run.msg.req_id
        try:
            ids = next(run.steps, None)
            if ids is None:
                del self._running[req_id]
                result = run.stream.result
                self._conn.send(Done(req_id, result.finish_reason, result.stats.to_dict(),
                                     self._engine.cache_stats()))
                return
        except (BrokenPipeError, EOFError):
            raise
        except Exception as e:  # noqa: BLE001 (the engine's errors fail one request, not the worker)
            del self._running[req_id]
            self._fail(req_id, e)
            return
        if ids:
            stream = run.stream
            logprobs = stream.logprobs[run.sent:run.sent + len(ids)] if stream.logprobs is not None else None
            run.sent += len(ids)
            traces = None
            if stream.traces is not None:  # the steps read since the last send: this one's
                traces, run.traced = stream.traces[run.traced:], len(stream.traces)
            self._conn.send(Tokens(req_id, list(ids), logprobs, traces))

    def _fail(self, req_id: str, e: BaseException) -> None:
        if isinstance(e, FlashtreeError):
            self._conn.send(Error(req_id, _error_type(e), str(e), getattr(e, "param", None)))
            return
        traceback.print_exception(e)  # an engine bug
        self._conn.send(Error(req_id, "engine_error", f"{type(e).__name__}: {e}"))


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
