"""Token logprobs on their way from the worker to a response: which tokens are part of the
answer, and how OpenAI's two wire formats spell them.

The worker sends a logprob (and the top alternatives) for every token it emits; the answer is
the text before a stop string, so a token is reported only once all of its text has been
released before the stop: a token the stop string cuts, in whole or in part, is left out, like
the text after it. LogprobTracker decides that from character offsets in the detokenized stream,
which also give the completions format its `text_offset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

# (logprob, [(token id, logprob), ...]) per token, as protocol.Tokens carries it
WorkerLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class TokenLogprob:
    token: int
    offset: int    # where the token's text begins in the output text
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Logprobs:
    """A pipeline item: the logprobs of tokens now known to be part of the answer, in order."""

    entries: list[TokenLogprob] = field(default_factory=list)


class LogprobTracker:
    """Pairs each pushed token with its span in the detokenized text; released() gives the
    tokens whose span ends within the text released so far."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, TokenLogprob]] = []  # (end offset, entry)
        self._length = 0     # characters detokenized so far
        self.released = 0    # characters released as the answer (before any stop string)

    def add(self, token: int, text: str, own: str, logprob: WorkerLogprob) -> None:
        """`text` is what the detokenizer released at this token: its own text `own`, after the
        text of earlier tokens it held back (part of a character); `own` begins where `text`
        ends with it, else (a character completed here) where `text` begins."""
        start = self._length
        self._length += len(text)
        if own and text.endswith(own):
            start = self._length - len(own)
        entry = TokenLogprob(token, start, logprob[0], [(int(t), float(lp)) for t, lp in logprob[1]])
        self._pending.append((self._length, entry))

    def take(self, everything: bool = False) -> Logprobs:
        """The entries now released (`everything`: the output ended without a stop string)."""
        keep = len(self._pending) if everything else sum(1 for end, _ in self._pending if end <= self.released)
        out, self._pending = self._pending[:keep], self._pending[keep:]
        return Logprobs([entry for _, entry in out])


# --- token text ----------------------------------------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the
    rest were moved to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    moved = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


BYTE_LEVEL = _byte_level_table()


class TokenText:
    """A token's text and its UTF-8 bytes, as logprobs report them. A byte-level token can hold
    part of a character: its bytes are then the token's real ones, and its text spells them as
    OpenAI does, `bytes:\\xe2\\x80` (a U+FFFD would make different tokens look the same)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._byte_level = type(tokenizer.raw.decoder).__name__ == "ByteLevel"
        self.get = lru_cache(maxsize=65536)(self._get)

    def _get(self, token: int) -> tuple[str, list[int]]:
        text = self._tok.decode([token])
        if "\ufffd" in text and self._byte_level:
            piece = self._tok.id_to_token(token) or ""
            if all(ch in BYTE_LEVEL for ch in piece):
                raw = [BYTE_LEVEL[ch] for ch in piece]
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
        return text, list(text.encode("utf-8"))


# --- wire formats --------------------------------------------------------------------------------


def chat_logprobs(entries: list[TokenLogprob], texts: TokenText) -> dict[str, Any]:
    """Chat completions' `choices[].logprobs`: content[] of token, logprob, bytes, top_logprobs."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = texts.get(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], texts: TokenText) -> dict[str, Any]:
    """Legacy completions' `choices[].logprobs`: parallel lists; each top_logprobs dict holds the
    requested alternatives and always the chosen token (so up to n + 1 entries, as OpenAI's)."""
    top: list[Optional[dict[str, float]]] = []
    for e in entries:
        alternatives = {texts.get(t)[0]: lp for t, lp in e.top}
        alternatives[texts.get(e.token)[0]] = e.logprob
        top.append(alternatives)
    return {"tokens": [texts.get(e.token)[0] for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}
