"""Split `<think> ... </think>` reasoning from the answer, incrementally.

Clients show `reasoning_content` apart from `content` (and agents must not feed a model's
thoughts back as its answer), so the server separates them as text streams in. Tags can arrive
cut anywhere between two steps, so any suffix that could still grow into a tag is held back
until the next piece decides it. The split is independent of how the text was cut.

A `</think>` outside a think block is markup all the same, never answer text: with thinking off
the prompt already holds the closed (empty) think block, and a model that thinks anyway and
closes it writes one into the answer. It is dropped, with the whitespace that frames it.
"""

from __future__ import annotations

from typing import Optional

from .holdback import held_suffix_len

REASONING = "reasoning"
CONTENT = "content"
OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside a think block, so the output starts as reasoning
    (templates that open `<think>` for the model)."""
    return prompt.rfind(OPEN_TAG) > prompt.rfind(CLOSE_TAG)


def uses_reasoning_tags(chat_template: Optional[str]) -> bool:
    """Whether the checkpoint's template knows think blocks at all; otherwise nothing is split."""
    return bool(chat_template) and OPEN_TAG in chat_template


class ReasoningSplitter:
    """feed() text, get [(channel, text), ...] with channel REASONING or CONTENT; then finish().

    Whitespace around the tags is framing (`<think>\n...\n</think>\n\n`), not text: it is
    dropped after any tag and before a closing one."""

    def __init__(self, start_in_reasoning: bool = False):
        self._channel = REASONING if start_in_reasoning else CONTENT
        self._buf = ""
        self._skip_space = start_in_reasoning
        self._held_space = ""  # trailing whitespace of the reasoning, dropped if `</think>` follows

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            tags = (CLOSE_TAG,) if self._channel == REASONING else (OPEN_TAG, CLOSE_TAG)
            found = [(pos, tag) for pos, tag in ((self._buf.find(tag), tag) for tag in tags) if pos >= 0]
            if not found:
                keep = held_suffix_len(self._buf, tags)
                self._emit(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            pos, tag = min(found)
            self._emit(self._buf[:pos], out)
            self._buf = self._buf[pos + len(tag):]
            if tag == OPEN_TAG or self._channel == REASONING:  # else a stray `</think>`: dropped
                self._channel = CONTENT if self._channel == REASONING else REASONING
            self._skip_space, self._held_space = True, ""

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(self._buf, out)
        if self._held_space:
            self._add(self._held_space, out)
        self._buf, self._held_space = "", ""
        return out

    def _emit(self, text: str, out: list[tuple[str, str]]) -> None:
        if self._skip_space:
            text = text.lstrip()
            if not text:
                return
            self._skip_space = False
        if self._channel == REASONING:
            body = text.rstrip()
            if not body:
                self._held_space += text
                return
            text, self._held_space = self._held_space + body, text[len(body):]
        if text:
            self._add(text, out)

    def _add(self, text: str, out: list[tuple[str, str]]) -> None:
        if out and out[-1][0] == self._channel:
            out[-1] = (self._channel, out[-1][1] + text)
        else:
            out.append((self._channel, text))
