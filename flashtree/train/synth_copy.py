"""A copy drill for the agent stage: repeat a run of random vocabulary tokens exactly, as plain
text, inside quotes and inside a JSON string.

Why: trained on the agent tasks alone, the embedded target copied the words it had written in
training and garbled the rest. A held-out word that is one token (' tiger', ' dragon') was never
a training target in an agent frame, and the model wrote it without its space or not at all
('thunderdragon'); a word split at odd places ('kettle' as ' k', 'et', 'tle') lost its tail. A
drill whose texts are drawn uniformly from the whole vocabulary makes every token a copy target.
It holds no task, name, content or phrasing of the agent stage, held out or not: only random
token runs (a held-out word can be among them by chance, as any word can) and words glued from
the tokenizer's pieces (never a held-out item).

A word is a different token run with and without its leading space (' harbor' is 'Ġh ar b or',
'harbor' after a quote 'h ar b or'; ' regit' is 'Ġreg it', 'regit' on its own line one token), and
an agent stage trained without the drill failed exactly there for every client: the first word of
a quoted content, and a command's output repeated in a sentence. So the drill copies in both
directions: from after a space into the start of an answer or a quote, and from the start of a
line into a sentence ("Here it is: ..."); and its words are glued from several pieces as often
as they are single tokens, so that dropping or adding the space re-splits them.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

from .lexicon import embedded_vocabulary
from .synth_tasks import glued_word

Record = dict[str, Any]
_ASKS = ["Repeat exactly: {text}", "Say back this text, unchanged: {text}", "Echo the following: {text}",
         "Copy this: {text}", "Write exactly this text: {text}"]
_QUOTES = {"plain": "", "single": "'", "double": "\""}  # and "json"


@lru_cache(maxsize=1)
def _tokens() -> list[str]:
    """The embedded tokenizer's tokens as text: printable, no special token, no line break."""
    return sorted({t for t in embedded_vocabulary() if t and t.isprintable() and "\ufffd" not in t})


def _text(rng: random.Random) -> str:
    """2 to 12 random tokens glued as drawn, or as words apart (each token then read with a leading
    space, the way a request's words are), or 1 to 6 glued words apart."""
    roll = rng.random()
    if roll < 1 / 3:
        return " ".join(glued_word(rng) for _ in range(rng.randint(1, 6)))
    tokens = [rng.choice(_tokens()) for _ in range(rng.randint(2, 12))]
    return ("".join(tokens) if roll < 2 / 3 else " ".join(t.strip() for t in tokens)).strip() or "x"


def copy_record(rng: random.Random) -> Record:
    """One drill conversation: a random text asked for in one of the forms. In all but "line" the
    text follows the ask's colon and space, and the answer starts with it (plain), or puts it
    right after a quote; in "line" the text starts a line of the ask and the answer puts it after
    a colon and a space."""
    text = _text(rng)
    form = rng.choice(["json", "line", *_QUOTES])
    ask = rng.choice(_ASKS)
    ask = (ask.replace(": {text}", ":\n{text}") if form == "line" else ask).format(text=text)
    if form == "json":
        ask += "\nAnswer with a JSON object whose \"text\" holds it."
        answer = json.dumps({"text": text}, ensure_ascii=False)
    elif form == "line":
        answer = "Here it is: " + text
    else:
        if form != "plain":
            ask += f"\nPut it in {form} quotes."
        answer = _QUOTES[form] + text + _QUOTES[form]
    return {"kind": "chat", "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]}
