"""The live sequences: several conversations kept on the device at once, each in its own caches.

Agent users run several sessions against one server: sub-agents in parallel, a client's side
requests (titles, summaries) beside its main loop, several terminals. With one live sequence,
each such request evicted the others' caches, which then had to come back from a snapshot or be
prefilled again. Here each of --max-sequences sequences owns a SequenceState (page tables of
--max-ctx rows over the KV pages all sequences share, models/kv_cache.py; a hybrid's recurrent
states and checkpoints), and a ModelRunner and a Decoder over it (so its CUDA graphs, captured
over its buffers, are its own, in their own pool). The weights are shared.

A request takes the idle sequence that serves it best (`choose`): the one where the tokens it
reuses minus the tokens it drops are the most, the least recently used among equals. So an
agent's next turn goes back to its own sequence, and a side request that shares only a system
prompt with a long conversation takes another sequence rather than cutting that one short; it
still takes the shared rows from it (`donor`): the same KV pages, held by both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from ..models.kv_cache import pages_for
from .decoding import Decoder
from .graphs import ModelRunner
from .sequence import SequenceState

_clock = itertools.count(1)  # orders uses: a later request's sequence gets a larger number


@dataclass(eq=False)
class LiveSequence:
    """One live sequence: its state, the runner of its forwards and its decoder. `request`
    names the generation that holds it (None: idle); `last_used` orders idle ones (0: never).

    Preemption (preemption.py): while its generation waits at a point where nothing of
    its step is under way (`pausable`), a running sequence's rows may be taken for another's
    pages: they are saved as a snapshot, the state emptied, and `paused` keeps the tokens it
    held; the generation gets them back (Preemption.resume) before it goes on."""

    index: int
    state: SequenceState
    runner: ModelRunner
    decoder: Decoder
    request: Optional[str] = None
    last_used: int = 0
    requests: int = 0  # generations it has served
    pausable: bool = False
    paused: Optional[list[int]] = None
    resume_rows: int = 0  # rows it needs before it goes on, where more than `paused` (a prompt)

    @property
    def busy(self) -> bool:
        return self.request is not None

    def acquire(self, request: str) -> None:
        if self.busy:
            raise RuntimeError(f"sequence {self.index} is held by {self.request}")
        self.request = request
        self.last_used = next(_clock)
        self.requests += 1

    def release(self) -> None:
        self.request, self.pausable, self.paused, self.resume_rows = None, False, None, 0

    def describe(self) -> dict[str, Any]:
        """What /sequences lists for it."""
        state = self.state
        caches = state.kv_caches()
        return {"index": self.index, "tokens": state.length, "busy": self.busy, "request": self.request,
                "requests": self.requests, "checkpoints": sorted(state.checkpoints) if state.recurrent else None,
                "kv_pages": len(caches[0].held), "kv_pages_shared": caches[0].shared_pages(),
                "preempted": self.paused is not None}


def choose(sequences: list[LiveSequence], prompt: list[int], limit: int) -> Optional[LiveSequence]:
    """The idle sequence a request for `prompt` (reusing at most `limit` tokens) should take: the
    most tokens reused less tokens dropped, then the least recently used. None: all are busy."""
    def score(seq: LiveSequence) -> tuple[int, int]:
        reused = seq.state.reusable(prompt, limit)
        return reused - (seq.state.length - reused), -seq.last_used

    idle = [s for s in sequences if not s.busy]
    return max(idle, key=score, default=None)


def donor(sequences: list[LiveSequence], taker: LiveSequence, prompt: list[int], limit: int
          ) -> tuple[Optional[LiveSequence], int]:
    """Another sequence whose rows serve more of `prompt` than `taker`'s own, and how many: the
    most. A busy one qualifies (its committed rows stay as they are while it decodes: a step
    writes only past its length) unless a commit of its is still unread on the host."""
    best: tuple[Optional[LiveSequence], int] = (None, 0)
    for seq in sequences:
        if seq is taker or seq.state.unread:
            continue
        shared = seq.state.reusable(prompt, limit)
        if shared > best[1]:
            best = (seq, shared)
    return best


def room_to_resume(sequences: list[LiveSequence], seq: LiveSequence) -> bool:
    """Whether preempted `seq`'s rows (a whole prompt, where it stepped aside from its prefill:
    `resume_rows`) and its next step fit in every page pool beside the rows
    and next step of each sequence that runs. Resuming with less would take pages that a running
    sequence's next reservation preempts it for again: a round trip of all its rows (a restore
    and a save) for one step, over and over while the pool stays tight. With none running, it
    resumes as soon as its rows fit (whatever it waits for would never come)."""
    running = [s for s in sequences if s is not seq and s.busy and s.paused is None and s.state.length]
    if not running:
        return True
    assert seq.paused is not None
    for i, cache in enumerate(seq.state.kv_caches()):
        held: set[int] = set()
        growth = 0
        for other in running:
            theirs = other.state.kv_caches()[i]
            held.update(theirs.held)
            growth += max(0, pages_for(other.state.bound + other.decoder.step_rows) - len(theirs.held))
        mine = pages_for(max(len(seq.paused), seq.resume_rows) + seq.decoder.step_rows)
        if len(held) + growth + mine > cache.pool.counts()["total"]:
            return False
    return True
