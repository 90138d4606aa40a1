"""Start a real `flashtree serve` as a subprocess on a free port, for the serve tests.

One thread per process for torch: on a small CI machine several OpenMP threads per process
contend with each other (server, worker, pytest) and a tiny model slows down a hundredfold.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import openai

SERVE_CMD = [sys.executable, "-m", "flashtree.cli", "serve"]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server; `url` is its root, `client()` an openai client for it."""

    def __init__(self, target: Optional[Path], draft: Optional[Path], log_path: Path, *flags: str,
                 api_key: Optional[str] = None, max_ctx: int = 1024, env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        models = ["--target", str(target), "--draft", str(draft)] if target else []  # else embedded
        cmd = SERVE_CMD + models + ["--port", str(self.port), "--max-ctx", str(max_ctx),
                                    "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   **(env or {}))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_healthy()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {**self.headers(), **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=120, **kw)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
