"""The supervisor's restart decisions, on stand-in worker processes: a worker that served and died
is restarted; restarted workers that fail to load the model again are retried with a growing
backoff, then the server gives up with the load error. (tests/test_serve_health.py runs the
real thing on a checkpoint whose weights go bad.)"""

from flashtree.config import EngineConfig, ServerConfig
from flashtree.serve.metrics import Metrics
from flashtree.serve.protocol import LoadFailed, Ready
from flashtree.serve.supervisor import MAX_FAILED_RELOADS, STABLE_AFTER_S, Supervisor


class FakeConn:
    def recv(self):
        raise EOFError  # the pipe reader ends at once; what it reports goes to FakeLoop, unread

    def send(self, msg):
        pass

    def close(self):
        pass


class FakeProcess:
    pid = 4242
    exitcode = 0

    def start(self):
        pass

    def join(self, timeout=None):
        pass


class FakeContext:
    def Pipe(self, duplex):
        return FakeConn(), FakeConn()

    def Process(self, **kw):
        return FakeProcess()


class FakeLoop:
    """Records the delay of every restart the supervisor schedules."""

    def __init__(self):
        self.delays = []

    def call_later(self, delay, callback):
        self.delays.append(delay)

    def call_soon_threadsafe(self, *args):
        pass


def test_failed_reloads_back_off_and_then_end_the_server():
    fatal = []
    sup = Supervisor(EngineConfig(), ServerConfig(), Metrics(), on_fatal=fatal.append)
    sup._loop, sup._ctx = FakeLoop(), FakeContext()
    sup._spawn()
    sup._on_message(sup._generation, Ready({"model_id": "m"}))
    sup._ready_at -= 2 * STABLE_AFTER_S  # it served long: its death is restarted after the first backoff
    sup._on_worker_exit(sup._generation, -9)
    for _ in range(MAX_FAILED_RELOADS):
        assert sup.state == "restarting" and not fatal
        sup._spawn()
        sup._on_message(sup._generation, LoadFailed("CheckpointError", "cannot read weights x"))
        sup._on_worker_exit(sup._generation, 0)
    # the workers that never loaded did not count as one that served long
    assert sup._loop.delays == [0.5 * 2 ** n for n in range(MAX_FAILED_RELOADS)]
    assert sup.state == "failed"
    assert fatal == [f"cannot load the model again after the engine worker restarted ({MAX_FAILED_RELOADS} "
                     "attempts in a row): cannot read weights x"]
