"""Start a real `flashtree serve` as a subprocess on a free port, for the serve tests.

One thread per process for torch: on a small CI machine several OpenMP threads per process
contend with each other (server, worker, pytest) and a tiny model slows down a hundredfold.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Optional

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

from clients.server import SERVE_CMD, FlashtreeServer  # noqa: E402

__all__ = ["SERVE_CMD", "Server", "module_server"]

START_TIMEOUT_S = 180


class Server(FlashtreeServer):
    """A running server for a test module, started healthy; `client()` is an openai client for it."""

    def __init__(self, target: Optional[Path], draft: Optional[Path], log_path: Path, *flags: str,
                 api_key: Optional[str] = None, max_ctx: int = 1024, env: Optional[dict[str, str]] = None):
        models = ["--target", str(target), "--draft", str(draft)] if target else []  # else embedded
        super().__init__(log_path, *models, "--log-level", "warning", *flags, max_ctx=max_ctx,
                         api_key=api_key, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                               "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        try:
            self.wait_healthy(START_TIMEOUT_S)
        except RuntimeError:
            self.stop()
            raise

    def headers(self) -> dict[str, str]:
        return dict(self.auth)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.auth, timeout=60, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {**self.auth, **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=120, **kw)


def module_server(tiny_pair: tuple[Path, Path], tmp_path_factory, *flags: str, **kw) -> Iterator[Server]:
    """The body of a module-scoped server fixture (`yield from module_server(...)`): a server on
    the tiny test pair, stopped when the module is done."""
    target, draft = tiny_pair
    srv = Server(target, draft, tmp_path_factory.mktemp("log") / "server.log", *flags, **kw)
    try:
        yield srv
    finally:
        srv.stop()
