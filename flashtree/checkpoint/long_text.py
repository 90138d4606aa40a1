"""Long texts through a tokenizer at a bounded cost: encoded in pieces, and refused from their
length alone when they cannot fit.

`tokenizers` keeps, while it encodes, alignment records for every byte of its input and a string
and offsets for every token: one 30 MB prompt took 36 s and 4 GB, which the process never gave
back. Two things keep that cost bounded for the byte-level BPE tokenizers of the supported models
(Qwen, LLaMA-3, the embedded model):

- a bound: no token stands for more text than its longest vocabulary entry, so a text longer
  than `limit * chars_per_token` characters has more than `limit` tokens, which is known without
  tokenizing it (LongText.__init__ says why the bound is safe);
- pieces: a text is encoded about CHUNK_CHARS characters at a time, cut only where the pieces'
  ids are exactly the whole text's ids, so the caller holds only ids and can stop counting as
  soon as it has seen enough.

Other tokenizers (no pre-tokenizer, sentencepiece-style normalizers) get neither: their texts are
encoded whole, as before.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional

from tokenizers import Tokenizer as RawTokenizer

CHUNK_CHARS = 1 << 16
# a piece with no exact cut this far from its start is cut anyway (HARD_CUT_CHARS)
HARD_CUT_CHARS = 1 << 17
# Where the pre-tokenizers of the GPT-2 family (GPT-2's own, Qwen's, LLaMA-3's split regexes) always
# end one pre-token and begin the next, whatever comes before or after: before a space that follows
# a printable ASCII character, after a newline before a non-space, and between an ASCII letter and
# an ASCII digit. None of their patterns runs across these points (a space only ever begins a
# pre-token, newlines only ever end one, letters and digits are never in one pre-token), so the
# scan from such a point is the same in a piece as in the whole text, and BPE never merges across
# pre-tokens: the pieces' ids are the whole text's ids.
EXACT_CUT = re.compile(r"(?<=[!-~])(?= )|(?<=\n)(?=\S)|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])")


def _state(component: Any) -> dict[str, Any]:
    """A normalizer's or pre-tokenizer's settings, as tokenizer.json writes them."""
    return json.loads(component.__getstate__()) if component is not None else {}


def _byte_level_split(pre_tokenizer: dict[str, Any]) -> bool:
    """GPT-2's ByteLevel with its own regex, or a regex Split followed by a ByteLevel without one
    (Qwen, LLaMA-3), neither adding a space in front of the text."""
    if pre_tokenizer.get("type") == "ByteLevel":
        return bool(pre_tokenizer.get("use_regex")) and not pre_tokenizer.get("add_prefix_space")
    steps = pre_tokenizer.get("pretokenizers") or []
    return (pre_tokenizer.get("type") == "Sequence" and len(steps) == 2
            and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex") and not steps[1].get("add_prefix_space"))


class LongText:
    """What a tokenizer allows long texts: `chars_per_token` (None: no bound known) and
    `pieces(text)`, the spans to encode one at a time."""

    def __init__(self, raw: RawTokenizer):
        normalizer = _state(raw.normalizer).get("type")
        added = list(raw.get_added_tokens_decoder().values())
        byte_level = (normalizer in (None, "NFC") and _byte_level_split(_state(raw.pre_tokenizer))
                      and not any(t.lstrip or t.rstrip or t.single_word for t in added))
        self._added = [t.content for t in added]
        self.cuttable = byte_level
        self.chars_per_token: Optional[float] = None
        if byte_level:
            # A byte-level token's vocabulary string has one character per byte it stands for, and an
            # added token stands for its text, so no token stands for more than `longest` bytes of the
            # normalized text. NFC composes at most three characters into one of two bytes or more
            # (U+01D5 from U, U+0308, U+0304 is the worst case), so a text keeps at least 2/3 as many
            # bytes as it had characters; without a normalizer it keeps at least as many. A text of
            # more than limit * chars_per_token characters therefore has more than `limit` tokens.
            longest = max(len(token) for token in raw.get_vocab(with_added_tokens=True))
            self.chars_per_token = longest * (1.5 if normalizer == "NFC" else 1.0)

    def pieces(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) spans covering `text` in order; encoding each gives the ids of the whole
        text, except at a hard cut: a run of HARD_CUT_CHARS characters with no exact cut (no
        space, no line break, no letter next to a digit) is cut where it reaches that length,
        and the few ids around such a cut may differ from a whole encoding."""
        start = 0
        while self.cuttable and len(text) - start > HARD_CUT_CHARS:
            end = self._cut(text, start)
            yield start, end
            start = end
        yield start, len(text)

    def _cut(self, text: str, start: int) -> int:
        for match in EXACT_CUT.finditer(text, start + CHUNK_CHARS, start + HARD_CUT_CHARS):
            if not self._inside_added(text, match.start()):
                return match.start()
        cut = start + HARD_CUT_CHARS
        while self._inside_added(text, cut):
            cut -= 1
        return cut

    def _inside_added(self, text: str, at: int) -> bool:
        """Whether an added token's text (`<|im_end|>`) spans position `at`: cutting there would
        turn a control token into plain characters."""
        for token in self._added:
            found = text.find(token, max(0, at - len(token) + 1), at + len(token) - 1)
            if 0 <= found < at:
                return True
        return False
