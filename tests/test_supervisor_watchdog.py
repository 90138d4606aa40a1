"""The watchdog's decisions, one tick at a time, on a supervisor with a stand-in worker process:
when it pings, when it kills, and that a stall of the server's own loop is not blamed on the
worker. (tests/test_serve_watchdog.py runs the real thing against a stopped worker.)"""

import asyncio
import time

import pytest

from flashtree.config import EngineConfig, ServerConfig
from flashtree.serve.metrics import Metrics
from flashtree.serve.protocol import Generate, Ping
from flashtree.serve.supervisor import EngineUnavailable, RequestHandle, Supervisor

TIMEOUT_S = 4.0


class FakeProcess:
    pid = 4242

    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


@pytest.fixture
def supervisor():
    loop = asyncio.new_event_loop()
    sup = Supervisor(EngineConfig(), ServerConfig(worker_timeout=TIMEOUT_S), Metrics())
    sup._loop, sup._proc, sup.state = loop, FakeProcess(), "ready"
    sup._heard_at = time.monotonic()
    sup.sent = []
    sup._send = sup.sent.append
    yield sup
    loop.close()


def elapse(sup, seconds, stalled=False):
    """`seconds` more without a word from the worker, then a watchdog tick (the previous tick a
    moment ago, or, `stalled`, as long ago as the silence: the loop was blocked meanwhile)."""
    sup._heard_at -= seconds
    sup._watched_at = time.monotonic() - (seconds if stalled else 0.1)
    sup._watch()
    sup._watch_timer.cancel()


def test_an_idle_worker_is_pinged_after_half_the_timeout(supervisor):
    elapse(supervisor, TIMEOUT_S / 4)
    assert supervisor.sent == []
    elapse(supervisor, TIMEOUT_S / 3)
    assert supervisor.sent == [Ping()] and not supervisor._proc.killed


def test_a_silent_worker_is_killed_and_its_request_gets_503(supervisor):
    handle = RequestHandle(supervisor, Generate("r", [1], {}, 4))
    supervisor._running[handle.req_id] = handle
    elapse(supervisor, TIMEOUT_S * 0.9)
    assert supervisor.sent == [] and not supervisor._proc.killed, "a busy worker is not pinged"
    elapse(supervisor, TIMEOUT_S * 0.2)
    assert supervisor._proc.killed and supervisor.state == "restarting"
    with pytest.raises(EngineUnavailable) as failed:
        supervisor._loop.run_until_complete(handle.next())
    assert failed.value.code == "engine_restarting"


def test_a_stall_of_the_server_loop_is_not_blamed_on_the_worker(supervisor):
    """The loop could not ping while it was blocked: the worker gets a ping and half a timeout."""
    elapse(supervisor, TIMEOUT_S * 3, stalled=True)
    assert not supervisor._proc.killed
    elapse(supervisor, 0.1)
    assert supervisor.sent == [Ping()] and not supervisor._proc.killed
    elapse(supervisor, TIMEOUT_S / 2)
    assert supervisor._proc.killed, "a worker that does not answer the ping is killed all the same"


def test_a_loading_worker_is_not_watched(supervisor):
    supervisor.state = "loading"
    elapse(supervisor, TIMEOUT_S * 10)
    assert supervisor.sent == [] and not supervisor._proc.killed
