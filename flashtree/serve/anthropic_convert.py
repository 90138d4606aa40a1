"""An Anthropic Messages request as the chat conversation the serving pipeline already runs.

The model's chat template speaks OpenAI-style messages, so a Messages request is translated
once, here, and then goes through the very same prompt building, sampling checks, tool-call
parsing and reasoning split as /v1/chat/completions. The mapping:

- `system` (a string or text blocks) -> one leading system message; system-role messages in
  `messages` join it when they come first and are user turns after that (chat_messages); a
  system block that is Claude Code's `x-anthropic-billing-header:` line is dropped (BILLING_HEADER);
- user text blocks -> user messages; `tool_result` blocks -> tool messages, in block order (a
  failed tool's output is marked, as the template has no field for `is_error`); a tool_result
  whose `tool_use_id` no earlier assistant `tool_use` has is a 400, as in Anthropic's API;
- assistant `text` / `tool_use` / `thinking` blocks -> one assistant message with content,
  tool_calls (input serialized as JSON arguments) and reasoning_content;
- `tools` -> function tools with `input_schema` as their parameters;
- `tool_choice` auto / any / tool / none -> auto / required / the named function / none, and its
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`;
- `thinking` enabled or adaptive -> the template's `enable_thinking`.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from .anthropic_schemas import (Conversation, MessagesRequest, RedactedThinkingBlock, TextBlock,
                                ThinkingBlock, ToolResultBlock, ToolUseBlock)
from .api_common import CallLedger, assistant_message, chat_tool_call, check_unique, function_tool
from .errors import ApiError, quoted

TOOL_ERROR_PREFIX = "Error: "
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Claude Code opens `system` with a block `x-anthropic-billing-header: cc_version=2.1.197.423; ...`
# whose last part changes with every request. It is metadata for Anthropic's billing, not words for
# the model, and as the first line of the prompt it would make every request miss the prefix cache
# (the whole ~6-27K-token prompt prefilled again on each turn), so it is not rendered.
BILLING_HEADER = "x-anthropic-billing-header:"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content)


def _system_text(content: Any) -> str:
    if isinstance(content, list):
        content = [block for block in content if not block.text.startswith(BILLING_HEADER)]
    return _text(content)


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    text = _text(block.content)
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "content": TOOL_ERROR_PREFIX + text if block.is_error else text}


def _user_messages(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            out.append(_tool_message(block))
        elif isinstance(block, TextBlock):
            last = out[-1] if out else None
            if last is not None and last["role"] == "user":
                last["content"] += "\n" + block.text
            else:
                out.append({"role": "user", "content": block.text})
        # thinking and tool_use blocks have no meaning in a user turn
    return out


def _assistant_message(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return assistant_message(content)
    text, reasoning, calls = [], [], []
    for block in content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(chat_tool_call(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # opaque by design: nothing of it can be shown to the model
    return assistant_message("".join(text), "\n".join(reasoning), calls)


def _block_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))


def _check_ties(role: str, blocks: list[Any], calls: CallLedger, where: str) -> None:
    """An assistant turn's tool_use blocks have distinct ids, and a user turn's tool_result blocks
    each the id of one of them in an earlier turn (CallLedger), as Anthropic's API requires."""
    check_unique([b.id if isinstance(b, ToolUseBlock) else None for b in blocks], "tool_use id",
                 lambda j: f"{where}.{j}.id")
    if role == "assistant":
        calls.called(b.id for b in blocks if isinstance(b, ToolUseBlock))
    elif role == "user":
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                calls.answers(block.tool_use_id, f"{where}.{j}.tool_use_id")


def chat_messages(body: Conversation) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (system first).

    System-role messages before the first turn join the system prompt. Later ones (Claude Code
    sends some) become user turns: chat templates place a system message only first, and
    folding them into it would change the prompt's beginning, and so miss the prefix cache,
    on every turn that adds one."""
    system = [_system_text(body.system)] if body.system else []
    messages: list[dict[str, Any]] = []
    calls = CallLedger(lambda id: f"unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each "
                                  "`tool_result` block must have a corresponding `tool_use` block in an earlier "
                                  "assistant message")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):  # a tool_result block answers the tool_use of its id
            _check_ties(message.role, message.content, calls, f"messages.{i}.content")
        if message.role == "system" and not messages:
            system.append(_block_text(message.content))
        elif message.role == "system":
            messages.append({"role": "user", "content": _block_text(message.content)})
        elif message.role == "user":
            messages.extend(_user_messages(message.content))
        else:
            messages.append(_assistant_message(message.content))
    text = "\n\n".join(part for part in system if part)
    return ([{"role": "system", "content": text}] if text else []) + messages


def chat_tools(body: Conversation) -> Optional[list[dict[str, Any]]]:
    """Client tools as OpenAI function tools; None when there are none. Names must be unique, as
    Anthropic's API requires: a call names the tool it runs."""
    names = [t.name for t in body.tools or []]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ApiError(400, f"tools: Tool names must be unique ({quoted(twice)} is declared twice)", param="tools")
    tools = [function_tool(t.name, t.description, t.input_schema)
             for t in body.tools or [] if t.input_schema is not None and t.type in (None, "custom")]
    return tools or None


def chat_tool_choice(body: Conversation) -> Optional[str]:
    """`tool_choice` as chat_spec takes it: auto, none, required or a function name."""
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice.name: required when tool_choice.type is \"tool\"",
                           param="tool_choice.name")
        return choice.name
    return CHOICES[choice.type]


def parallel_tool_calls(body: Conversation) -> Optional[bool]:
    """`tool_choice.disable_parallel_tool_use` as OpenAI's `parallel_tool_calls`."""
    choice = body.tool_choice
    return False if choice is not None and choice.disable_parallel_tool_use else None


def template_kwargs(body: Conversation) -> dict[str, Any]:
    thinking = body.thinking
    return {"enable_thinking": thinking is not None and thinking.type != "disabled"}


def stop_sequences(body: MessagesRequest) -> list[str]:
    return [s for s in body.stop_sequences or [] if s]
