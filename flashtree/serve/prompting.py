"""Turn a validated API request into a GenerationSpec: prompt ids, sampling, limits, parsers.

Shared by chat completions, responses and Anthropic messages (which differ only in how they
spell messages and tools) and by completions (raw prompt). Everything that can be refused is
refused here, before the engine is touched: unrenderable conversations, template variables the
template already has, a named tool that was not declared, sampling out of range, and a prompt
that does not fit the context (400 with both numbers), found out without tokenizing more of it
than could fit (prompt_tokens). The text of the request is shielded on its way through the chat
template, so that only the template's own markup becomes control tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..checkpoint import render_chat, render_continuation
from ..checkpoint.chat_template import RENDER_VARIABLES, template_functions
from ..errors import ContextLengthError
from ..sampling_params import SamplingParams
from .chat import template_messages
from .context import ServeContext
from .errors import ApiError, quoted, reject
from .pipeline import GenerationSpec
from .prompt_tokens import COUNT_LIMIT_CONTEXTS, ContentShield, encode_prompt, shield_for
from .reasoning import CLOSE_TAG, prompt_opens_reasoning
from .schemas import MAX_STOP_CHARS, MAX_STOPS
from .structured import RequestGrammar
from .toolcalls import declared_functions, forced_prefix, forces_call

MAX_ID_DIGITS = 18  # a token id's digits at most: no vocabulary comes near 10^18 tokens
# a logit_bias key: ASCII digits only (str.isdecimal and int() also take other scripts' digits)
TOKEN_ID_KEY = re.compile(f"[0-9]{{1,{MAX_ID_DIGITS}}}")
TEMPLATE_FUNCTIONS = template_functions()


def stop_list(stop: Optional[Union[str, list[str]]]) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop strings are supported, got {len(stops)}",
                       param="stop")
    long = [s for s in stops if len(s) > MAX_STOP_CHARS]
    reject(bool(long), f"a stop string has at most {MAX_STOP_CHARS} characters, got one of "
           f"{len(long[0]) if long else 0}", "stop")
    return [s for s in stops if s]


def logprob_fields(logit_bias: Optional[dict[str, float]], logprobs: Optional[int]) -> dict[str, Any]:
    """The SamplingParams fields for OpenAI's `logit_bias` (token ids arrive as the keys of a
    JSON object, so as strings) and for logprobs with `logprobs` alternatives (None: none).
    Values and the vocabulary bound are checked by SamplingParams.validate (the worker knows
    the model's vocabulary); a key of more than MAX_ID_DIGITS digits is no token id of any
    vocabulary, and is refused before int() meets it (which refuses thousands of digits)."""
    fields: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
    if logit_bias:
        bad = [key for key in logit_bias if not TOKEN_ID_KEY.fullmatch(key.strip())]
        reject(bool(bad), f"logit_bias keys must be token ids (non-negative integers in ASCII digits), "
               f"got {quoted(bad[0])}" if bad else "", "logit_bias")
        ids = {int(key): value for key, value in logit_bias.items()}
        reject(len(ids) < len(logit_bias), "logit_bias names one token id twice (e.g. '5' and '05')",
               "logit_bias")
        fields["logit_bias"] = ids
    return fields


def checked_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields after the engine's own range checks (ConfigError -> 400)."""
    SamplingParams(**fields).validate()
    return fields


def _budget(ctx: ServeContext, prompt_len: int, requested: Optional[int]) -> int:
    """max_tokens (the server's --default-max-tokens when the request sets none) clamped to the
    room the context leaves; no room at all is a 400."""
    room = ctx.max_ctx - prompt_len
    if room < 1:
        raise ContextLengthError(prompt_len, ctx.max_ctx)
    limit = requested or ctx.config.default_max_tokens
    return min(limit, room) if limit else room


def text_prompt_ids(ctx: ServeContext, prompt: Any) -> list[int]:
    """A completions prompt as ids: text (a raw prompt: special-token text in it is markup the
    client wrote on purpose, and parsed) or ids as given; one prompt per request."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        reject(len(prompt) != 1, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode_prompt(ctx.tokenizer, prompt, ctx.max_ctx, ctx.max_ctx - 1)
    return list(prompt)


def text_spec(ctx: ServeContext, prompt_ids: list[int], sampling: dict[str, Any],
              max_tokens: Optional[int], stops: list[str], ignore_eos: bool = False) -> GenerationSpec:
    """A raw-prompt generation (completions)."""
    if not prompt_ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= i < vocab for i in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return GenerationSpec(prompt_ids=prompt_ids, sampling=checked_sampling(sampling),
                          max_tokens=_budget(ctx, len(prompt_ids), max_tokens),
                          stop_ids=[] if ignore_eos else None, stops=stops)


@dataclass
class ChatPrompt:
    """A conversation rendered by the chat template, with what parsing its output needs.

    `text` holds the request's text shielded (prompt_tokens.ContentShield); `tools` are the
    request's own (None when tool_choice is "none"), `prefix` the forced tool-call opener the
    prompt ends with, both as the output parsers read them."""

    text: str
    shield: ContentShield
    tools: Optional[list[dict[str, Any]]]
    prefix: str
    reasoning_open: bool


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """A 400 naming `chat_template_kwargs.<key>` for a key the chat template already has whatever
    the request says: a variable render_chat sets (the request's own messages, tools, ...), which
    would silently overwrite the key, or a function of the renderer (raise_exception, range,
    namespace, ...), which the value would replace, failing a template that calls it."""
    for key in kwargs:
        if key in RENDER_VARIABLES:
            why = "the server sets that template variable from the request itself"
        elif key in TEMPLATE_FUNCTIONS:
            why = "it names a function the chat template's renderer provides, which a value would replace"
        else:
            continue
        raise ApiError(400, f"chat_template_kwargs cannot set {quoted(key)}: {why}", param=f"chat_template_kwargs.{key}")


def _render(ctx: ServeContext, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
            kwargs: dict[str, Any], continue_final: bool) -> str:
    """The prompt text: the conversation and a new assistant turn, or its final message left open,
    rendered in the template sandbox (a template is a program from a downloaded file)."""
    if continue_final:
        return render_continuation(ctx.tokenizer, messages, tools, kwargs, ctx.templates.render)
    return render_chat(ctx.tokenizer, messages, tools, True, kwargs, ctx.templates.render)


def chat_prompt(ctx: ServeContext, messages: list[dict[str, Any]],
                tools: Optional[list[dict[str, Any]]], tool_choice: Optional[str],
                template_kwargs: Optional[dict[str, Any]], continue_final: bool = False,
                structured: bool = False) -> ChatPrompt:
    """Render a chat conversation. `tool_choice` is None/"auto", "none", "required" or a function
    name; `continue_final` ends the prompt inside the final message, for the model to continue it;
    `structured`: the answer follows a grammar from its first token, so thinking is closed first.
    `template_kwargs` holds the request's `chat_template_kwargs` (check_template_kwargs)."""
    check_template_kwargs(template_kwargs or {})
    tools = tools or None
    choice = tool_choice or "auto"
    if choice != "auto" and choice != "none" and not tools:
        wanted = "any tool" if choice == "required" else quoted(choice)  # OpenAI's `required`, Anthropic's `any`
        raise ApiError(400, f"tool_choice asks for a tool call ({wanted}), which needs at least one function tool "
                            "in `tools` (built-in tools such as web search are not served here)", param="tool_choice")
    if choice not in ("auto", "none", "required") and choice not in declared_functions(tools or []):
        raise ApiError(400, f"tool_choice names function {quoted(choice)}, which is not in `tools`",
                       param="tool_choice")
    if choice == "none":
        tools = None
    for msg in messages:
        if msg["role"] == "developer":
            msg["role"] = "system"
    shield = shield_for(ctx.tokenizer, ctx.config.parse_special_in_content)
    kwargs = {"enable_thinking": False, **(template_kwargs or {})}
    text = _render(ctx, shield.apply(template_messages(messages)), shield.apply(tools), kwargs, continue_final)
    reasoning_open = ctx.reasoning_tags and prompt_opens_reasoning(text)
    prefix = ""
    if structured and reasoning_open:
        text += CLOSE_TAG + "\n\n"
        reasoning_open = False
    if tools and forces_call(choice):
        name = None if choice == "required" else choice
        prefix = forced_prefix(ctx.tool_format, name)
        if reasoning_open:  # a forced call comes after the thinking the template opened
            text += CLOSE_TAG + "\n\n"
            reasoning_open = False
        text += forced_prefix(ctx.tool_format, shield.text(name) if name else None)
    return ChatPrompt(text, shield, tools, prefix, reasoning_open)


def chat_spec(ctx: ServeContext, prompt: ChatPrompt, sampling: dict[str, Any], max_tokens: Optional[int],
              stops: list[str], ignore_eos: bool = False, max_tool_calls: Optional[int] = None,
              grammar: Optional[RequestGrammar] = None) -> GenerationSpec:
    """A chat generation of `prompt`. `ignore_eos` generates through end-of-sequence tokens
    (benchmarks, tests); `max_tool_calls` ends the output after that many tool calls; `grammar`
    constrains it (structured output; it then ends at EOS once complete, ignore_eos or not)."""
    sampling = checked_sampling(sampling)
    prompt_ids = encode_prompt(ctx.tokenizer, prompt.text, ctx.max_ctx, ctx.max_ctx - 1, prompt.shield)
    return GenerationSpec(prompt_ids=prompt_ids, sampling=sampling,
                          max_tokens=_budget(ctx, len(prompt_ids), max_tokens),
                          stop_ids=[] if ignore_eos else None, stops=stops, tools=prompt.tools,
                          tool_format=ctx.tool_format, prefix=prompt.prefix,
                          split_reasoning=ctx.reasoning_tags, reasoning_open=prompt.reasoning_open,
                          max_tool_calls=max_tool_calls, grammar=grammar.text if grammar else None,
                          grammar_param=grammar.param if grammar else None)


def prompt_token_count(ctx: ServeContext, prompt: ChatPrompt) -> int:
    """The tokens of `prompt`, even over the context (clients ask precisely to find out whether
    they must compact), up to COUNT_LIMIT_CONTEXTS contexts: beyond that, ContextLengthError."""
    return len(encode_prompt(ctx.tokenizer, prompt.text, ctx.max_ctx,
                             COUNT_LIMIT_CONTEXTS * ctx.max_ctx, prompt.shield))
