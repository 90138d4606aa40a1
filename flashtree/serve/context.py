"""What every route needs: the server settings, the supervisor, the metrics, the tokenizer and
the sandbox that renders its chat template.

The tokenizer lives in the server process too (prompts are rendered and tokenized here, output
detokenized here), loaded from the directory the worker reports once its engine is up, so both
sides read the very same files. Its chat template is checked then (template_sandbox): the server
is ready only once it has been.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from ..checkpoint import load_tokenizer, read_optional_json
from ..config import ServerConfig
from .errors import ApiError, RETRY_AFTER_S
from .metrics import Metrics
from .reasoning import uses_reasoning_tags
from .supervisor import Supervisor
from .template_sandbox import RenderLimits, TemplateSandbox, check_template
from .toolcalls import detect_format


@dataclass
class ServeContext:
    config: ServerConfig
    supervisor: Supervisor
    metrics: Metrics
    tokenizer: Any = None
    tool_format: str = "hermes"
    reasoning_tags: bool = False
    templates: TemplateSandbox = field(init=False)

    def __post_init__(self) -> None:
        self.templates = TemplateSandbox(RenderLimits.for_server(self.config))

    def load_tokenizer(self) -> None:
        """Blocking: read the tokenizer of the model the worker loaded, and check its chat template
        (ChatTemplateError when it cannot be served)."""
        model_dir = Path(self.supervisor.info["model_path"])
        tok = load_tokenizer(model_dir, read_optional_json(model_dir / "config.json"))
        tok.prepare()
        check_template(tok, self.templates, self.max_ctx)
        parser = self.config.tool_parser
        self.tool_format = detect_format(tok.chat_template) if parser == "auto" else parser
        self.reasoning_tags = uses_reasoning_tags(tok.chat_template)
        self.tokenizer = tok

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.supervisor.state == "ready"

    @property
    def model_name(self) -> str:
        return self.config.model_alias or self.supervisor.info.get("model_id") or "flashtree"

    @property
    def max_ctx(self) -> int:
        return int(self.supervisor.info["max_ctx"])

    def engine_settings(self) -> dict[str, Any]:
        return dict(self.supervisor.info.get("config") or {})

    def require_model(self) -> None:
        """Raise 503 unless the model (and its tokenizer) has been loaded at least once."""
        if self.tokenizer is None:
            failed = self.supervisor.state == "failed"
            code = "engine_failed" if failed else "model_loading"
            message = self.supervisor.fatal_error if failed else "the model is still loading; retry shortly"
            raise ApiError(503, message or code, code, code,
                           headers={} if failed else {"Retry-After": RETRY_AFTER_S})

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health status code and body: 200 only while a worker is up with the model loaded and
        the server has its tokenizer and a checked chat template; else 503 with why (the
        supervisor's status line: loading, restarting and after what, or the error it gave up on)."""
        if self.ready:
            return 200, {"status": "ok", "model": self.model_name,
                         "worker_pid": self.supervisor.worker_pid,
                         "queue_depth": self.supervisor.queue_depth}
        state, message = self.supervisor.state, self.supervisor.status_message
        if state == "ready":  # the worker is, this process is not yet
            state, message = "loading", "the model is loaded; reading its tokenizer and checking its chat template"
        code = {"restarting": "engine_restarting", "failed": "engine_failed",
                "stopped": "engine_failed"}.get(state, "model_loading")
        return 503, {"status": state,
                     "error": {"message": message, "type": code, "param": None, "code": code}}


def serve_context(request: Request) -> ServeContext:
    """The app's context, once the model is loaded (503 before)."""
    ctx: ServeContext = request.app.state.ctx
    ctx.require_model()
    return ctx
