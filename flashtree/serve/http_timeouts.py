"""A deadline for request headers, which uvicorn does not have.

uvicorn closes a keep-alive connection only when it stays idle after a response, and a single
byte cancels even that: a connection that opens and sends nothing, or half a request line, or
headers one byte a minute, is held open for ever, and a few hundred such connections exhaust the
server's file descriptors (slowloris). Here every connection must deliver a complete request
head within `--header-timeout` of opening or of its previous response; otherwise it is answered
408 and closed. (Bodies have their own read timeout, in app.GuardMiddleware.)
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

_MESSAGE = b"request headers not received in time\n"
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_MESSAGE), _MESSAGE))


def with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (h11 or httptools, whichever it would pick) with a header
    deadline of `timeout_s`; pass it as uvicorn.Config(http=...)."""

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        # Both uvicorn protocols create `self.cycle` when a request's headers are complete and
        # call on_response_complete when its response is sent: the deadline runs in between.
        _deadline: Optional[asyncio.TimerHandle] = None
        _waiting_after: Any = None  # the cycle that was current when the deadline was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_on_new_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing():
                self._arm()
                self._disarm_on_new_request()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _disarm_on_new_request(self) -> None:
            if self._deadline is not None and self.cycle is not self._waiting_after:
                self._disarm()

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.write(REQUEST_TIMEOUT)
                self.transport.close()

    return HeaderTimeoutProtocol
