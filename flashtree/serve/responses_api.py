"""/v1/responses: OpenAI's Responses API, the only wire format Codex speaks.

Input items become a chat conversation (`instructions` and every system/developer item merged
into one leading system message, `function_call` items into assistant tool calls,
`function_call_output` items into tool messages) and run through the same pipeline as chat.
Output deltas are grouped into output items (reasoning, message, function_call); streaming emits
the event sequence Codex expects: response.created, response.in_progress, per item
output_item.added ... output_item.done, then response.completed (or response.incomplete when
the token limit cut the answer, response.failed on an error).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .chat import content_text
from .context import serve_context
from .errors import ERROR_RESPONSES, ApiError, reject
from .pipeline import Finish, Item, TextDelta, generate
from .prompting import chat_spec
from .schemas import FunctionCallItem, FunctionCallOutputItem, InputMessage, ResponsesRequest
from .streaming import collect, sse_event, sse_response, started
from .toolcalls import ToolCall

router = APIRouter()
THINKING_EFFORTS = ("low", "medium", "high")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    system = [body.instructions] if body.instructions else []
    messages: list[dict[str, Any]] = []
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, InputMessage):
            text = content_text([p.model_dump() for p in item.content]
                                if isinstance(item.content, list) else item.content)
            if item.role in ("system", "developer"):
                system.append(text)
            else:
                messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else content_text(
                [p.model_dump() for p in item.output])
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _tools(body: ResponsesRequest) -> Optional[list[dict[str, Any]]]:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.parameters or {"type": "object", "properties": {}}}}
             for t in body.tools or [] if t.type == "function" and t.name]
    return tools or None


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any]:
    effort = body.reasoning.effort if body.reasoning else None
    return {"enable_thinking": effort in THINKING_EFFORTS, **(body.chat_template_kwargs or {})}


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    ctx = serve_context(request)
    reject(body.previous_response_id is not None,
            "previous_response_id is not supported: responses are not stored; send the full input",
            "previous_response_id")
    messages = _messages(body)
    reject(not messages, "input is empty", "input")
    choice = body.tool_choice
    spec = await asyncio.to_thread(
        chat_spec, ctx, messages, _tools(body),
        choice.name if choice is not None and not isinstance(choice, str) else choice,
        _template_kwargs(body), body.sampling_dict(), body.max_output_tokens, [], body.ignore_eos)
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    shell = _ResponseShell(ctx.model_name, body)
    if body.stream:
        return sse_response(_events(items, shell), shell.error_events, items)
    builder = _OutputBuilder()
    for item in await collect(request, items):
        builder.feed(item)
    return JSONResponse(shell.final(builder))


class _ResponseShell:
    """The response object around the output: id, model, echoed settings, status, usage."""

    def __init__(self, model: str, body: ResponsesRequest):
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.seq = 0

    def obj(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None,
            error: Optional[dict[str, Any]] = None, incomplete: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        body = self.body
        choice = body.tool_choice
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": incomplete, "instructions": body.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
                else (choice or "auto"),
                "parallel_tool_calls": True, "temperature": body.temperature, "top_p": body.top_p,
                "max_output_tokens": body.max_output_tokens, "previous_response_id": None,
                "metadata": {}, "text": {"format": {"type": "text"}}}

    def final(self, builder: "_OutputBuilder") -> dict[str, Any]:
        finish = builder.finish
        assert finish is not None, "a generation always ends with Finish"
        u = finish.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.total_tokens}
        if finish.reason == "length":
            return self.obj("incomplete", builder.output, usage,
                            incomplete={"reason": "max_output_tokens"})
        return self.obj("completed", builder.output, usage)

    def event(self, name: str, payload: dict[str, Any]) -> str:
        self.seq += 1
        return sse_event(name, {"type": name, "sequence_number": self.seq, **payload})

    def error_events(self, error: ApiError) -> list[str]:
        detail = {"code": error.code or error.type, "message": error.message}
        return [self.event("error", {**detail, "param": error.param}),
                self.event("response.failed", {"response": self.obj("failed", [], error=detail)})]


class _OutputBuilder:
    """Groups deltas into output items; feed() returns the (event, payload) pairs they cause."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.finish: Optional[Finish] = None
        self._open: Optional[dict[str, Any]] = None   # the reasoning or message item being written

    def feed(self, item: Item) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(item, TextDelta):
            kind = "message" if item.channel == "content" else "reasoning"
            events = [] if self._open and self._open["type"] == kind else self._close() + self._start(kind)
            return events + self._append(item.text)
        if isinstance(item, ToolCall):
            return self._close() + self._call(item)
        if isinstance(item, Finish):
            self.finish = item
            return self._close()
        return []

    def _index(self) -> int:
        return len(self.output) - 1

    def _start(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        if kind == "message":
            item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "content": []}
        self._open = item
        self.output.append(item)
        events = [("response.output_item.added", {"output_index": self._index(), "item": dict(item, content=[])})]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            events.append(("response.content_part.added", {"item_id": item["id"], "output_index": self._index(),
                                                           "content_index": 0, "part": dict(part)}))
        else:
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def _append(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        assert self._open is not None
        self._open["content"][0]["text"] += text
        name = "response.output_text.delta" if self._open["type"] == "message" else "response.reasoning_text.delta"
        return [(name, {"item_id": self._open["id"], "output_index": self._index(),
                        "content_index": 0, "delta": text})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        part = item["content"][0]
        if item["type"] == "message":
            item["status"] = "completed"
            events = [("response.output_text.done", {**where, "text": part["text"]}),
                      ("response.content_part.done", {**where, "part": dict(part)})]
        else:
            events = [("response.reasoning_text.done", {**where, "text": part["text"]})]
        return events + [("response.output_item.done", {"output_index": self._index(), "item": item})]

    def _call(self, call: ToolCall) -> list[tuple[str, dict[str, Any]]]:
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "completed",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self._index()}
        return [("response.output_item.added", {"output_index": self._index(),
                                                "item": dict(item, arguments="", status="in_progress")}),
                ("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
                ("response.function_call_arguments.done", {**where, "arguments": call.arguments}),
                ("response.output_item.done", {"output_index": self._index(), "item": item})]


async def _events(items: AsyncIterator[Item], shell: _ResponseShell) -> AsyncIterator[str]:
    yield shell.event("response.created", {"response": shell.obj("in_progress", [])})
    yield shell.event("response.in_progress", {"response": shell.obj("in_progress", [])})
    builder = _OutputBuilder()
    async for item in items:
        for name, payload in builder.feed(item):
            yield shell.event(name, payload)
    final = shell.final(builder)
    name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield shell.event(name, {"response": final})
