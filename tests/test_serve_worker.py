"""The worker's request loop over a real pipe, around a scripted engine: tokens per step, cancel
at the next step boundary, stale cancels ignored, errors mapped to their codes (and the loop
keeps serving), engine events forwarded, shutdown mid-generation."""

import threading
from multiprocessing import Pipe

import pytest

from flashtree.errors import ConfigError, ContextLengthError, EngineOutOfMemory
from flashtree.serve.protocol import Cancel, Done, Error, Event, Generate, Heartbeat, Ping, Shutdown, Tokens
from flashtree.serve.worker import _Worker


class ScriptedStream:
    """Yields the script's steps; a callable step runs (e.g. waits, raises) instead of yielding."""

    def __init__(self, script):
        self.script = script
        self.cancelled = False
        self.result = None
        self.logprobs = None  # a GenerationStream's, for a request that asks for none
        self.traces = None  # and for one that asks for no trace

    def cancel(self):
        self.cancelled = True

    def __iter__(self):
        out, finish = [], "stop"
        for step in self.script:
            if self.cancelled:
                finish = "cancelled"
                break
            if callable(step):
                step()
                continue
            out += step
            yield step
        self.result = type("Result", (), {"finish_reason": finish, "stats": Stats(len(out))})()


class Stats:
    def __init__(self, n):
        self.n = n

    def to_dict(self):
        return {"completion_tokens": self.n, "prompt_tokens": 1, "cached_tokens": 0}


class ScriptedEngine:
    def __init__(self, sequences=1):
        self.listeners = []
        self.scripts = []
        self.sampling = None
        self.sequences = [None] * sequences  # how many generations the worker may run at once
        self.pages_free = True  # whether a prompt fits beside the running ones (Engine.can_admit)
        self.started = []

    def stream(self, prompt_ids, sampling, max_tokens, stop_token_ids, trace=False, grammar=None, request_id=""):
        self.sampling = sampling
        self.started.append(request_id)
        script = self.scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        return ScriptedStream(script)

    def cache_stats(self):
        return {}

    def can_admit(self, running, prompt_ids):
        return running < len(self.sequences) and (self.pages_free or not running)


@pytest.fixture
def worker():
    server_end, worker_end = Pipe()
    engine = ScriptedEngine()
    thread = threading.Thread(target=_Worker(worker_end, engine).serve, daemon=True)
    thread.start()
    yield server_end, engine, thread
    server_end.send(Shutdown())
    thread.join(5)


def recv(conn):
    assert conn.poll(10), "worker sent nothing"
    return conn.recv()


def serve_queued(server_end, worker_end, engine, replies: int) -> list:
    """Start a worker on what the pipe already holds (so that it sees every request before its
    first step) and collect its first `replies` messages."""
    thread = threading.Thread(target=_Worker(worker_end, engine).serve, daemon=True)
    thread.start()
    try:
        return [recv(server_end) for _ in range(replies)]
    finally:
        server_end.send(Shutdown())
        thread.join(5)


def generate(conn, req_id):
    conn.send(Generate(req_id, [1, 2, 3], {"temperature": 0.5, "seed": 3}, 16))


def test_tokens_per_step_then_done(worker):
    conn, engine, _ = worker
    engine.scripts.append([[5, 6], [7], [8, 9, 10]])
    generate(conn, "a")
    assert [recv(conn) for _ in range(4)] == [
        Tokens("a", [5, 6]), Tokens("a", [7]), Tokens("a", [8, 9, 10]),
        Done("a", "stop", {"completion_tokens": 6, "prompt_tokens": 1, "cached_tokens": 0})]
    assert engine.sampling.temperature == 0.5 and engine.sampling.seed == 3


def test_cancel_stops_at_the_next_step_and_stale_cancels_are_ignored(worker):
    conn, engine, _ = worker
    reached, gate = threading.Event(), threading.Event()
    engine.scripts += [[[1], lambda: reached.set() or gate.wait(10), [2], [3], [4]], [[9]]]
    generate(conn, "a")
    assert recv(conn) == Tokens("a", [1])
    assert reached.wait(10)  # the worker is past its look at the pipe after step 1
    conn.send(Cancel("a"))
    gate.set()
    assert recv(conn) == Tokens("a", [2])
    done = recv(conn)
    assert isinstance(done, Done) and done.req_id == "a" and done.finish_reason == "cancelled"
    conn.send(Cancel("a"))  # arrives after the fact: nothing to stop
    generate(conn, "b")
    assert recv(conn) == Tokens("b", [9])
    assert recv(conn).finish_reason == "stop"
    assert not conn.poll(0.2)


def test_cancel_that_arrives_with_the_request_skips_the_engine():
    server_end, worker_end = Pipe()
    engine = ScriptedEngine()
    generate(server_end, "a")
    server_end.send(Cancel("a"))
    server_end.send(Shutdown())
    _Worker(worker_end, engine).serve()  # returns at the Shutdown
    assert recv(server_end) == Done("a", "cancelled")
    assert engine.sampling is None, "the engine was never asked to generate"


def test_errors_become_error_messages_and_the_loop_goes_on(worker):
    conn, engine, _ = worker

    def oom():
        raise EngineOutOfMemory("verify")

    def bug():
        raise RuntimeError("boom")

    engine.scripts += [ContextLengthError(5000, 1024), ConfigError("top_p out of range"),
                       [[1], oom], [bug], [[7]]]
    for req_id in "abcd":
        generate(conn, req_id)
    assert recv(conn) == Error("a", "context_length_exceeded", str(ContextLengthError(5000, 1024)))
    assert recv(conn) == Error("b", "invalid_request_error", "top_p out of range")
    assert recv(conn) == Tokens("c", [1])
    assert recv(conn) == Error("c", "out_of_memory", "out of memory during verify")
    assert recv(conn) == Error("d", "engine_error", "RuntimeError: boom")
    generate(conn, "e")
    assert recv(conn) == Tokens("e", [7])


def test_generations_up_to_the_live_sequences_run_side_by_side_step_by_step():
    """Two live sequences: two generations advance a step each in turn, the third waits for a
    free sequence, and a cancel of a waiting one never reaches the engine."""
    server_end, worker_end = Pipe()
    engine = ScriptedEngine(sequences=2)
    engine.scripts += [[[1], [2], [3]], [[11], [], [12]], [[21]]]
    for req_id in "abcd":
        generate(server_end, req_id)
    server_end.send(Cancel("d"))
    got = serve_queued(server_end, worker_end, engine, 10)
    assert got[0] == Done("d", "cancelled")
    assert got[1:7] == [Tokens("a", [1]), Tokens("b", [11]), Tokens("a", [2]), Tokens("a", [3]),
                        Tokens("b", [12]), Done("a", "stop", {"completion_tokens": 3, "prompt_tokens": 1,
                                                              "cached_tokens": 0})], \
        "one step each in turn (an empty step, a prefill chunk, sends nothing)"
    assert got[7:] == [Done("b", "stop", {"completion_tokens": 2, "prompt_tokens": 1, "cached_tokens": 0}),
                       Tokens("c", [21]), Done("c", "stop", {"completion_tokens": 1, "prompt_tokens": 1,
                                                              "cached_tokens": 0})]
    assert engine.started == ["a", "b", "c"], "c started once a sequence was free; d never"


def test_a_request_the_engine_does_not_admit_waits_until_it_does():
    """A free sequence is not enough: a request whose prompt the KV pages cannot hold beside the
    running ones waits in the worker (Engine.can_admit) and starts once the engine admits it."""
    server_end, worker_end = Pipe()
    engine = ScriptedEngine(sequences=2)
    engine.pages_free = False
    engine.scripts += [[[1], [2], lambda: setattr(engine, "pages_free", True), [3]], [[11]]]
    generate(server_end, "a")
    generate(server_end, "b")
    got = serve_queued(server_end, worker_end, engine, 6)
    assert [type(m).__name__ + m.req_id for m in got][:4] == ["Tokensa", "Tokensa", "Tokensa", "Tokensb"], got
    assert engine.started == ["a", "b"]


def test_engine_events_are_forwarded(worker):
    conn, engine, _ = worker
    listener, = engine.listeners
    engine.scripts.append([[1], lambda: listener("cache_cleared", {"reason": "oom", "dropped": 2}), [2]])
    generate(conn, "a")
    assert recv(conn) == Tokens("a", [1])
    assert recv(conn) == Event("cache_cleared", {"reason": "oom", "dropped": 2})
    assert recv(conn) == Tokens("a", [2])


def test_prefill_chunks_and_pings_are_answered_with_heartbeats(worker):
    """What the server's watchdog hears between the tokens: a heartbeat per prefill chunk of the
    running request, and one for each ping while idle."""
    conn, engine, _ = worker
    conn.send(Ping())
    assert recv(conn) == Heartbeat()
    engine.scripts.append([lambda: engine.on_progress(), lambda: engine.on_progress(), [4]])
    generate(conn, "a")
    assert [recv(conn) for _ in range(3)] == [Heartbeat("a"), Heartbeat("a"), Tokens("a", [4])]
    assert recv(conn).finish_reason == "stop"
    conn.send(Ping())
    assert recv(conn) == Heartbeat()


def test_shutdown_mid_generation_cancels_and_exits(worker):
    conn, engine, thread = worker
    reached, gate = threading.Event(), threading.Event()
    engine.scripts.append([[1], lambda: reached.set() or gate.wait(10), [2], [3]])
    generate(conn, "a")
    assert recv(conn) == Tokens("a", [1])
    assert reached.wait(10)
    conn.send(Shutdown())
    gate.set()
    assert recv(conn) == Tokens("a", [2])
    assert recv(conn).finish_reason == "cancelled"
    thread.join(5)
    assert not thread.is_alive()
