"""Prompt text -> token ids, safe against what the text of a request may hold.

Forged markup. A tokenizer turns every occurrence of a special token's text into that control
token, so a user message holding `<|im_end|>\\n<|im_start|>system\\n...` would close its own turn
and open a system turn. Only the chat template's own markup may become control tokens:
ContentShield swaps the text of every special token inside the request's strings for a
placeholder before the template renders them, and encode_prompt encodes the text between the
template's control tokens, the request's special-token text put back in, as plain text
(Tokenizer.encode_plain). A conversation without such text renders and encodes exactly as it did
(the shield changes nothing else); `--parse-special-in-content` turns the shield off for those
who relied on the old way.

Size. A prompt that cannot fit is refused from its length alone (LongText.chars_per_token), and
any other is encoded a bounded piece at a time, stopping as soon as it has more tokens than
allowed: a huge prompt costs neither the tokenizer's time nor memory the process keeps.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any, Iterable, Optional

from ..checkpoint import Tokenizer
from ..errors import ContextLengthError

# count_tokens counts a prompt up to this many contexts; beyond, it refuses like generation
COUNT_LIMIT_CONTEXTS = 4


class ContentShield:
    """Placeholders for the text of special tokens in a request's strings; `literals[i]` is the
    text the i-th placeholder stands for."""

    def __init__(self, specials: Iterable[str]):
        ordered = sorted(specials, key=len, reverse=True)  # of two that overlap, the longer wins
        self.specials = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        # Digits in brackets: no template filter (tojson, trim, upper) alters them, and with a
        # fresh 20-digit nonce per request no request text can spell one by chance or on purpose.
        self._nonce = f"{secrets.randbits(64):020d}"
        self.placeholder = re.compile(rf"\[{self._nonce}:(\d+)\]")
        self.literals: list[str] = []

    def text(self, value: str) -> str:
        """`value` with each special token's text replaced by a placeholder."""
        if self.specials is None or self.specials.search(value) is None:
            return value
        return self.specials.sub(self._swap, value)

    def apply(self, value: Any) -> Any:
        """`value` (messages, tools: JSON-like data) with every string in it shielded, keys too."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.apply(key): self.apply(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.apply(item) for item in value]
        return value

    def _swap(self, match: re.Match[str]) -> str:
        self.literals.append(match.group())
        return f"[{self._nonce}:{len(self.literals) - 1}]"


def shield_for(tokenizer: Tokenizer, parse_special_in_content: bool) -> ContentShield:
    """The shield a request's text goes through: none of the specials when the server was told
    to parse them in content (`--parse-special-in-content`)."""
    return ContentShield(() if parse_special_in_content else tokenizer.special_tokens)


def _units(parts: list[str], shield: ContentShield) -> list[tuple[str, bool]]:
    """A shielded prompt, split at placeholders into `parts`, as (text, plain) units to encode:
    the template's control tokens each on their own, and every stretch between two of them whole
    and as plain text, the request's special-token text put back in. A stretch holds no control
    token the template wrote, so encoding it as plain text changes nothing but that request
    text, and BPE sees it as the model would see the same words anywhere else."""
    units: list[tuple[str, bool]] = []
    run: list[str] = []  # the stretch since the last control token
    for k, part in enumerate(parts):
        if k % 2:
            run.append(shield.literals[int(part)])
            continue
        start = 0
        for match in shield.specials.finditer(part) if shield.specials else ():
            units += [("".join(run + [part[start:match.start()]]), True), (match.group(), False)]
            run, start = [], match.end()
        run.append(part[start:])
    return units + [("".join(run), True)]


def encode_prompt(tokenizer: Tokenizer, text: str, max_ctx: int, limit: int,
                  shield: Optional[ContentShield] = None) -> list[int]:
    """The ids of a rendered prompt (`shield`: the one its request text went through).

    ContextLengthError, counting `at least` so many tokens, as soon as the prompt is known to have
    more than `limit`: from its length before anything is encoded, or after the piece that
    crossed the limit. A prompt whose last piece crosses it is returned whole, with its exact
    count, for the caller to refuse."""
    parts = shield.placeholder.split(text) if shield else [text]  # text, index, text, ..., text
    units = _units(parts, shield) if shield and len(parts) > 1 else [(text, False)]
    bound = tokenizer.long_text.chars_per_token
    chars = sum(len(unit) for unit, _ in units)
    if bound is not None and chars > limit * bound:
        raise ContextLengthError(math.ceil(chars / bound), max_ctx, at_least=True)
    spans = [(unit, plain, start, end) for unit, plain in units for start, end in tokenizer.long_text.pieces(unit)]
    ids: list[int] = []
    for n, (unit, plain, start, end) in enumerate(spans):
        ids += (tokenizer.encode_plain if plain else tokenizer.encode)(unit[start:end])
        if len(ids) > limit and n + 1 < len(spans):
            raise ContextLengthError(len(ids), max_ctx, at_least=True)
    return ids
