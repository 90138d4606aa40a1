"""Every failure as an OpenAI error object with the right HTTP status.

Clients (the `openai` SDK, agents) decide whether to retry, shorten the prompt or give up from
the status and `error.code`, so each internal failure maps to one stable pair here, and nothing
reaches a client as an empty success or a bare 500 page.
"""

from __future__ import annotations

import reprlib
from typing import Any, Optional

from fastapi.responses import JSONResponse

from ..checkpoint import ChatTemplateError
from ..errors import ConfigError, ContextLengthError
from .schemas import ErrorResponse
from .supervisor import EngineUnavailable, QueueFull, RequestFailed

RETRY_AFTER_S = "1"
# How every error message quotes a value the client sent (a model id, a tool name, a call id, a
# value that failed validation): whole up to 200 characters, elided in the middle past that, so
# that a 100 KB id is not sent back, and one helper, so that each is cut the same way
_ECHO = reprlib.Repr()
_ECHO.maxstring = 200


def quoted(value: Any) -> str:
    """`value`'s repr for an error message, at most about 200 characters (_ECHO)."""
    return _ECHO.repr(value)

# worker error type -> (HTTP status, OpenAI error type). Logits that are not finite are the
# model's fault on this input: a 500, not a 503 that would invite a retry of the same request
_WORKER_ERRORS = {
    "context_length_exceeded": (400, "invalid_request_error"),
    "invalid_request_error": (400, "invalid_request_error"),
    "invalid_grammar": (400, "invalid_request_error"),  # its param: GenerationSpec.grammar_param
    "out_of_memory": (503, "out_of_memory"),
    "non_finite_logits": (500, "server_error"),
    "engine_error": (503, "engine_error"),
}


def error_responses(model: type) -> dict[int | str, dict[str, Any]]:
    """The failures every API route documents in /openapi.json, with the model of their body."""
    return {code: {"model": model} for code in (400, 401, 413, 429, 500, 503)}


ERROR_RESPONSES = error_responses(ErrorResponse)


class ApiError(Exception):
    """An error response: status, message, OpenAI `type`, optional `code` and `param`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def reject(condition: bool, message: str, param: str) -> None:
    """400 invalid_request_error about `param` when `condition` holds."""
    if condition:
        raise ApiError(400, message, param=param)


def to_api_error(exc: Exception, prompt_field: str = "messages") -> ApiError:
    """The client-facing form of any exception a request can end with; a prompt too long for
    the context names `prompt_field`, the route's (messages, prompt, input)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "rate_limit_exceeded", "queue_full",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, EngineUnavailable):
        headers = {} if exc.code == "engine_failed" else {"Retry-After": RETRY_AFTER_S}
        return ApiError(503, str(exc), exc.code, exc.code, headers=headers)
    if isinstance(exc, RequestFailed):
        status, kind = _WORKER_ERRORS.get(exc.error_type, (503, exc.error_type))
        return ApiError(status, str(exc), kind, exc.error_type, exc.param)
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), "invalid_request_error", "context_length_exceeded", prompt_field)
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc), "invalid_request_error", param=exc.param)
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, str(exc), "invalid_request_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", "internal_error")
