"""The FastAPI application: routes, the request guard (auth, body size, metrics), error shapes.

Everything a client can receive goes through here, so this is where "an error object, always"
is enforced: the API routes answer their own failures in their surface's shape
(api_common.ApiRoute), and here auth failures, oversized bodies, unknown routes and anything
else are turned into `{"error": {...}}` (Anthropic's shape under /v1/messages) with a
meaningful status, through the same mapping (api_common.api_error).
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..checkpoint import ChatTemplateError
from ..errors import FlashtreeError
from . import anthropic_api, openai_api, responses_api, webpage
from .api_common import api_error
from .context import ServeContext, serve_context
from .errors import ApiError

OPEN_PATHS = ("/health",)  # and the chat page with its assets (webpage.is_public): they hold no data
BODY_METHODS = ("POST", "PUT", "PATCH")


class GuardMiddleware:
    """Bearer-token auth, the request-body limit and read timeout, and per-route request counting,
    applied before any route runs (pure ASGI, so streaming responses pass through untouched)."""

    def __init__(self, app: ASGIApp, ctx: ServeContext, known_paths: set[str]):
        self.app = app
        self.ctx = ctx
        self.known_paths = known_paths
        self.limit = int(ctx.config.max_body_mb * 1024 * 1024)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._auth_error(scope)
            if error is None and scope["method"] in BODY_METHODS:
                error, receive = await self._buffer_body(scope, receive)
            if error is not None:
                respond = anthropic_api.error_response if anthropic_api.is_anthropic_path(
                    scope["path"]) else ApiError.response
                await respond(error)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            endpoint = scope["path"] if scope["path"] in self.known_paths else "other"
            self.ctx.metrics.requests.labels(endpoint=endpoint, status=str(status[0])).inc()

    def _auth_error(self, scope: Scope) -> ApiError | None:
        key = self.ctx.config.api_key
        if not key or scope["path"] in OPEN_PATHS or webpage.is_public(scope["path"]):
            return None
        headers = dict(scope["headers"])
        # the scheme is case-insensitive (RFC 9110): clients send `bearer` and `BEARER` too
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), key.encode()):
            return None
        if hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode()):  # Anthropic clients
            return None
        return ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>` "
                             "or `x-api-key: <key>`",
                        "invalid_request_error", "invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})

    async def _buffer_body(self, scope: Scope, receive: Receive) -> tuple[ApiError | None, Receive]:
        """Read the whole body up to the limit (chunked uploads included) and replay it. A body
        that stops arriving for --body-timeout is a 408 that closes the connection: the client
        would otherwise hold it (and this task) for as long as it likes."""
        too_large = ApiError(413, f"request body exceeds {self.ctx.config.max_body_mb:g} MiB "
                                  "(raise --max-body-mb)", "invalid_request_error", "request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return too_large, receive
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.ctx.config.body_timeout)
            except asyncio.TimeoutError:
                return ApiError(408, f"the request body stopped arriving for {self.ctx.config.body_timeout:g}s "
                                     "(--body-timeout)", "invalid_request_error", "request_timeout",
                                headers={"Connection": "close"}), receive
            if message["type"] != "http.request":
                break  # disconnected: the route will notice
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return too_large, receive
            if not message.get("more_body", False):
                break
        replayed = [False]

        async def replay() -> Message:
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return None, replay


def _install_error_handlers(app: FastAPI) -> None:
    """Failures outside the API routes (which answer their own): unknown routes, wrong methods,
    /props and the like."""

    async def on_error(request: Request, exc: Exception) -> Response:
        return api_error(exc, request).response()

    for kind in (RequestValidationError, StarletteHTTPException, ApiError, FlashtreeError, Exception):
        app.add_exception_handler(kind, on_error)


def _openapi_without_422(app: FastAPI) -> None:
    """Validation errors are 400 here (as OpenAI answers); drop FastAPI's implied 422 from the
    published schema so that it describes what the server really does."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _props(ctx: ServeContext) -> dict[str, Any]:
    cfg = ctx.engine_settings()
    info = ctx.supervisor.info
    speculative = {"mode": info.get("mode"), "budget": cfg.get("budget"),
                   "block_size": info.get("block_size"), "chain_seed": cfg.get("chain_seed"),
                   "has_draft": info.get("has_draft")}
    return {
        "default_generation_settings": {
            "n_ctx": ctx.max_ctx, "model": ctx.model_name, "speculative": info.get("mode") != "ar",
            "params": {"n_predict": ctx.config.default_max_tokens or -1, "temperature": 0.0, "top_k": 0,
                       "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0,
                       "speculative.n_max": speculative["budget"], "speculative.mode": speculative["mode"]},
        },
        "speculative": speculative,
        "total_slots": ctx.supervisor.capacity,
        "model_path": info.get("model_path"),
        "model_alias": ctx.model_name,
        "chat_template": ctx.tokenizer.chat_template,
        "modalities": {"vision": False, "audio": False},
        "prefix_cache": {"slots": cfg.get("prefix_cache_slots"), "device_bytes": cfg.get("prefix_cache_bytes"),
                         "host_bytes": cfg.get("host_cache_bytes"), "cache_dir": cfg.get("cache_dir"),
                         "disk_bytes": cfg.get("disk_cache_bytes"),
                         **ctx.metrics.cache_report},
    }


async def _load_tokenizer(ctx: ServeContext) -> None:
    await ctx.supervisor.first_ready.wait()
    try:
        await asyncio.to_thread(ctx.load_tokenizer)
    except ChatTemplateError as e:  # a template that cannot serve any chat: its message names it
        ctx.supervisor.fail(str(e))
    except Exception as e:  # the worker read these files; failing here is fatal all the same
        ctx.supervisor.fail(f"cannot load the tokenizer: {e}")


def create_app(ctx: ServeContext) -> FastAPI:
    """The app for one server; the supervisor starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ctx.supervisor.start()
        loader = asyncio.create_task(_load_tokenizer(ctx))
        try:
            yield
        finally:
            loader.cancel()
            ctx.templates.close()  # renderings in progress end now, not at their time limit
            await ctx.supervisor.stop()

    # no /docs or /redoc: FastAPI's pages load their scripts from a CDN, so on a machine offline (a
    # local server's usual case) they are blank; /openapi.json, which they read, is served
    app = FastAPI(title="flashtree", summary="OpenAI-compatible server for DFlash + DDTree decoding",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(webpage.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = ctx.health()
        return JSONResponse(body, status_code=status)

    # load balancers' checks; one OpenAPI operation per path and method would need two ids
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        return _props(serve_context(request))

    @app.get("/sequences")
    async def sequences() -> dict[str, Any]:
        """The live sequences: how many generations run at once, which run now, how many wait,
        and each sequence's tokens as the engine last reported them (after each request)."""
        sup = ctx.supervisor
        return {"max_sequences": sup.capacity, "running": sup.running, "waiting": sup.queue_depth,
                "sequences": ctx.metrics.cache_report.get("sequences", [])}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    _install_error_handlers(app)
    _openapi_without_422(app)
    known = set(app.openapi()["paths"]) | {app.openapi_url} | webpage.public_paths()
    app.add_middleware(GuardMiddleware, ctx=ctx, known_paths=known)
    if ctx.config.cors_origin:
        origins = [o.strip() for o in ctx.config.cors_origin.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])
    return app
