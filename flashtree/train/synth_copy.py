"""A copy drill for the agent stage: repeat a run of random vocabulary tokens exactly, as plain
text, inside quotes and inside a JSON string.

Why: trained on the agent tasks alone, the embedded target copied the words it had written in
training and garbled the rest. A held-out word that is one token (' tiger', ' dragon') was never
a training target in an agent frame, and the model wrote it without its space or not at all
('thunderdragon'); a word split at odd places ('kettle' as ' k', 'et', 'tle') lost its tail. A
drill whose texts are drawn uniformly from the whole vocabulary makes every token a copy target.
It holds no task, name, content or phrasing of the agent stage, held out or not: only random
token runs (a held-out word can be among them by chance, as any word can).
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

from .lexicon import embedded_vocabulary

Record = dict[str, Any]
_ASKS = ["Repeat exactly: {text}", "Say back this text, unchanged: {text}", "Echo the following: {text}",
         "Copy this: {text}", "Write exactly this text: {text}"]
_QUOTES = {"plain": "", "single": "'", "double": "\""}  # and "json"


@lru_cache(maxsize=1)
def _tokens() -> list[str]:
    """The embedded tokenizer's tokens as text: printable, no special token, no line break."""
    return sorted({t for t in embedded_vocabulary() if t and t.isprintable() and "\ufffd" not in t})


def copy_record(rng: random.Random) -> Record:
    """One drill conversation: a random run of 2 to 12 tokens, glued as drawn or as words apart
    (each token then read with a leading space, the way a request's words are), asked for in one
    of the forms."""
    tokens = [rng.choice(_tokens()) for _ in range(rng.randint(2, 12))]
    text = ("".join(tokens) if rng.random() < 0.5 else " ".join(t.strip() for t in tokens)).strip() or "x"
    form = rng.choice(["json", *_QUOTES])
    ask = rng.choice(_ASKS).format(text=text)
    if form == "json":
        ask += "\nAnswer with a JSON object whose \"text\" holds it."
        answer = json.dumps({"text": text}, ensure_ascii=False)
    else:
        if form != "plain":
            ask += f"\nPut it in {form} quotes."
        answer = _QUOTES[form] + text + _QUOTES[form]
    return {"kind": "chat", "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]}
