"""What the three API surfaces share: OpenAI chat + completions (openai_api), Responses
(responses_api) and Anthropic Messages (anthropic_api).

They differ in how they spell requests and answers, not in what they do, so what they do is here,
once, and a fix to it reaches every surface:

- request handling: each surface's routes are ApiRoutes, which refuse a body outside json_text's
  bounds (text no tokenizer can take, nesting too deep to render) and answer every failure,
  request validation included, in the surface's error shape; `api_error` is the one mapping
  from a failure to its ApiError; `check_json_text` holds a field of JSON sent as text (tool-call
  arguments) to the same bounds;
- the conversation in OpenAI chat form, which every surface translates its request into: function
  tools, tool calls, assistant turns, named tool choices, and whether a final assistant message
  is continued (the prompt left open inside it) or answered by a new turn;
- what a request may ask for: fields no surface honours yet are a 400 saying so, never ignored;
  parallel tool calls turned off, and a reasoning effort, mean the same on every surface;
- the output: OutputAssembler groups what the generation pipeline yields into the blocks all three
  present (content text, reasoning, tool calls); Collected is all of it, for a non-streamed answer;
- usage: the pipeline's token counts (prompt, completion, cached) as each surface names them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any, Callable, Coroutine, Generic, Iterable, Optional, TypeVar, Union

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from ..errors import FlashtreeError
from .errors import ApiError, quoted, to_api_error
from .json_text import (MAX_DEPTH, JsonTextError, count_containers, decode_bounded, first_problem, parse_json_text,
                        path_text)
from .logprobs import Logprobs, TokenLogprob
from .pipeline import Finish, Item, TextDelta, Usage
from .reasoning import CONTENT, REASONING
from .schemas import NamedToolChoice, ResponsesNamedChoice
from .toolcalls import ToolCall
from .validation_errors import validation_error

log = logging.getLogger("flashtree.serve")
E = TypeVar("E")
# UTF-8 cannot encode a surrogate, so a lone one reaches a decoded body only through a JSON escape,
# and a body cannot nest deeper than it has brackets: a body with neither needs no closer look
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# What a number outside json_text's bounds needs in the raw body: NaN or Infinity, an exponent of
# three digits, or a run of 200 digits: an integer past int()'s digits, or a float past its range
# (1.8e308) with an exponent of two digits at most, which takes 210 digits before its point
NUMBER_RISK = re.compile(rb"NaN|Infinity|\d{200}|[eE][+-]?\d{3}")
# JSON objects and arrays a request body may hold: the routes' models validate a body on the
# event loop, where 600,000 small messages held every request, /health included, for seconds;
# a conversation that fills any context holds far fewer
MAX_BODY_CONTAINERS = 100_000
THINKING_EFFORTS = ("low", "medium", "high", "xhigh")


def new_id(prefix: str) -> str:
    """A fresh id in the style of the surface's own (`chatcmpl-...`, `resp_...`, `msg_...`)."""
    return prefix + uuid.uuid4().hex


# --- request handling --------------------------------------------------------------------------


# the field a route's prompt comes in (what a prompt too long for the context names); the others'
# is `messages` (chat, Anthropic's messages and their token counts)
PROMPT_FIELDS = {"/v1/completions": "prompt", "/v1/responses": "input"}


def api_error(exc: Exception, request: Request) -> ApiError:
    """What a request that failed with `exc` is answered with. An unexpected failure is logged
    with its traceback: it is a bug of this server, not of the request."""
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    if isinstance(exc, HTTPException):  # Starlette's own refusals: no such route, an unreadable body
        if exc.status_code == 404:
            message, code = f"unknown route {request.method} {request.url.path}", "not_found"
        elif isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI says only "error parsing the body"
            bad = exc.__cause__
            message = f"the request body is not UTF-8 text: {bad.reason} at byte offset {bad.start}"
            code = None
        else:
            message, code = str(exc.detail), None
        return ApiError(exc.status_code, message, "invalid_request_error", code,
                        headers=dict(exc.headers or {}))
    if not isinstance(exc, (ApiError, FlashtreeError)):
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return to_api_error(exc, PROMPT_FIELDS.get(request.url.path, "messages"))


async def _body_error(request: Request) -> Optional[ApiError]:
    """A 400 naming the first place of the JSON body outside json_text's bounds (a lone UTF-16
    surrogate, which JavaScript strings may hold, nesting deeper than MAX_DEPTH, or a number that
    is NaN or infinite: the Responses API writes back the tools and formats it was sent, and an
    answer cannot hold such a number), a 400 saying which bound for a body the decoder itself
    refuses (an integer of more digits than int() converts, nesting past the recursion limit),
    or a 413
    for a body of more than MAX_BODY_CONTAINERS objects and arrays; None if the body is within
    them, or is not JSON the decoder takes (the route's own parsing says so). A body sent with a
    Content-Encoding (gzip, ...) is a 415: it is never decompressed, so the route would read the
    compressed bytes as JSON and answer only that they do not parse. The body is
    decoded and walked in a worker thread, and left decoded on the request (Starlette's cache
    of request.json(), which the route reads), so that a body of millions of values holds up
    neither other requests nor /health while it is read."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        return ApiError(415, f"Content-Encoding {quoted(encoding)} is not supported: send the body uncompressed")
    raw = await request.body()
    brackets = raw.count(b"[") + raw.count(b"{")  # at least the body's arrays and objects
    if not SURROGATE_ESCAPE.search(raw) and brackets <= MAX_DEPTH and not NUMBER_RISK.search(raw):
        return None
    try:
        body = await asyncio.to_thread(decode_bounded, raw)
    except JsonTextError as e:
        return ApiError(400, f"the request body {e}")
    except ValueError:  # not JSON: the route says so
        return None
    request._json = body  # what request.json() returns from now on: the route decodes nothing again
    if brackets > MAX_BODY_CONTAINERS and await asyncio.to_thread(count_containers, body) > MAX_BODY_CONTAINERS:
        return ApiError(413, f"the request body holds more than {MAX_BODY_CONTAINERS} JSON objects and arrays")
    problem = await asyncio.to_thread(first_problem, body, True)
    if problem is None:
        return None
    where = path_text(problem[0])
    return ApiError(400, f"{where or 'the request body'}: {problem[1]}", param=where or None)


def check_json_text(value: Any, param: str) -> None:
    """A 400 naming `param` when `value`, a field of JSON sent as text (tool-call `arguments`),
    is outside json_text's bounds. The field is kept as sent (chat.py parses it again to render
    it), and text that is not JSON at all is taken as text, which the chat templates print as is."""
    if not isinstance(value, str):
        return
    try:
        parse_json_text(value)
    except JsonTextError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    except ValueError:
        pass


class ApiRoute(APIRoute):
    """A route of an API surface. Its body is checked against json_text's bounds before the
    handler runs, and every failure is answered by `render_error`, as a response: an exception
    left to the server would be a bare 500 and would close the client's connection. Subclasses
    set `render_error` to their surface's error shape (this one is OpenAI's)."""

    render_error: Callable[[ApiError], Response] = staticmethod(ApiError.response)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                error = await _body_error(request)
                return self.render_error(error) if error else await handler(request)
            except Exception as exc:
                return self.render_error(api_error(exc, request))

        return route


# --- the conversation in chat form -----------------------------------------------------------------


def function_tool(name: str, description: Optional[str],
                  parameters: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A tool as the chat template receives it."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters}}


def chat_tool_call(call_id: Optional[str], name: str, arguments: Any) -> dict[str, Any]:
    """A tool call in chat form: in an assistant turn of the prompt, and in a chat answer."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(content: str, reasoning: str = "",
                      calls: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """An assistant turn in chat form; its content is None when it is only tool calls (as OpenAI
    answers), and the reasoning and tool-call fields are there only when they say something."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def tool_choice_name(choice: Union[None, str, NamedToolChoice, ResponsesNamedChoice]) -> Optional[str]:
    """`tool_choice` as chat_spec takes it (None, auto, none, required or a function name) from
    either OpenAI spelling of a named function (chat nests the name, Responses does not)."""
    if choice is None or isinstance(choice, str):
        return choice
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice.name


def continues_final_message(messages: list[dict[str, Any]], requested: Optional[bool] = None) -> bool:
    """Whether the prompt ends inside the final message, for the model to continue its text,
    instead of opening a new assistant turn after it. Clients prefill the start of an answer
    this way (Claude clients always; vLLM's `continue_final_message`), so unless `requested` says
    otherwise a final assistant message without tool calls is continued; asking for it when
    there is no such message is a 400."""
    last = messages[-1] if messages else {}
    open_text = last.get("role") == "assistant" and not last.get("tool_calls")
    if requested and not open_text:
        raise ApiError(400, "continue_final_message needs a conversation that ends with an assistant "
                            "message without tool calls", param="continue_final_message")
    return open_text if requested is None else requested


def check_unique(values: list[Optional[str]], what: str, param: Callable[[int], str]) -> None:
    """A 400 naming `param(i)` for the first of `values` that an earlier one repeats (None repeats
    nothing). Tool names say which function a call runs and tool-call ids which call a result
    answers: one of them twice leaves that to chance (the last tool of a name would win, a
    result would answer two calls), so `what` ("tool name", ...) is refused on every surface."""
    seen: set[str] = set()
    for i, value in enumerate(values):
        if value is None:
            continue
        if value in seen:
            where = param(i)
            raise ApiError(400, f"{where}: {what} {quoted(value)} appears twice; each must be unique", param=where)
        seen.add(value)


class CallLedger:
    """The ids of the tool calls a conversation has made so far, walked in order: a tool result
    must answer one of them (`refusal` words the 400 after the quoted id, as the surface's real
    API words it). A result of no call was taken, and the model read the outcome of a call it
    never made (a mistyped id, a client that lost its call); OpenAI and Anthropic refuse it. They
    also want the call in the turn just before; an earlier one is enough here, so that a client's
    note between a call and its result still runs."""

    def __init__(self, refusal: Callable[[str], str]):
        self.ids: set[str] = set()
        self.refusal = refusal

    def called(self, ids: Iterable[Optional[str]]) -> None:
        self.ids.update(i for i in ids if i is not None)

    def answers(self, call_id: str, where: str) -> None:
        if call_id not in self.ids:
            raise ApiError(400, f"{where}: {self.refusal(quoted(call_id))}", param=where)


# --- what a request may ask for ---------------------------------------------------------------------


def refuse_unsupported(fields: Iterable[tuple[str, bool, str]]) -> None:
    """400 `unsupported_parameter` for the first (param, present, what) whose field is present:
    a field this server cannot honour yet (structured output, n > 1, ...). Left
    unread it would be a 200 that is not what was asked for, which a client cannot tell."""
    for param, present, what in fields:
        if present:
            raise ApiError(400, f"{what} is not supported yet by this server: remove `{param}` from "
                                "the request", code="unsupported_parameter", param=param)


def max_tool_calls(parallel: Optional[bool]) -> Optional[int]:
    """How many tool calls an answer may make: one when the client turned parallel calls off
    (OpenAI's `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use: true`), else
    no limit. The model is not asked to make fewer: the output ends after its first call (the
    engine is cancelled, like at a stop string), so a second call is never returned."""
    return 1 if parallel is False else None


def effort_thinking(effort: Optional[str]) -> dict[str, Any]:
    """The template variables for an OpenAI `reasoning_effort` / `reasoning.effort`: low, medium
    and high turn the template's thinking on, anything else (minimal, none) off; unset, nothing."""
    return {} if effort is None else {"enable_thinking": effort in THINKING_EFFORTS}


# --- output ------------------------------------------------------------------------------------


class OutputAssembler(Generic[E]):
    """Groups a generation's items into the blocks every surface presents: a block opens when the
    kind of text changes (content, reasoning), each delta extends it, and it closes before the
    next block or at the end; a tool call is a block of its own. feed() returns what the items
    cause on the surface (its stream events), from the hooks a surface implements; one
    assembler serves a surface's streamed and whole answers, so the two cannot disagree."""

    def __init__(self) -> None:
        self.finish: Optional[Finish] = None
        self._open: Optional[str] = None  # the channel of the block being written

    def feed(self, item: Item) -> list[E]:
        if isinstance(item, TextDelta):
            events = [] if item.channel == self._open else self._close() + self._start(item.channel)
            return events + self.extend(item.channel, item.text)
        if isinstance(item, ToolCall):
            return self._close() + self.call(item)
        if isinstance(item, Finish):
            self.finish = item
            return self._close()
        return []  # Started

    @property
    def finished(self) -> Finish:
        assert self.finish is not None, "a generation always ends with Finish"
        return self.finish

    def _start(self, channel: str) -> list[E]:
        self._open = channel
        return self.open(channel)

    def _close(self) -> list[E]:
        channel, self._open = self._open, None
        return [] if channel is None else self.close(channel)

    def open(self, channel: str) -> list[E]:
        """A block of `channel` (CONTENT or REASONING) begins."""
        return []

    def extend(self, channel: str, text: str) -> list[E]:
        """The open block, of `channel`, goes on with `text`."""
        raise NotImplementedError

    def close(self, channel: str) -> list[E]:
        """The open block, of `channel`, is complete."""
        return []

    def call(self, call: ToolCall) -> list[E]:
        """A complete tool call, a block of its own."""
        raise NotImplementedError


class Collected(OutputAssembler[None]):
    """The whole output of a generation, for an answer that is not streamed."""

    def __init__(self, items: Iterable[Item]):
        super().__init__()
        self._parts: dict[str, list[str]] = {CONTENT: [], REASONING: []}
        self.calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []  # of every token of the answer, when asked for
        for item in items:
            if isinstance(item, Logprobs):
                self.logprobs.extend(item.entries)
            self.feed(item)

    @property
    def text(self) -> str:
        return "".join(self._parts[CONTENT])

    @property
    def reasoning(self) -> str:
        return "".join(self._parts[REASONING])

    def extend(self, channel: str, text: str) -> list[None]:
        self._parts[channel].append(text)
        return []

    def call(self, call: ToolCall) -> list[None]:
        self.calls.append(call)
        return []


# --- usage ----------------------------------------------------------------------------------------


def chat_usage(usage: Usage) -> dict[str, Any]:
    """Chat and completions: cached prompt tokens are a part of the prompt tokens."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def responses_usage(usage: Usage) -> dict[str, Any]:
    """Responses: the chat counts renamed input/output (reasoning is not counted apart); nothing
    is written to a cache on request (as in anthropic_usage), so cache_write_tokens is 0."""
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from the cache apart from the ones it processed
    (input_tokens); nothing is written to a cache on request, so cache creation is 0."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}
