"""/health reports the engine, not only the HTTP process: 503 with why while the worker restarts
(and after what), and a model that cannot be loaded again ends the server with its load error
instead of a restart loop."""

import os
import shutil
import signal
import time

import pytest

from serve_harness import Server

pytestmark = pytest.mark.slow  # a restart, then three failed reloads with their backoff


def health_until(srv, done, timeout=120.0):
    """Every /health answer (status code, body) until `done(answers)` or the server exits."""
    answers, deadline = [], time.monotonic() + timeout
    while srv.alive and not done(answers):
        assert time.monotonic() < deadline, f"not reached in {timeout}s: {answers[-3:]}"
        try:
            r = srv.get("/health")
            answers.append((r.status_code, r.json()))
        except Exception:  # the server is exiting
            pass
        time.sleep(0.05)
    return answers


def messages(answers):
    return [body["error"]["message"] for status, body in answers if status == 503]


def test_health_says_why_the_worker_restarts_and_a_model_that_cannot_reload_ends_the_server(tiny_pair, tmp_path):
    target = shutil.copytree(tiny_pair[0], tmp_path / "target")
    srv = Server(target, tiny_pair[1], tmp_path / "server.log")
    try:
        pid = srv.wait_healthy()["worker_pid"]
        os.kill(pid, signal.SIGKILL)
        answers = health_until(srv, lambda a: a and a[-1][0] == 200 and a[-1][1]["worker_pid"] != pid)
        assert "the engine worker is restarting: it died (exit code -9); retry shortly" in messages(answers)
        assert all(body["error"]["code"] == "engine_restarting" for status, body in answers if status == 503)

        weights = target / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        os.kill(answers[-1][1]["worker_pid"], signal.SIGKILL)
        answers = health_until(srv, lambda a: False)
        assert srv.proc.wait(10) == 1
        reload_failed = [m for m in messages(answers) if "its reload of the model failed (1 of 3 attempts): "
                         f"cannot read weights {weights}" in m]
        assert reload_failed, messages(answers)
        statuses = [status for status, _ in answers]
        assert 200 not in statuses[statuses.index(503):], "healthy again between failed reloads"
        assert ("flashtree serve: cannot load the model again after the engine worker restarted (3 attempts in "
                f"a row): cannot read weights {weights}") in srv.log()
    finally:
        srv.stop()
