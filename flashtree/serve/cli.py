"""`flashtree serve`: its flags (from EngineConfig and ServerConfig) and the server's main loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Any

from ..config import EngineConfig, ServerConfig, add_dataclass_flags, dataclass_from_args
from ..errors import ConfigError

DESCRIPTION = """Serve OpenAI-compatible endpoints (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/models) plus /health, /props and /metrics. The engine runs in a worker
process that is restarted if it dies or stops responding (--worker-timeout); requests beyond
--max-queue get 429."""


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                   description=DESCRIPTION)
    add_dataclass_flags(parser, EngineConfig)
    add_dataclass_flags(parser, ServerConfig)
    parser.set_defaults(func=run_serve)
    return parser


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port`, made before the model loads: a port already in use or a
    host that is not this machine's fails at once, in one line (ConfigError), not after minutes
    of loading a model. Uvicorn listens on it."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; the exit code is 0, 2 for bad flags, 1 when the model
    cannot be loaded (at start-up, or again after a worker restart) or its chat template cannot
    be served."""
    import uvicorn  # the web stack loads only for `serve`, not for every subcommand

    from .app import create_app
    from .context import ServeContext
    from .http_timeouts import with_header_timeout
    from .logs import configure_logging
    from .metrics import Metrics
    from .supervisor import Supervisor

    engine_config: EngineConfig = dataclass_from_args(EngineConfig, args)
    server_config: ServerConfig = dataclass_from_args(ServerConfig, args)
    try:
        engine_config.validate()
        server_config.validate()
        sock = listening_socket(server_config.host, server_config.port)
    except ConfigError as e:
        print(f"flashtree serve: {e}", file=sys.stderr)
        return 2
    configure_logging(server_config.log_level)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # at every log level: with --port 0 this line is the only way to learn the port
    print(f"flashtree serve: listening on http://{shown}:{port}/ (the chat page at /, the API under /v1; "
          "Ctrl+C stops it)", file=sys.stderr, flush=True)
    if server_config.host not in ("127.0.0.1", "localhost", "::1") and not server_config.api_key:
        logging.getLogger("flashtree.serve").warning(
            "listening on %s without --api-key: anyone who can reach this port can use the model",
            server_config.host)
    metrics = Metrics()
    # a model that cannot load, or whose chat template cannot be served, ends the server (exit
    # code 1) instead of a 503 forever
    supervisor = Supervisor(engine_config, server_config, metrics,
                            on_fatal=lambda message: setattr(server, "should_exit", True))
    ctx = ServeContext(server_config, supervisor, metrics)
    app = create_app(ctx)
    server = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level=server_config.log_level,
                                           http=with_header_timeout(server_config.header_timeout),
                                           timeout_keep_alive=server_config.keep_alive_timeout,
                                           timeout_graceful_shutdown=5))
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:  # after a forced exit too: multiprocessing's exit handler would wait for these children
        supervisor.kill_worker()
        ctx.templates.close()
        sock.close()
    if supervisor.fatal_error:
        print(f"flashtree serve: {supervisor.fatal_error}", file=sys.stderr)
        return 1
    return 0
