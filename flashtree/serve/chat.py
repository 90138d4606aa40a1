"""Chat prompts from the checkpoint's own template, and text back from token ids, incrementally.

A model only behaves as trained when its prompt is rendered by its own chat template, so the
template shipped in tokenizer_config.json is executed (in a jinja2 sandbox: it is data from a
downloaded file) with the same conventions transformers uses: `tojson` without HTML escaping,
`raise_exception`, `strftime_now`, trimmed blocks.

Detokenizing per step is not "decode the new ids": byte-level tokens can end in the middle of a
UTF-8 character, and tokenizers that drop a leading space need the previous token as context.
The incremental detokenizer decodes a short window and releases only complete characters.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import FlashtreeError
from . import reasoning, toolcalls

REPLACEMENT_CHAR = "\ufffd"
MARKER_TOKENS = frozenset({reasoning.OPEN_TAG, reasoning.CLOSE_TAG, toolcalls.OPEN_TAG, toolcalls.CLOSE_TAG})


class ChatTemplateError(FlashtreeError):
    """The conversation cannot be rendered: no template, or the template rejected it."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
                template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """Render `messages` (transformers chat format) with the tokenizer's chat template.

    `template_kwargs` are extra template variables, e.g. `enable_thinking`."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions with a raw prompt")
    variables = dict(template_kwargs or {})
    variables.update(messages=messages, tools=tools or None,
                     add_generation_prompt=add_generation_prompt,
                     bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    try:
        return _compile(tokenizer.chat_template).render(**variables)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template cannot render this conversation: {e}") from None


# Marks where the final message's text ends in a rendering, so that the prompt can be cut there
CONTINUE_MARK = "<|flashtree:continue-here|>"


def render_continuation(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: Optional[list[dict[str, Any]]] = None,
                        template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """Render `messages` up to the end of the final message's text, its turn left open, so that
    the model continues that text (a prefilled answer) instead of answering it in a new turn.

    Chat templates have no switch for this, so the turn is rendered complete with a mark at the
    end of its text, and the prompt is cut at the mark: the template's end-of-turn suffix goes,
    whatever it is (transformers' `continue_final_message` cuts the same way)."""
    final = dict(messages[-1], content=(messages[-1].get("content") or "") + CONTINUE_MARK)
    rendered = render_chat(tokenizer, messages[:-1] + [final], tools, False, template_kwargs)
    end = rendered.rfind(CONTINUE_MARK)
    if end < 0:
        raise ChatTemplateError("the chat template does not render the final message's text, "
                                "so it cannot be continued")
    return rendered[:end]


def content_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict))


def _template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a mapping when they are a JSON object: templates that iterate the
    arguments (Qwen3-Coder) need one, templates that print them serialize it again."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the plain dicts chat templates expect (text content, parsed
    tool-call arguments, no None fields)."""
    out = []
    for msg in messages:
        item: dict[str, Any] = {"role": msg["role"], "content": content_text(msg.get("content"))}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if msg.get(key) is not None:
                item[key] = msg[key]
        if msg.get("tool_calls"):
            item["tool_calls"] = [
                {"id": call.get("id"), "type": "function",
                 "function": {"name": call["function"]["name"],
                              "arguments": _template_arguments(call["function"].get("arguments"))}}
                for call in msg["tool_calls"]]
        out.append(item)
    return out


class IncrementalDetokenizer:
    """push() ids as they are generated, get the newly completed text; flush() at the end.

    Decodes the ids since the previous release together with the ones before them (their
    context) and releases the difference, unless it ends in an incomplete character.

    Special tokens are left out of the text, except the markers that the reasoning and tool-call
    parsers read: some tokenizers mark `<think>` or `<tool_call>` special, others do not, and
    the parsers must see them either way."""

    def __init__(self, tokenizer: Any, keep: frozenset[str] = MARKER_TOKENS):
        self._tok = tokenizer
        self._hidden = {tokenizer.token_to_id(t) for t in tokenizer.special_tokens if t not in keep}
        self._ids: list[int] = []
        self._context_start = 0   # first id of the decode window
        self._released_upto = 0   # ids before this have been turned into released text

    def push(self, ids: list[int]) -> str:
        self._ids.extend(i for i in ids if i not in self._hidden)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._released_upto == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._context_start:self._released_upto])
        text = self._tok.decode(self._ids[self._context_start:])
        if not final and (len(text) <= len(before) or text.endswith(REPLACEMENT_CHAR)):
            return ""
        self._context_start, self._released_upto = self._released_upto, len(self._ids)
        return text[len(before):]
