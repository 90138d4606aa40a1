"""`flashtree serve` as a child process for the client runs: start, wait until healthy, read its
counters, stop. Its whole output goes to a log file that is kept with the transcripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .proxy import free_port

SERVE_CMD = [sys.executable, "-m", "flashtree.cli", "serve"]
AGENT_MAX_CTX = 65536  # hermes-agent refuses a context under 64K
START_TIMEOUT_S = 600
COUNTERS = ("flashtree_prompt_tokens_total", "flashtree_cached_tokens_total",
            "flashtree_completion_tokens_total")


class FlashtreeServer:
    """A running server on a free port; `url` is its root."""

    def __init__(self, log_path: Path, *flags: str, max_ctx: int = AGENT_MAX_CTX,
                 api_key: Optional[str] = None, env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = SERVE_CMD + ["--port", str(self.port), "--max-ctx", str(max_ctx), *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "ab")
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def __enter__(self) -> "FlashtreeServer":
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flashtree serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"flashtree serve not healthy after {START_TIMEOUT_S}s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def model(self) -> str:
        """The id the server reports for its model (clients must name it in requests)."""
        r = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def counters(self) -> dict[str, float]:
        """The token counters of /metrics (prompt, cached, completion), summed over requests."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        out = dict.fromkeys(COUNTERS, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in out:
                    out[sample.name] = sample.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
