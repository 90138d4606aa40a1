"""clients/server.py's FlashtreeServer against a stand-in for `flashtree serve` (a few lines of
http.server that bind port 0 and log the port as `flashtree serve` does): the harness asks the
server it started, on the port that server bound, not one another process could have taken; an
earlier run's line in the same log is not mistaken for this run's; an exit before or after
listening is an error with the log."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

import clients.server as server  # noqa: E402

FAKE = textwrap.dedent("""
    import http.server, json, os, sys
    assert sys.argv[sys.argv.index("--port") + 1] == "0"
    if os.environ.get("EXIT_BEFORE"):
        print("flashtree serve: cannot listen on 127.0.0.1:0: something", flush=True)
        sys.exit(2)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "pid": os.getpid()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    print(f"flashtree serve: listening on http://127.0.0.1:{httpd.server_address[1]}/ (the chat page at /)",
          file=sys.stderr, flush=True)
    if os.environ.get("EXIT_AFTER"):
        print("flashtree serve: the model cannot be loaded", flush=True)
        sys.exit(1)
    httpd.serve_forever()
""")


@pytest.fixture
def fake_serve(tmp_path, monkeypatch):
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE)
    monkeypatch.setattr(server, "SERVE_CMD", [sys.executable, str(script)])


def test_the_harness_asks_the_server_it_started_on_the_port_it_bound(tmp_path, fake_serve):
    log = tmp_path / "server.log"
    # an earlier run's lines in the same log: its port is not this run's
    log.write_text("flashtree serve: listening on http://127.0.0.1:1/ (the chat page at /)\n")
    srv = server.FlashtreeServer(log)
    try:
        assert srv.wait_healthy(timeout=60) == {"status": "ok", "pid": srv.proc.pid}
        assert srv.port != 1 and srv.url == f"http://127.0.0.1:{srv.port}"
        assert httpx.get(srv.url + "/health", timeout=5).json()["pid"] == srv.proc.pid
    finally:
        srv.stop()


def test_an_exit_before_listening_is_an_error_with_the_log(tmp_path, fake_serve):
    srv = server.FlashtreeServer(tmp_path / "before.log", env={"EXIT_BEFORE": "1"})
    with pytest.raises(RuntimeError, match="(?s)exited with 2.*cannot listen on 127.0.0.1:0: something"):
        srv.wait_healthy(timeout=60)
    srv.stop()


def test_an_exit_after_listening_is_an_error_at_once(tmp_path, fake_serve):
    srv = server.FlashtreeServer(tmp_path / "after.log", env={"EXIT_AFTER": "1"})
    with pytest.raises(RuntimeError, match="(?s)exited with 1:.*cannot be loaded"):
        srv.wait_healthy(timeout=60)
    srv.stop()
