"""/v1/chat/completions, /v1/completions and /v1/models in OpenAI's wire format.

Streaming follows the rules clients depend on: every chunk has the same id, the first delta
carries the role, tool calls arrive as `delta.tool_calls` (index, id and name first, then the
argument text), the last choice chunk carries finish_reason, an optional usage-only chunk follows
(`stream_options.include_usage`), then `data: [DONE]`. An error after the stream began is an SSE
error object before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .api_common import (ApiRoute, Collected, assistant_message, chat_tool_call, chat_usage,
                         continues_final_message, new_id, tool_choice_name)
from .context import ServeContext, serve_context
from .errors import ERROR_RESPONSES, ApiError, reject
from .pipeline import Finish, Item, TextDelta, generate
from .prompting import chat_spec, stop_list, text_spec
from .reasoning import CONTENT
from .schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from .streaming import SSE_DONE, collect, sse_data, sse_response, started
from .toolcalls import ToolCall

router = APIRouter(route_class=ApiRoute)


def _include_usage(options: Optional[StreamOptions]) -> bool:
    return bool(options and options.include_usage)


# --- chat ------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = serve_context(request)
    reject((body.n or 1) > 1, "n > 1 is not supported", "n")
    reject(bool(body.logprobs), "logprobs are not supported", "logprobs")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    spec = await asyncio.to_thread(
        chat_spec, ctx, messages,
        [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice_name(body.tool_choice), body.chat_template_kwargs, body.sampling_dict(),
        body.max_completion_tokens or body.max_tokens, stop_list(body.stop), body.ignore_eos,
        continue_final=continues_final_message(messages, body.continue_final_message))
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    head = {"id": new_id("chatcmpl-"), "created": int(time.time()), "model": ctx.model_name}
    if body.stream:
        return sse_response(_chat_chunks(items, head, _include_usage(body.stream_options)), _sse_error, items)
    return JSONResponse(_chat_message(await collect(request, items), head))


def _chat_message(items: list[Item], head: dict[str, Any]) -> dict[str, Any]:
    out = Collected(items)
    calls = [chat_tool_call(call.id, call.name, call.arguments) for call in out.calls]
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": assistant_message(out.text, out.reasoning, calls),
                         "logprobs": None, "finish_reason": out.finished.reason}],
            "usage": chat_usage(out.finished.usage)}


async def _chat_chunks(items: AsyncIterator[Item], head: dict[str, Any],
                       include_usage: bool) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    if include_usage:
        base["usage"] = None

    def chunk(delta: dict[str, Any], finish_reason: Optional[str] = None) -> str:
        return sse_data({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish_reason}]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for item in items:
        if isinstance(item, TextDelta):
            key = "content" if item.channel == CONTENT else "reasoning_content"
            yield chunk({key: item.text})
        elif isinstance(item, ToolCall):
            yield chunk({"tool_calls": [{"index": calls, **chat_tool_call(item.id, item.name, "")}]})
            yield chunk({"tool_calls": [{"index": calls, "function": {"arguments": item.arguments}}]})
            calls += 1
        elif isinstance(item, Finish):
            yield chunk({}, item.reason)
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": chat_usage(item.usage)})
    yield SSE_DONE


def _sse_error(error: ApiError) -> list[str]:
    return [sse_data(error.body()), SSE_DONE]


# --- completions -------------------------------------------------------------------------------


def _prompt_ids(ctx: ServeContext, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        reject(len(prompt) != 1, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(prompt)
    return list(prompt)


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = serve_context(request)
    reject((body.n or 1) > 1, "n > 1 is not supported", "n")
    reject(bool(body.echo), "echo is not supported", "echo")
    reject(body.logprobs is not None, "logprobs are not supported", "logprobs")
    reject(bool(body.suffix), "suffix is not supported", "suffix")
    prompt_ids = await asyncio.to_thread(_prompt_ids, ctx, body.prompt)
    spec = text_spec(ctx, prompt_ids, body.sampling_dict(), body.max_tokens, stop_list(body.stop),
                     body.ignore_eos)
    items = await started(request, generate(ctx.supervisor, ctx.tokenizer, spec))
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name}
    if body.stream:
        return sse_response(_completion_chunks(items, head, _include_usage(body.stream_options)),
                            _sse_error, items)
    out = Collected(await collect(request, items))
    return JSONResponse({**head, "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                              "finish_reason": out.finished.reason}],
                         "usage": chat_usage(out.finished.usage)})


async def _completion_chunks(items: AsyncIterator[Item], head: dict[str, Any],
                             include_usage: bool) -> AsyncIterator[str]:
    base = {**head, "usage": None} if include_usage else head

    def chunk(text: str, finish_reason: Optional[str] = None) -> str:
        return sse_data({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                              "finish_reason": finish_reason}]})

    async for item in items:
        if isinstance(item, TextDelta):
            yield chunk(item.text)
        elif isinstance(item, Finish):
            yield chunk("", item.reason)
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": chat_usage(item.usage)})
    yield SSE_DONE


# --- models ------------------------------------------------------------------------------------


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def models(request: Request) -> dict[str, Any]:
    ctx = serve_context(request)
    n_ctx = ctx.max_ctx
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": int(ctx.supervisor.started_at),
        "owned_by": "flashtree", "context_length": n_ctx, "max_model_len": n_ctx,
        "meta": {"n_ctx": n_ctx, "n_vocab": ctx.tokenizer.vocab_size}}]}
