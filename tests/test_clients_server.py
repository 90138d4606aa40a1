"""clients/server.py's FlashtreeServer against a stand-in for `flashtree serve` (a few lines of
http.server that refuse the ports named busy as `flashtree serve` does): a port taken between
free_port() and the server's bind starts the server again on another, at most PORT_RETRIES
times; any other exit is an error with the log."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

import clients.server as server  # noqa: E402

FAKE = textwrap.dedent("""
    import http.server, json, os, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    if str(port) in os.environ.get("BUSY", "").split(","):
        print(f"flashtree: error: cannot listen on 127.0.0.1:{port}: Address already in use", flush=True)
        sys.exit(2)
    if os.environ.get("CRASH"):
        print("flashtree: error: something else", flush=True)
        sys.exit(1)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "port": port}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


@pytest.fixture
def fake_serve(tmp_path, monkeypatch):
    script = tmp_path / "fake_serve.py"
    script.write_text(FAKE)
    monkeypatch.setattr(server, "SERVE_CMD", [sys.executable, str(script)])
    real = server.free_port
    ports = [real() for _ in range(server.PORT_RETRIES + 1)]
    handed = iter(ports)
    monkeypatch.setattr(server, "free_port", lambda: next(handed))
    return ports


def test_a_taken_port_starts_the_server_again_on_another(tmp_path, fake_serve):
    busy = fake_serve[:server.PORT_RETRIES]
    srv = server.FlashtreeServer(tmp_path / "server.log", env={"BUSY": ",".join(map(str, busy))})
    try:
        assert srv.wait_healthy(timeout=60) == {"status": "ok", "port": fake_serve[-1]}
        assert srv.port == fake_serve[-1] and srv.url.endswith(f":{fake_serve[-1]}")
    finally:
        srv.stop()


def test_ports_taken_past_the_retries_or_another_exit_are_an_error(tmp_path, fake_serve):
    srv = server.FlashtreeServer(tmp_path / "busy.log", env={"BUSY": ",".join(map(str, fake_serve))})
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{fake_serve[-1]}"):
        srv.wait_healthy(timeout=60)
    srv.stop()


def test_another_exit_is_an_error_at_once(tmp_path, fake_serve):
    srv = server.FlashtreeServer(tmp_path / "crash.log", env={"CRASH": "1"})
    with pytest.raises(RuntimeError, match="(?s)exited with 1:.*something else"):
        srv.wait_healthy(timeout=60)
    assert srv.port == fake_serve[0]  # not started again
    srv.stop()
