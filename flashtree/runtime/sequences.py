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

from ..kernels.kv_storage import PAGE_ROWS
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
    prompt_rows: int = 0  # its generation's prompt: the rows it holds before it decodes

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
        self.request, self.pausable, self.paused, self.prompt_rows = None, False, None, 0

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


def donor(sequences: list[LiveSequence], taker: Optional[LiveSequence], prompt: list[int], limit: int
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


def fits_beside_running(sequences: list[LiveSequence], rows: int, shared: int = 0,
                        skip: Optional[LiveSequence] = None) -> bool:
    """Whether `rows` rows and a step past them, less `shared` rows that a running sequence
    holds already, fit in every page pool beside what each running sequence holds and will
    hold: its prompt (`prompt_rows`) and its next step. The rest of a pool (idle sequences'
    rows, device snapshots) is given up on demand (preemption.py). True with none running:
    what a wait would be for never comes."""
    running = [s for s in sequences if s is not skip and s.busy and s.paused is None]
    if not running:
        return True
    step = sequences[0].decoder.step_rows
    for i, cache in enumerate(sequences[0].state.kv_caches()):
        held: set[int] = set()
        growth = 0
        for seq in running:
            theirs = seq.state.kv_caches()[i]
            held.update(theirs.held)
            growth += max(0, pages_for(max(seq.state.bound, seq.prompt_rows) + step) - len(theirs.held))
        if len(held) + growth + pages_for(rows + step) - shared // PAGE_ROWS > cache.pool.usable_pages:
            return False
    return True


def room_to_resume(sequences: list[LiveSequence], seq: LiveSequence) -> bool:
    """Whether preempted `seq` may take its rows back: they (its whole prompt, where it stepped
    aside from its prefill) and its next step fit beside the running sequences
    (fits_beside_running). Resuming with less would take pages that a running sequence's next
    reservation preempts it for again: a round trip of all its rows (a restore and a save) for
    one step, over and over while the pool stays tight."""
    assert seq.paused is not None
    return fits_beside_running(sequences, max(len(seq.paused), seq.prompt_rows), skip=seq)
