"""What a Messages response is made of: content blocks, stream events, usage, stop reason, errors.

The serving pipeline yields text deltas (content or reasoning), complete tool calls and a
Finish; here they become Anthropic content blocks. One builder serves both the JSON response and
the stream, so the two cannot disagree: a block opens when the kind of output changes (text,
thinking, tool_use), each delta extends the open block, and a block closes before the next one
opens. The stream is the SDK's exact grammar: message_start, then per block content_block_start,
content_block_delta (text_delta / thinking_delta / input_json_delta), content_block_stop, then
message_delta (stop_reason, stop_sequence, cumulative usage) and message_stop.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from fastapi.responses import JSONResponse

from .errors import ApiError
from .pipeline import Finish, Item, TextDelta, Usage
from .streaming import sse_event
from .toolcalls import ToolCall

# HTTP status -> Anthropic error type (the SDK raises by status; Claude Code reads the type)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
RETRYABLE = (429, 503, 529)
# Claude Code recognises an over-long prompt by this opening and compacts the conversation
TOO_LONG = "prompt is too long: "
PING = sse_event("ping", {"type": "ping"})


def error_body(error: ApiError) -> dict[str, Any]:
    message = error.message
    if error.code == "context_length_exceeded" and not message.startswith(TOO_LONG):
        message = TOO_LONG + message
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"),
                                       "message": message}}


def error_response(error: ApiError) -> JSONResponse:
    """`error` in Anthropic's shape; the SDK retries when told `x-should-retry: true`."""
    headers = dict(error.headers)
    headers["x-should-retry"] = "true" if error.status in RETRYABLE else "false"
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def usage_dict(usage: Usage) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from the ones it processed."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


def stop_reason(finish: Finish) -> str:
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


class BlockBuilder:
    """Groups pipeline items into content blocks; feed() returns the stream events they cause
    (as payloads whose `type` is also the SSE event name)."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.finish: Optional[Finish] = None
        self._open: Optional[dict[str, Any]] = None  # the text or thinking block being written

    def feed(self, item: Item) -> list[dict[str, Any]]:
        if isinstance(item, TextDelta):
            kind = "text" if item.channel == "content" else "thinking"
            opened = self._open is not None and self._open["type"] == kind
            return ([] if opened else self._close() + self._start(kind)) + self._append(item.text)
        if isinstance(item, ToolCall):
            return self._close() + self._tool_use(item)
        if isinstance(item, Finish):
            self.finish = item
            return self._close()
        return []

    def _start(self, kind: str) -> list[dict[str, Any]]:
        block = {"type": "text", "text": ""} if kind == "text" else \
            {"type": "thinking", "thinking": "", "signature": ""}
        self._open = block
        self.content.append(block)
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]

    def _append(self, text: str) -> list[dict[str, Any]]:
        assert self._open is not None
        field = self._open["type"]  # "text" or "thinking": the delta's field has the same name
        self._open[field] += text
        return [{"type": "content_block_delta", "index": len(self.content) - 1,
                 "delta": {"type": f"{field}_delta", field: text}}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _tool_use(self, call: ToolCall) -> list[dict[str, Any]]:
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                 "input": json.loads(call.arguments)}
        self.content.append(block)
        index = len(self.content) - 1
        return [{"type": "content_block_start", "index": index, "content_block": dict(block, input={})},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index}]


class MessageShell:
    """The message around the content: id, model, stop reason, usage; and its stream frame."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.prompt_tokens = prompt_tokens

    def message(self, content: list[dict[str, Any]], reason: Optional[str], sequence: Optional[str],
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def final(self, builder: BlockBuilder) -> dict[str, Any]:
        finish = builder.finish
        assert finish is not None, "a generation always ends with Finish"
        return self.message(builder.content, stop_reason(finish), finish.stop_sequence,
                            usage_dict(finish.usage))

    def start_event(self) -> str:
        """message_start: the prompt's size is known, how much of it the cache holds is not yet."""
        usage = usage_dict(Usage(prompt_tokens=self.prompt_tokens, completion_tokens=0))
        return sse_event("message_start", {"type": "message_start",
                                           "message": self.message([], None, None, usage)})

    def closing_events(self, builder: BlockBuilder) -> list[str]:
        final = self.final(builder)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
                 "usage": final["usage"]}
        return [sse_event("message_delta", delta), sse_event("message_stop", {"type": "message_stop"})]

    def error_events(self, error: ApiError) -> list[str]:
        return [sse_event("error", error_body(error))]
