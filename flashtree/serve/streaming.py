"""Driving a generation from an HTTP handler: wait for it to start, collect it or stream it.

Two rules come from the failures of earlier servers. A request must not look successful before
the engine has accepted it, so a handler waits for `Started` (an error before that is a real
HTTP error status). And a client that goes away must stop the engine: while a handler waits,
it also watches the connection, and leaving the wait (disconnect or not) closes the generation,
which cancels it in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from .errors import ApiError, to_api_error
from .pipeline import Item, Started

T = TypeVar("T")
log = logging.getLogger("flashtree.serve")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


def _json(obj: Any) -> str:
    """`obj` as JSON, which has no spelling for an infinite or NaN float: one is an error (the
    stream then ends with an error event), as it is in a whole JSON response, never a
    `-Infinity` that a client's parser chokes on."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def sse_data(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


def sse_event(name: str, obj: Any) -> str:
    return f"event: {name}\ndata: {_json(obj)}\n\n"


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled (which
    closes the generation it drives) and the request ends with 499."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ApiError(499, "client closed the request", "client_closed_request")
    return work.result()


async def started(request: Request, items: AsyncIterator[Item]) -> AsyncIterator[Item]:
    """Wait (watching the client) until the engine runs `items`; return the same iterator."""
    try:
        first = await _unless_disconnected(request, items.__anext__())
    except BaseException:
        await items.aclose()
        raise
    if not isinstance(first, Started):
        raise RuntimeError(f"generation began with {first!r} instead of Started")
    return items


async def collect(request: Request, items: AsyncIterator[Item]) -> list[Item]:
    """Everything the generation yields, for a non-streaming response."""

    async def drain() -> list[Item]:
        return [item async for item in items]

    try:
        return await _unless_disconnected(request, drain())
    finally:
        await items.aclose()


def sse_response(events: AsyncIterator[str], on_error: Callable[[ApiError], list[str]],
                 items: AsyncIterator[Item]) -> StreamingResponse:
    """Stream `events`; a failure mid-stream becomes `on_error`'s events, never a cut stream.
    Where those fail too (a surface's closing event may echo the request, which is what failed),
    a bare `error` event ends the stream. The generation is closed (so cancelled) however the
    stream ends, disconnect included."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except Exception as exc:  # after the 200 the error must travel inside the stream
            error = to_api_error(exc)
            if error.code == "internal_error":  # a bug of this server, not of the request
                log.error("unhandled error in a stream", exc_info=exc)
            try:
                closing = on_error(error)
            except Exception:
                log.exception("the stream's error events failed; sending a bare error event")
                closing = [sse_event("error", error.body())]
            for chunk in closing:
                yield chunk
        finally:
            await items.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
