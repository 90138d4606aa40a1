"""`flashtree serve` as a child process for the client runs: start, wait until healthy, read its
counters, stop. Its whole output goes to a log file that is kept with the transcripts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVE_CMD = [sys.executable, "-m", "flashtree.cli", "serve"]
AGENT_MAX_CTX = 65536  # hermes-agent refuses a context under 64K
START_TIMEOUT_S = 600
# what `flashtree serve` logs once its socket is bound (serve/cli.py), with the port it bound
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)/")
COUNTERS = ("flashtree_prompt_tokens_total", "flashtree_cached_tokens_total",
            "flashtree_completion_tokens_total")


class FlashtreeServer:
    """A running server on a port it chose itself; `url` is its root."""

    def __init__(self, log_path: Path, *flags: str, max_ctx: int = AGENT_MAX_CTX,
                 api_key: Optional[str] = None, env: Optional[dict[str, str]] = None):
        self.log_path = log_path
        self.api_key = api_key
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # --port 0: the server binds a free port and logs it; a port chosen here could be taken
        # by another process before the server bound it, and /health would then ask that one
        cmd = SERVE_CMD + ["--port", "0", "--max-ctx", str(max_ctx), *flags]
        cmd += ["--api-key", api_key] if api_key else []
        self._log = open(log_path, "ab")
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self._log_start = self._log.tell()  # this run's output: an earlier run's may be above it
        self._port: Optional[int] = None
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def __enter__(self) -> "FlashtreeServer":
        try:
            self.wait_healthy()
        except RuntimeError:
            self.stop()
            raise
        return self

    def _bound_port(self) -> Optional[int]:
        """The port in this run's line that the server logs once it listens (before its model
        loads), or None before that line."""
        if self._port is None:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                found = LISTENING.search(f.read())
            self._port = int(found.group(1)) if found else None
        return self._port

    @property
    def port(self) -> int:
        """The port the server bound; waits for it, and raises if the server exits first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._bound_port() is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flashtree serve exited with {self.proc.returncode} before listening:\n"
                                   f"{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"flashtree serve did not listen in {START_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.05)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> dict:
        """Block until /health answers 200 (also after a worker restart), within `timeout` from
        the start (the wait for the port included); return its body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flashtree serve exited with {self.proc.returncode}:\n{self.log()}")
            port = self._bound_port()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2) if port else None
                if r is not None and r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"flashtree serve not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """The end of the server's log (for error messages)."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def model(self) -> str:
        """The id the server reports for its model (clients must name it in requests)."""
        r = httpx.get(self.url + "/v1/models", headers=self.auth, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def _samples(self) -> Iterator[Any]:
        """Every sample of one /metrics scrape."""
        text = httpx.get(self.url + "/metrics", headers=self.auth, timeout=30).text
        for family in text_string_to_metric_families(text):
            yield from family.samples

    def metric(self, name: str, **labels: str) -> float:
        """The value of the first /metrics sample called `name` whose labels include `labels`
        (0 when there is none yet)."""
        for sample in self._samples():
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
        return 0.0

    def metrics(self, names: Iterable[str]) -> dict[str, float]:
        """The first sample of each of `names` from one scrape (0 for one not there yet): values
        read together, as a before/after difference needs."""
        wanted, values = list(names), {}
        for sample in self._samples():
            if sample.name in wanted:
                values.setdefault(sample.name, sample.value)
        return {name: values.get(name, 0.0) for name in wanted}

    def counters(self) -> dict[str, float]:
        """The token counters of /metrics (prompt, cached, completion), summed over requests."""
        return self.metrics(COUNTERS)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
