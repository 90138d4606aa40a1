"""Chat prompts rendered by the checkpoint's own jinja template, as transformers renders them.

A model only behaves as trained when its prompt is rendered by its own chat template, so the
template shipped with the checkpoint is executed (in a jinja2 sandbox: it is data from a
downloaded file) with the conventions of transformers' `apply_chat_template`: trimmed blocks,
`tojson` without HTML escaping and with json.dumps' options, `raise_exception`, `strftime_now`,
the loop controls `break` / `continue`, and the `{% generation %}` block tag. A template that
transformers accepts must render here, identically.

It lives with the checkpoint, not with the server, because training renders the same templates
to build its corpus and must not import the server to do it. The sandbox keeps a template from
reaching anything outside it, not from running forever or allocating without end: a caller that
renders templates it does not trust passes its own `render` (the server renders in child
processes with time and memory limits, flashtree.serve.template_sandbox), and `render_template`'s
`max_chars` stops an endless output while it is produced.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Optional

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import FlashtreeError


class ChatTemplateError(FlashtreeError):
    """The conversation cannot be rendered: no template, or the template rejected it."""


class ChatTemplateLimit(ChatTemplateError):
    """The template went past a limit of its rendering (time, memory, output): it misbehaves,
    whatever the conversation."""


# (template, variables) -> the rendered text; render_template, or a sandbox around it
Render = Callable[[str, dict[str, Any]], str]


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` around an assistant turn marks, for transformers'
    assistant-token masks in training, which characters the model produced. Rendering a prompt
    is not that mode, and there transformers outputs the block's body unchanged: so do we."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` tag name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# the variables render_chat gives a template itself, besides the caller's template_kwargs (a test
# holds the two to each other)
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_functions() -> frozenset[str]:
    """The global names every template can call: jinja's own (range, namespace, ...) and
    raise_exception, strftime_now. A template variable of one of these names shadows it, and a
    template that calls it then fails on the value."""
    return frozenset(_environment().globals)


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    try:
        return _environment().from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None


def render_template(template: str, variables: dict[str, Any], max_chars: Optional[int] = None) -> str:
    """`template` rendered with `variables`. It is produced a piece at a time, so that with
    `max_chars` an output past that many characters is a ChatTemplateLimit as soon as it gets
    there, before it is built whole. Whatever the template's own code raises (a range past the
    sandbox's limit is an OverflowError, a macro calling itself a RecursionError) is a
    ChatTemplateError: the template's failure, not flashtree's. A MemoryError is not: it passes
    to the caller, the sandbox that capped the memory, which reports its limit and replaces the
    process that ran out."""
    chunks, size = [], 0
    try:
        for chunk in _compile(template).generate(**variables):
            size += len(chunk)
            if max_chars is not None and size > max_chars:
                raise ChatTemplateLimit(f"the chat template's output exceeded its limit of {max_chars:,} "
                                        "characters")
            chunks.append(chunk)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
            RecursionError) as e:
        raise ChatTemplateError(f"the chat template cannot render this conversation: {e}") from None
    return "".join(chunks)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: Optional[list[dict[str, Any]]] = None, add_generation_prompt: bool = True,
                template_kwargs: Optional[dict[str, Any]] = None, render: Render = render_template) -> str:
    """Render `messages` (transformers chat format) with the tokenizer's chat template.

    `tokenizer` is anything with `chat_template`, `bos_token` and `eos_token` (a Tokenizer, or
    the training recipe's template source); `template_kwargs` are extra template variables,
    e.g. `enable_thinking` (one named in RENDER_VARIABLES is overwritten: a caller that takes them
    from a client refuses those); `render` runs the template (a sandbox with limits, in the
    server)."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model has no chat template; use /v1/completions with a raw prompt")
    variables = dict(template_kwargs or {})
    variables.update(messages=messages, tools=tools or None,
                     add_generation_prompt=add_generation_prompt,
                     bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    return render(tokenizer.chat_template, variables)


# Marks where the final message's text ends in a rendering, so that the prompt can be cut there
CONTINUE_MARK = "<|flashtree:continue-here|>"


def render_continuation(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: Optional[list[dict[str, Any]]] = None,
                        template_kwargs: Optional[dict[str, Any]] = None,
                        render: Render = render_template) -> str:
    """Render `messages` up to the end of the final message's text, its turn left open, so that
    the model continues that text (a prefilled answer) instead of answering it in a new turn.

    Chat templates have no switch for this, so the turn is rendered complete with a mark at the
    end of its text, and the prompt is cut at the mark: the template's end-of-turn suffix goes,
    whatever it is (transformers' `continue_final_message` cuts the same way)."""
    final = dict(messages[-1], content=(messages[-1].get("content") or "") + CONTINUE_MARK)
    rendered = render_chat(tokenizer, messages[:-1] + [final], tools, False, template_kwargs, render)
    end = rendered.rfind(CONTINUE_MARK)
    if end < 0:
        raise ChatTemplateError("the chat template does not render the final message's text, "
                                "so it cannot be continued")
    return rendered[:end]
