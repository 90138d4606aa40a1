"""A worker that hangs without dying (here `kill -STOP`) is noticed by its silence, killed and
restarted; connections that never finish their request are closed; a SIGTERM to the whole
process group (a terminal, a service manager) shuts the server down cleanly."""

import http.client
import os
import signal
import socket
import threading
import time

import openai
import pytest

from serve_harness import Server, module_server

pytestmark = pytest.mark.slow  # each test waits out a timeout or a restart

WORKER_TIMEOUT_S = 3
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
SLACK_S = 3  # the watchdog's tick, a loaded CI machine
LONG = [{"role": "user", "content": "hi"}]
FLAGS = ("--worker-timeout", str(WORKER_TIMEOUT_S), "--header-timeout", str(HEADER_TIMEOUT_S),
         "--body-timeout", str(BODY_TIMEOUT_S))


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, *FLAGS)


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def probe(server):
    r = server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=8, temperature=0)
    return r.choices[0].finish_reason


class Stopped:
    """SIGSTOP a process for the length of a block; it is SIGKILLed on the way out should the
    server not have done so, so that a failing test leaves no frozen process behind."""

    def __init__(self, pid):
        self.pid = pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_stopped_worker_fails_its_request_with_503_and_is_replaced(server):
    old_pid = server.get("/health").json()["worker_pid"]
    outcome = {}

    def request():
        try:
            server.client().chat.completions.create(model="x", messages=LONG, max_tokens=900, temperature=0,
                                                    extra_body={"ignore_eos": True})
            outcome["status"] = 200
        except openai.APIStatusError as e:
            outcome["status"], outcome["body"] = e.status_code, e.body

    thread = threading.Thread(target=request)
    thread.start()
    wait_for(lambda: server.metric("flashtree_requests_running") == 1)
    with Stopped(old_pid):
        stopped_at = time.monotonic()
        thread.join(WORKER_TIMEOUT_S + SLACK_S + 10)
        assert not thread.is_alive(), "the request hangs on a stopped worker"
        assert time.monotonic() - stopped_at < WORKER_TIMEOUT_S + SLACK_S
        assert outcome["status"] == 503 and outcome["body"]["code"] == "engine_restarting", outcome
        assert "stopped responding" in outcome["body"]["message"]
        health = server.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_restarting"
    assert server.wait_healthy(60)["worker_pid"] != old_pid
    assert probe(server) in ("stop", "length")
    assert server.metric("flashtree_worker_restarts_total") >= 1


def test_a_stopped_idle_worker_is_noticed_by_health(server):
    old_pid = server.wait_healthy(60)["worker_pid"]
    with Stopped(old_pid):
        wait_for(lambda: server.get("/health").status_code == 503, WORKER_TIMEOUT_S + SLACK_S)
    assert server.wait_healthy(60)["worker_pid"] != old_pid
    assert probe(server) in ("stop", "length")


def read_until_closed(sock, timeout):
    """Everything the server sends until it closes the connection; fails if it never does."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except socket.timeout:
        pytest.fail(f"connection still open after {timeout}s, having received {data!r}")
    return data


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half-headers"])
def test_a_connection_without_a_whole_request_is_closed(server, sent):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        answer = read_until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stops_arriving_gets_408_and_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = read_until_closed(sock, BODY_TIMEOUT_S + SLACK_S)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in answer


def test_keep_alive_requests_are_not_cut_by_the_header_deadline(server):
    """The deadline restarts after every response: a connection that keeps sending requests
    stays open longer than the header timeout."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    sockets = []
    try:
        for _ in range(3):
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            sockets.append(conn.sock)
            time.sleep(HEADER_TIMEOUT_S * 0.7)
    finally:
        conn.close()
    assert all(s is sockets[0] for s in sockets), "the connection was closed and opened again"


def test_sigterm_to_the_process_group_stops_cleanly(tiny_pair, tmp_path):
    """As systemd, docker or a terminal deliver it: to the server and its worker at once. The
    worker finishes when the server tells it to, not by the signal, so no crash is reported.
    At info level the worker's own log lines (its memory plan) are in the server's output."""
    target, draft = tiny_pair
    srv = Server(target, draft, tmp_path / "server.log", "--log-level", "info")
    try:
        worker_pid = srv.wait_healthy()["worker_pid"]
        os.kill(srv.proc.pid, signal.SIGTERM)
        os.kill(worker_pid, signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down, so a parent sees how it ended
        assert srv.proc.wait(30) == -signal.SIGTERM
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "died" not in log and "restarting" not in log, log
    assert "engine worker stopped (exit code 0)" in log
    assert "memory plan" in log and "target weights" in log
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
