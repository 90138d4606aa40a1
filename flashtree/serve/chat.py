"""The server's side of chat: OpenAI messages -> the dicts chat templates expect, and generated
token ids -> text, incrementally.

Rendering itself is flashtree.checkpoint.chat_template (training renders the same templates).

Detokenizing per step is not "decode the new ids": byte-level tokens can end in the middle of a
UTF-8 character, and tokenizers that drop a leading space need the previous token as context.
`tokenizers.decoders.DecodeStream` does exactly that (it decodes a short window and releases only
complete characters); the detokenizer here adds which special tokens to show and the end.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from ..checkpoint import Tokenizer
from . import reasoning, toolcalls
from .json_text import parse_json_text

MARKER_TOKENS = frozenset({reasoning.OPEN_TAG, reasoning.CLOSE_TAG, toolcalls.OPEN_TAG, toolcalls.CLOSE_TAG})


def content_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict))


def _template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a mapping when they are a JSON object: templates that iterate the
    arguments (Qwen3-Coder) need one, templates that print them serialize it again. Text that is
    not JSON, or is outside json_text's bounds (the request's validation refused that already),
    stays text: rendering never fails on what a client sent."""
    if isinstance(arguments, str):
        try:
            parsed = parse_json_text(arguments)
        except ValueError:
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

    Special tokens are left out of the text, except the markers that the reasoning and tool-call
    parsers read: some tokenizers mark `<think>` or `<tool_call>` special, others do not, and
    the parsers must see them either way. So the stream decodes with every special token and the
    hidden ones are dropped before it (DecodeStream's skip_special_tokens would drop the markers
    too).

    DecodeStream holds back ids that end in an incomplete character until a later id completes
    it, and has no call that gives them up: flush() decodes those itself, after the ids of the
    last released chunk as context, so that text cut off at the end (max_tokens in the middle
    of an emoji) still arrives, with U+FFFD for the missing bytes, as a full decode shows it.

    DecodeStream raises if decoding more ids rewrites text it already released (a decoder's
    clean-up step, as in WordPiece); the byte-level and sentencepiece decoders of the supported
    models (Qwen3, LLaMA) only ever append."""

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[str] = MARKER_TOKENS):
        self._tok = tokenizer
        self._hidden = {tokenizer.token_to_id(t) for t in tokenizer.special_tokens if t not in keep}
        self._stream = DecodeStream(skip_special_tokens=False)
        self._released: list[int] = []  # the ids of the last released chunk: context for flush()
        self._pending: list[int] = []   # ids the stream holds back

    def push(self, ids: list[int]) -> str:
        out = []
        for i in ids:  # one id a step, as every tokenizers release with DecodeStream (0.21+) takes
            if i in self._hidden:
                continue
            self._pending.append(i)
            text = self._stream.step(self._tok.raw, i)
            if text is not None:
                out.append(text)
                self._released, self._pending = self._pending, []
        return "".join(out)

    def flush(self) -> str:
        """The held-back tail, once generation has ended."""
        if not self._pending:
            return ""
        before = self._tok.decode(self._released)
        tail = self._tok.decode(self._released + self._pending)[len(before):]
        self._pending = []
        return tail
