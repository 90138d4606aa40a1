"""A recording reverse proxy between an agent client and `flashtree serve`.

The clients' own output says little about the protocol: to know how many requests a client
made, which HTTP statuses it got and whether its tool calls were parsed, every exchange is
recorded as it passes, request and response bodies verbatim, streaming bodies included. The
proxy forwards chunk by chunk (an SSE stream reaches the client as the server writes it) and
changes nothing but hop-by-hop headers, so the client sees exactly what the server sends.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
               "accept-encoding", "content-encoding"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json_or_text(data: bytes) -> Any:
    text = data.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class RecordingProxy:
    """Forward everything to `upstream`; append one JSON line per exchange to `transcript`,
    tagged with the current `label` (the client being run) and `task` (its task's number, 0
    outside a task)."""

    def __init__(self, upstream: str, transcript: Path):
        self.upstream = upstream.rstrip("/")
        self.transcript = transcript
        self.label = ""
        self.task = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=METHODS)])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="recording-proxy", daemon=True)

    def __enter__(self) -> "RecordingProxy":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def _record(self, entry: dict[str, Any]) -> None:
        with self._lock, self.transcript.open("a") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        entry: dict[str, Any] = {"client": self.label, "task": self.task, "t": time.time(), "method": request.method,
                                 "path": request.url.path, "request": _json_or_text(body) if body else None}
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))
        try:
            upstream = await client.send(client.build_request(request.method, url, headers=headers,
                                                              content=body), stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            self._record({**entry, "status": 502, "response": f"proxy: {e}", "seconds": 0.0})
            raise
        chunks: list[bytes] = []

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()
                self._record({**entry, "status": upstream.status_code,
                              "seconds": round(time.time() - entry["t"], 3),
                              "content_type": upstream.headers.get("content-type", ""),
                              "response": _json_or_text(b"".join(chunks))})

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)
