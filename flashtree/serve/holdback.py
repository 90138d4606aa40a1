"""Hold-back of streamed text that might still turn into a marker, and stop strings on top of it.

Text streams in per decode step, cut at arbitrary points. Anything that reacts to a marker (a
stop string, `<tool_call>`, `</think>`) must not release the first half of a marker before it
knows whether the second half follows; this module holds exactly the ambiguous tail and no more.
"""

from __future__ import annotations

from typing import Iterable, Optional


def held_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`. Only
    suffixes that start with a marker's first character are compared, longest first (found by
    str.find, not one slice a length: a held tail of thousands of characters beside a stop
    string that never matches cost a slice per character per token)."""
    best = 0
    for marker in markers:
        if not marker:
            continue
        at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while at != -1 and len(text) - at > best:
            if marker.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(marker[0], at + 1)
    return best


class StopMatcher:
    """OpenAI `stop` semantics for a stream: output ends right before the first stop string, which
    itself is never sent; text that could begin a stop string waits until it is decided."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._buf = ""
        self.matched = False
        self.matched_stop: Optional[str] = None  # which stop string ended the output

    def feed(self, text: str) -> str:
        """Text now safe to release; sets `matched` once a stop string has been seen."""
        if self.matched:
            return ""
        if not self._stops:
            return text
        self._buf += text
        hits = [(i, s) for i, s in ((self._buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, self.matched_stop = min(hits, key=lambda hit: hit[0])
            out, self._buf = self._buf[:at], ""
            self.matched = True
            return out
        keep = held_suffix_len(self._buf, self._stops)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> str:
        """The held tail at the end of generation: it never became a stop string."""
        out, self._buf = self._buf, ""
        return out
