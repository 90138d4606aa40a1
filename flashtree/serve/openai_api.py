"""/v1/chat/completions, /v1/completions and /v1/models in OpenAI's wire format.

Streaming follows the rules clients depend on: every chunk has the same id, the first delta
carries the role, tool calls arrive as `delta.tool_calls` (index, id and name first, then the
argument text), the last choice chunk carries finish_reason, an optional usage-only chunk follows
(`stream_options.include_usage`), then `data: [DONE]`. An error after the stream began is an SSE
error object before `[DONE]`.

A chat request with `flashtree_trace: true` (flashtree's extension, for the chat page) also
gets a top-level `flashtree` field: `{"steps": [...]}` on chunks of their own (an empty delta),
`{"stats": {...}}` on the finish_reason chunk, both in a whole response; decoder_trace.py says
what they hold. Without it nothing of this is computed or sent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .api_common import (ApiRoute, CallLedger, Collected, assistant_message, chat_tool_call, chat_usage,
                         check_json_text, check_unique, continues_final_message, effort_thinking,
                         max_tool_calls, new_id, refuse_unsupported, tool_choice_name)
from .context import ServeContext, serve_context
from .decoder_trace import DecodeSteps, answer_stats
from .errors import ERROR_RESPONSES, ApiError, quoted, reject
from .logprobs import Logprobs, TokenText, chat_logprobs, completion_logprobs
from .pipeline import Finish, GenerationSpec, Item, TextDelta, generate
from .prompting import chat_prompt, chat_spec, logprob_fields, stop_list, text_prompt_ids, text_spec
from .reasoning import CONTENT
from .schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse, StreamOptions
from .structured import ToolSpec, format_grammar, request_grammar
from .streaming import SSE_DONE, collect, sse_data, sse_response, started
from .toolcalls import ToolCall

router = APIRouter(route_class=ApiRoute)


def _include_usage(options: Optional[StreamOptions]) -> bool:
    return bool(options and options.include_usage)


# --- chat ------------------------------------------------------------------------------------


def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    audio = body.audio is not None or any(m != "text" for m in body.modalities or [])
    refuse_unsupported([
        ("n", (body.n or 1) > 1, "more than one choice (n > 1)"),
        ("functions", bool(body.functions) or body.function_call is not None,
         "legacy function calling (use `tools` and `tool_choice`)"),
        ("modalities", audio, "audio output"),
        ("web_search_options", body.web_search_options is not None, "web search")])


def _check_tool_turns(body: ChatCompletionRequest) -> None:
    """What ties tools, calls and results together: function names unique in `tools`, each call
    of an assistant turn its own id, and a tool message the id of a call an earlier assistant
    message made (OpenAI's API requires it; without one the result answers no call the model
    made: CallLedger)."""
    check_unique([t.function.name for t in body.tools or []], "tool name", lambda i: f"tools.{i}.function.name")
    calls = CallLedger(lambda id: f"{id} is the id of no tool call of an earlier assistant message: messages with "
                                  "role 'tool' must be a response to a preceding message with 'tool_calls'")
    for i, message in enumerate(body.messages):
        check_unique([call.id for call in message.tool_calls or []], "tool call id",
                     lambda j: f"messages.{i}.tool_calls.{j}.id")
        if message.role == "assistant":
            calls.called(call.id for call in message.tool_calls or [])
        elif message.role == "tool":
            reject(not message.tool_call_id,
                   f"messages.{i}.tool_call_id: a tool message needs the id of the tool call it answers",
                   f"messages.{i}.tool_call_id")
            calls.answers(message.tool_call_id, f"messages.{i}.tool_call_id")


def _chat_spec(ctx: ServeContext, body: ChatCompletionRequest) -> GenerationSpec:
    for i, message in enumerate(body.messages):
        for j, call in enumerate(message.tool_calls or []):
            check_json_text(call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    kwargs = {**effort_thinking(body.reasoning_effort), **(body.chat_template_kwargs or {})}
    reject(body.top_logprobs is not None and not body.logprobs, "top_logprobs needs `logprobs: true`",
           "top_logprobs")
    choice = tool_choice_name(body.tool_choice)
    answer = format_grammar(body.response_format, "response_format", ctx.templates.check_grammar)
    prompt = chat_prompt(ctx, messages, tools, choice, kwargs,
                         continues_final_message(messages, body.continue_final_message), answer is not None)
    specs = [ToolSpec(t.function.name, t.function.parameters, bool(t.function.strict), f"tools.{i}.function.parameters")
             for i, t in enumerate(body.tools or [])]
    max_calls = max_tool_calls(body.parallel_tool_calls)
    grammar = request_grammar(ctx, answer, "response_format", specs, choice, max_calls)
    sampling = {**body.sampling_dict(),
                **logprob_fields(body.logit_bias, (body.top_logprobs or 0) if body.logprobs else None)}
    spec = chat_spec(ctx, prompt, sampling, body.max_completion_tokens or body.max_tokens,
                     stop_list(body.stop), body.ignore_eos, max_calls, grammar)
    spec.trace = body.flashtree_trace
    return spec


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = serve_context(request)
    _refuse_unsupported_chat(body)
    _check_tool_turns(body)
    spec = await asyncio.to_thread(_chat_spec, ctx, body)
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    head = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": ctx.model_name}
    texts = TokenText(ctx.tokenizer) if body.logprobs else None
    if body.stream:
        return sse_response(_chat_chunks(items, head, _include_usage(body.stream_options), texts,
                                         body.flashtree_trace), _sse_error, items)
    return JSONResponse(_chat_message(await collect(request, items), head, texts, body.flashtree_trace))


def _chat_message(items: list[Item], head: dict[str, Any], texts: Optional[TokenText] = None,
                  trace: bool = False) -> dict[str, Any]:
    """`texts` is given when the request asked for logprobs (of the tokens Logprobs items carry)."""
    out = Collected(items)
    calls = [chat_tool_call(call.id, call.name, call.arguments) for call in out.calls]
    logprobs = chat_logprobs(out.logprobs, texts) if texts is not None else None
    message = {**head, "object": "chat.completion",
               "choices": [{"index": 0, "message": assistant_message(out.text, out.reasoning, calls),
                            "logprobs": logprobs, "finish_reason": out.finished.reason}],
               "usage": chat_usage(out.finished.usage)}
    if trace:
        steps = [step for item in items if isinstance(item, DecodeSteps) for step in item.steps]
        message["flashtree"] = {"steps": steps, "stats": answer_stats(out.finished.stats)}
    return message


async def _chat_chunks(items: AsyncIterator[Item], head: dict[str, Any], include_usage: bool,
                       texts: Optional[TokenText] = None, trace: bool = False) -> AsyncIterator[str]:
    """Logprobs, when asked for, arrive in chunks of their own (an empty delta), once the tokens
    they belong to are known to be part of the answer; so do a traced request's steps."""
    base = {**head, "object": "chat.completion.chunk"}
    if include_usage:
        base["usage"] = None

    def chunk(delta: dict[str, Any], finish_reason: Optional[str] = None,
              logprobs: Optional[dict[str, Any]] = None, extension: Optional[dict[str, Any]] = None) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}
        return sse_data({**body, "flashtree": extension} if extension is not None else body)

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for item in items:
        if isinstance(item, Logprobs) and texts is not None:
            yield chunk({}, logprobs=chat_logprobs(item.entries, texts))
        elif isinstance(item, DecodeSteps):
            yield chunk({}, extension={"steps": item.steps})
        elif isinstance(item, TextDelta):
            key = "content" if item.channel == CONTENT else "reasoning_content"
            yield chunk({key: item.text})
        elif isinstance(item, ToolCall):
            yield chunk({"tool_calls": [{"index": calls, **chat_tool_call(item.id, item.name, "")}]})
            yield chunk({"tool_calls": [{"index": calls, "function": {"arguments": item.arguments}}]})
            calls += 1
        elif isinstance(item, Finish):
            yield chunk({}, item.reason, extension={"stats": answer_stats(item.stats)} if trace else None)
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": chat_usage(item.usage)})
    yield SSE_DONE


def _sse_error(error: ApiError) -> list[str]:
    return [sse_data(error.body()), SSE_DONE]


# --- completions -------------------------------------------------------------------------------


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = serve_context(request)
    refuse_unsupported([
        ("n", (body.n or 1) > 1, "more than one choice (n > 1)"),
        ("best_of", (body.best_of or 1) > 1, "best_of > 1"),
        ("echo", bool(body.echo), "echo"),
        ("suffix", bool(body.suffix), "suffix (fill in the middle)")])
    prompt_ids = await asyncio.to_thread(text_prompt_ids, ctx, body.prompt)
    sampling = {**body.sampling_dict(), **logprob_fields(body.logit_bias, body.logprobs)}
    spec = text_spec(ctx, prompt_ids, sampling, body.max_tokens, stop_list(body.stop), body.ignore_eos)
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name}
    texts = TokenText(ctx.tokenizer) if body.logprobs is not None else None
    if body.stream:
        return sse_response(_completion_chunks(items, head, _include_usage(body.stream_options), texts),
                            _sse_error, items)
    out = Collected(await collect(request, items))
    logprobs = completion_logprobs(out.logprobs, texts) if texts is not None else None
    return JSONResponse({**head, "choices": [{"index": 0, "text": out.text, "logprobs": logprobs,
                                              "finish_reason": out.finished.reason}],
                         "usage": chat_usage(out.finished.usage)})


async def _completion_chunks(items: AsyncIterator[Item], head: dict[str, Any], include_usage: bool,
                             texts: Optional[TokenText] = None) -> AsyncIterator[str]:
    base = {**head, "usage": None} if include_usage else head

    def chunk(text: str, finish_reason: Optional[str] = None, logprobs: Optional[dict[str, Any]] = None) -> str:
        return sse_data({**base, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish_reason}]})

    async for item in items:
        if isinstance(item, Logprobs) and texts is not None:
            yield chunk("", logprobs=completion_logprobs(item.entries, texts))
        elif isinstance(item, TextDelta):
            yield chunk(item.text)
        elif isinstance(item, Finish):
            yield chunk("", item.reason)
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": chat_usage(item.usage)})
    yield SSE_DONE


# --- models ------------------------------------------------------------------------------------


def _model(ctx: ServeContext) -> dict[str, Any]:
    n_ctx = ctx.max_ctx
    return {"id": ctx.model_name, "object": "model", "created": int(ctx.supervisor.started_at),
            "owned_by": "flashtree", "context_length": n_ctx, "max_model_len": n_ctx,
            "meta": {"n_ctx": n_ctx, "n_vocab": ctx.tokenizer.vocab_size}}


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model(serve_context(request))]}


@router.get("/v1/models/{model_id:path}", responses={**ERROR_RESPONSES, 404: {"model": ErrorResponse}})
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """The served model by its id (the SDKs' `models.retrieve`); any other id is a 404, as OpenAI
    answers, naming the one this server has."""
    ctx = serve_context(request)
    if model_id != ctx.model_name:
        raise ApiError(404, f"the model {quoted(model_id)} does not exist; this server serves {ctx.model_name!r}",
                       code="model_not_found", param="model")
    return _model(ctx)
