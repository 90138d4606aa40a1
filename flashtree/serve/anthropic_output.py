"""What a Messages response is made of: content blocks, stream events, usage, stop reason, errors.

The serving pipeline yields text deltas (content or reasoning), complete tool calls and a
Finish; api_common.OutputAssembler groups them into blocks as on every surface, and here they
become Anthropic content blocks (text, thinking, tool_use). One builder serves both the JSON
response and the stream, so the two cannot disagree. The stream is the SDK's exact grammar:
message_start, then per block content_block_start, content_block_delta (text_delta /
thinking_delta / input_json_delta), content_block_stop, then message_delta (stop_reason,
stop_sequence, cumulative usage) and message_stop.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from fastapi.responses import JSONResponse

from .api_common import OutputAssembler, anthropic_usage, new_id
from .errors import ApiError
from .pipeline import Finish, Usage
from .reasoning import CONTENT
from .streaming import sse_event
from .toolcalls import ToolCall

# HTTP status -> Anthropic error type (the SDK raises by status; Claude Code reads the type)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
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


def stop_reason(finish: Finish) -> str:
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


class BlockBuilder(OutputAssembler[dict[str, Any]]):
    """Content blocks (text, thinking, tool_use) and the stream events that build them, as
    payloads whose `type` is also the SSE event name."""

    def __init__(self) -> None:
        super().__init__()
        self.content: list[dict[str, Any]] = []

    def open(self, channel: str) -> list[dict[str, Any]]:
        block = {"type": "text", "text": ""} if channel == CONTENT else \
            {"type": "thinking", "thinking": "", "signature": ""}
        self.content.append(block)
        return [{"type": "content_block_start", "index": len(self.content) - 1,
                 "content_block": dict(block)}]

    def extend(self, channel: str, text: str) -> list[dict[str, Any]]:
        block = self.content[-1]
        field = block["type"]  # "text" or "thinking": the delta's field has the same name
        block[field] += text
        return [{"type": "content_block_delta", "index": len(self.content) - 1,
                 "delta": {"type": f"{field}_delta", field: text}}]

    def close(self, channel: str) -> list[dict[str, Any]]:
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        """A tool_use block. Its `input` is the call's arguments read back: toolcalls.parse_block
        only makes calls whose arguments are within json_text's bounds with no NaN or Infinity,
        so this read cannot fail and the message's allow_nan=False serializer takes the value."""
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
        self.id = new_id("msg_")
        self.model = model
        self.prompt_tokens = prompt_tokens

    def message(self, content: list[dict[str, Any]], reason: Optional[str], sequence: Optional[str],
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def final(self, builder: BlockBuilder) -> dict[str, Any]:
        finish = builder.finished
        return self.message(builder.content, stop_reason(finish), finish.stop_sequence,
                            anthropic_usage(finish.usage))

    def start_event(self) -> str:
        """message_start: the prompt's size is known, how much of it the cache holds is not yet."""
        usage = anthropic_usage(Usage(prompt_tokens=self.prompt_tokens, completion_tokens=0))
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
