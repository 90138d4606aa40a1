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
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .api_common import (ApiRoute, CallLedger, OutputAssembler, assistant_message, chat_tool_call,
                         check_json_text, check_unique, effort_thinking, function_tool, max_tool_calls,
                         new_id, refuse_unsupported, responses_usage, tool_choice_name)
from .chat import content_text
from .context import ServeContext, serve_context
from .errors import ERROR_RESPONSES, ApiError, reject
from .logprobs import Logprobs, TokenText, chat_logprobs
from .pipeline import GenerationSpec, Item, generate
from .prompting import chat_prompt, chat_spec, logprob_fields
from .reasoning import CONTENT, REASONING
from .schemas import (MAX_TOOL_NAME, FunctionCallItem, FunctionCallOutputItem, InputMessage, ResponsesRequest,
                      ResponsesTool)
from .streaming import collect, sse_event, sse_response, started
from .structured import ToolSpec, format_grammar, request_grammar
from .toolcalls import ToolCall

router = APIRouter(route_class=ApiRoute)
Event = tuple[str, dict[str, Any]]  # an SSE event's name and payload
LOGPROBS_INCLUDE = "message.output_text.logprobs"


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
            call = chat_tool_call(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant_message("", calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else content_text(
                [p.model_dump() for p in item.output])
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _function_tools(body: ResponsesRequest) -> list[tuple[int, ResponsesTool]]:
    """The request's function tools with their places in `tools` (the others are not served; a
    nameless one is a 400 on the route, _check_tool_items)."""
    return [(i, t) for i, t in enumerate(body.tools or []) if t.type == "function" and t.name]


def _tools(body: ResponsesRequest) -> Optional[list[dict[str, Any]]]:
    tools = [function_tool(t.name, t.description, t.parameters or {"type": "object", "properties": {}})
             for _, t in _function_tools(body)]
    return tools or None


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any]:
    effort = body.reasoning.effort if body.reasoning else None
    return {**effort_thinking(effort), **(body.chat_template_kwargs or {})}


def _refuse_unsupported(body: ResponsesRequest) -> None:
    for stored in ("previous_response_id", "conversation"):
        reject(getattr(body, stored) is not None,
               f"{stored} is not supported: responses are not stored; send the whole input", stored)
    refuse_unsupported([
        ("prompt", body.prompt is not None, "prompt templates"),
        ("background", bool(body.background), "background mode")])


def _check_tool_items(body: ResponsesRequest) -> None:
    """A function tool has a name of 1 to MAX_TOOL_NAME characters (as in chat), unique among the
    function tools, and a function call's `call_id` is unique in the input: a function_call_output
    finds its call by that id alone, wherever it stands before it (one that answers no call is a
    400, as in OpenAI's API: CallLedger). Left unchecked, a function tool without a name was
    dropped, and one declared twice was the last one's."""
    names: list[Optional[str]] = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            names.append(None)
            continue
        reject(not tool.name or len(tool.name) > MAX_TOOL_NAME,
               f"tools.{i}.name: a function tool needs a name of 1 to {MAX_TOOL_NAME} characters, found "
               f"{'none' if tool.name is None else len(tool.name)}", f"tools.{i}.name")
        names.append(tool.name)
    check_unique(names, "tool name", lambda i: f"tools.{i}.name")
    items = body.input if isinstance(body.input, list) else []
    check_unique([item.call_id if isinstance(item, FunctionCallItem) else None for item in items],
                 "function call id", lambda i: f"input.{i}.call_id")
    calls = CallLedger(lambda id: f"No tool call found for function call output with call_id {id}")
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls.called([item.call_id])
        elif isinstance(item, FunctionCallOutputItem):
            calls.answers(item.call_id, f"input.{i}.call_id")


def _top_logprobs(body: ResponsesRequest) -> Optional[int]:
    """How many alternatives per token the output text's logprobs have; None: no logprobs
    (asked for with `include: ["message.output_text.logprobs"]`, or by `top_logprobs`)."""
    if body.top_logprobs or LOGPROBS_INCLUDE in (body.include or []):
        return body.top_logprobs or 0
    return None


def _spec(ctx: ServeContext, body: ResponsesRequest, messages: list[dict[str, Any]]) -> GenerationSpec:
    for i, item in enumerate(body.input if isinstance(body.input, list) else []):
        if isinstance(item, FunctionCallItem):
            check_json_text(item.arguments, f"input.{i}.arguments")
    choice = tool_choice_name(body.tool_choice)
    answer = format_grammar(body.text.format if body.text else None, "text.format",
                            ctx.templates.check_grammar)
    prompt = chat_prompt(ctx, messages, _tools(body), choice, _template_kwargs(body), structured=answer is not None)
    specs = [ToolSpec(t.name, t.parameters, t.strict is True, f"tools.{i}.parameters")
             for i, t in _function_tools(body)]
    max_calls = max_tool_calls(body.parallel_tool_calls)
    grammar = request_grammar(ctx, answer, "text.format", specs, choice, max_calls)
    sampling = {**body.sampling_dict(), **logprob_fields(None, _top_logprobs(body))}
    return chat_spec(ctx, prompt, sampling, body.max_output_tokens, [], body.ignore_eos,
                     max_calls, grammar)


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    ctx = serve_context(request)
    _refuse_unsupported(body)
    _check_tool_items(body)
    messages = _messages(body)
    reject(not messages, "input is empty", "input")
    spec = await asyncio.to_thread(_spec, ctx, body, messages)
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    shell = _ResponseShell(ctx.model_name, body)
    texts = TokenText(ctx.tokenizer) if _top_logprobs(body) is not None else None
    if body.stream:
        return sse_response(_events(items, shell, texts), shell.error_events, items)
    builder = _OutputBuilder(texts)
    for item in await collect(request, items):
        builder.feed(item)
    return JSONResponse(shell.final(builder))


class _ResponseShell:
    """The response object around the output: id, model, echoed settings, status, usage."""

    def __init__(self, model: str, body: ResponsesRequest):
        self.id = new_id("resp_")
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
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature, "top_p": body.top_p,
                "max_output_tokens": body.max_output_tokens, "previous_response_id": None,
                "metadata": {}, "text": {"format": _format_echo(body)}}

    def final(self, builder: "_OutputBuilder") -> dict[str, Any]:
        finish = builder.finished
        usage = responses_usage(finish.usage)
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


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's text.format as the response echoes it."""
    fmt = body.text.format if body.text else None
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


class _OutputBuilder(OutputAssembler[Event]):
    """Output items (reasoning, message, function_call) and the events that build them.

    With `texts` (logprobs asked for) each output_text part has the logprobs of its tokens; a
    stream sends them in output_text.delta events of their own, with an empty delta. Tokens that
    arrive while reasoning is written are reasoning's, not the text's; those that arrive with no
    block open wait for the next text part (text the tool-call parser held back)."""

    def __init__(self, texts: Optional[TokenText] = None) -> None:
        super().__init__()
        self.output: list[dict[str, Any]] = []
        self._texts = texts
        self._waiting: list[dict[str, Any]] = []  # logprobs of tokens not in any block yet

    def feed(self, item: Item) -> list[Event]:
        if not isinstance(item, Logprobs):
            return super().feed(item)
        if self._texts is None or self._open == REASONING:
            return []
        entries = chat_logprobs(item.entries, self._texts)["content"]
        if self._open != CONTENT:
            self._waiting += entries
            return []
        message = self.output[-1]
        message["content"][0]["logprobs"] += entries
        return [("response.output_text.delta", {"item_id": message["id"], "output_index": self._index(),
                                                "content_index": 0, "delta": "", "logprobs": entries})]

    def _index(self) -> int:
        return len(self.output) - 1

    def open(self, channel: str) -> list[Event]:
        if channel == CONTENT:
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
        self.output.append(item)
        events = [("response.output_item.added", {"output_index": self._index(), "item": dict(item, content=[])})]
        if channel == CONTENT:
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            if self._texts is not None:
                part["logprobs"], self._waiting = self._waiting, []
            item["content"].append(part)
            events.append(("response.content_part.added", {"item_id": item["id"], "output_index": self._index(),
                                                           "content_index": 0, "part": dict(part)}))
        else:
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def extend(self, channel: str, text: str) -> list[Event]:
        item = self.output[-1]
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if channel == CONTENT else "response.reasoning_text.delta"
        return [(name, {"item_id": item["id"], "output_index": self._index(), "content_index": 0, "delta": text})]

    def close(self, channel: str) -> list[Event]:
        item = self.output[-1]
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        part = item["content"][0]
        if channel == CONTENT:
            item["status"] = "completed"
            done = {**where, "text": part["text"], **({"logprobs": part["logprobs"]} if "logprobs" in part else {})}
            events = [("response.output_text.done", done),
                      ("response.content_part.done", {**where, "part": dict(part)})]
        else:
            events = [("response.reasoning_text.done", {**where, "text": part["text"]})]
        return events + [("response.output_item.done", {"output_index": self._index(), "item": item})]

    def call(self, call: ToolCall) -> list[Event]:
        self._waiting = []  # the call's own tokens
        item = {"id": new_id("fc_"), "type": "function_call", "status": "completed",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self._index()}
        return [("response.output_item.added", {"output_index": self._index(),
                                                "item": dict(item, arguments="", status="in_progress")}),
                ("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
                ("response.function_call_arguments.done", {**where, "arguments": call.arguments}),
                ("response.output_item.done", {"output_index": self._index(), "item": item})]


async def _events(items: AsyncIterator[Item], shell: _ResponseShell,
                  texts: Optional[TokenText] = None) -> AsyncIterator[str]:
    yield shell.event("response.created", {"response": shell.obj("in_progress", [])})
    yield shell.event("response.in_progress", {"response": shell.obj("in_progress", [])})
    builder = _OutputBuilder(texts)
    async for item in items:
        for name, payload in builder.feed(item):
            yield shell.event(name, payload)
    final = shell.final(builder)
    name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield shell.event(name, {"response": final})
