"""The decoder view's data: what each decode step proposed and accepted, as text, for a request
that asks for it (`flashtree_trace: true`) and for no other.

A step's `text` comes from a detokenizer of its own that sees every id the engine sent, so the
steps' texts put together are the raw output (reasoning and tool-call markers included, before
any stop string or parser shortened it): the answer the page shows is parsed, the decoder view
shows what the decoder made. A step's tree is the engine's trace of it with each node's token
as text: `parents[i]` is node i's parent (-1 for the root, the token the step before ended
with) and `accepted` the node indices of the path the target accepted, root first. The step's
tokens are those nodes' after the root, then one the target drew after them (`bonus`).

Nothing here runs unless asked: the engine only records a trace for a traced request, and the
Tokens of others carry none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .chat import IncrementalDetokenizer
from .logprobs import TokenText

# the engine's stats that a traced answer reports (its accept lengths are in the steps already)
STAT_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens", "steps", "prefill_s", "decode_s",
             "tokens_per_s", "mean_accept_length")


@dataclass
class DecodeSteps:
    """Steps of one generation, as the `flashtree.steps` extension field carries them."""

    steps: list[dict[str, Any]]


class StepTracer:
    """push() each Tokens message's ids and traces, get its steps; finish() once at the end."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)
        self._texts = TokenText(tokenizer)
        self._index = 0

    def _label(self, token: int) -> str:
        """A node's token as text; a special token that decodes to nothing shows as itself."""
        text = self._texts.get(token)[0]
        return text or self._tok.id_to_token(token) or f"#{token}"

    def push(self, ids: list[int], traces: Optional[list[dict[str, Any]]]) -> DecodeSteps:
        """The step that made `ids`: the first has no tree (the prefill's logits drew its token)."""
        step: dict[str, Any] = {"i": self._index, "n": len(ids), "text": self._detok.push(ids), "tree": None}
        self._index += 1
        if traces:
            trace = traces[-1]
            accepted = [int(n) for n in trace["accepted"]]
            step["tree"] = {"tokens": [self._label(int(t)) for t in trace["tree_tokens"]],
                            "parents": [int(p) for p in trace["tree_parents"]], "accepted": accepted}
            drafted = len(accepted) - 1  # the accepted nodes after the root; the bonus follows them
            step["bonus"] = self._label(ids[drafted]) if len(ids) > drafted else None
        return DecodeSteps([step])

    def finish(self) -> Optional[DecodeSteps]:
        """Text the detokenizer still held (a character cut off at the end), as a last step."""
        tail = self._detok.flush()
        if not tail:
            return None
        return DecodeSteps([{"i": self._index, "n": 0, "text": tail, "tree": None}])


def answer_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The per-answer numbers a traced answer ends with: speed, prefill, cache reuse, acceptance."""
    return {key: stats[key] for key in STAT_KEYS if key in stats}
