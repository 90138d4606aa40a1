"""KV pages under pressure: which sequence gives its rows back when a page pool has none free,
and how a preempted one gets them back.

The live sequences share one pool of KV pages per model (models/kv_cache.py), which may hold
fewer rows than --max-sequences x --max-ctx. A pool that needs pages asks `reclaim`: device
snapshots move down the tiers, idle sequences give their rows back (saved as snapshots where
worth it), then running ones whose generation waits at a boundary are preempted (saved, their
state emptied, `LiveSequence.paused` keeping their tokens). A sequence whose own step or prompt
finds no page while another runs steps aside the same way (`step_aside`). A preempted sequence
takes its rows back (`resume`) only once they fit beside the running sequences' next steps
(sequences.room_to_resume), so that rows are not traded back and forth. docs/CACHE.md tells the
user's side.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import KVPagesExhausted
from . import faults
from .generation import GenerationStats
from .generation_loop import prefill
from .sequences import LiveSequence, room_to_resume

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("flashtree.engine")


class Preemption:
    """The engine's answers to an empty page pool (the pools' `reclaim`) and to a sequence
    that finds no page for its step or prompt; `resuming` while a preempted sequence takes its
    rows back (a resume takes idle sequences' pages only)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.resuming = False

    def reclaim(self, pages: int) -> None:
        """A page pool needs `pages` free pages. Device snapshots give theirs first, moving to
        the host tier, the least recently used first; then idle sequences, the least recently
        used first, each saved as a snapshot first where that is worth it (as a request that
        drops their rows would); then running ones whose generation waits where it can be
        preempted (LiveSequence.pausable), the latest request first, each saved whatever its
        length: its generation restores it (`resume`) before it goes on. A sequence's snapshot
        holds its pages until it too moves down the tiers, which the next round asks for. A
        resume takes idle sequences' pages only: preempting a running one for it would trade
        rows back and forth."""
        engine = self.engine
        pools = [c.pool for c in engine.state.kv_caches()]

        def enough() -> bool:
            return all(p.free_pages >= pages for p in pools)

        idle = sorted((s for s in engine.sequences if not s.busy and s.state.length), key=lambda s: s.last_used)
        waiting = sorted((s for s in engine.sequences if s.busy and s.pausable and s.paused is None
                          and s.state.length and not s.state.unread and not self.resuming), key=lambda s: -s.last_used)
        for seq in idle + waiting:
            if engine.cache.spill_pages(enough):
                return
            self.give_back(seq)
        engine.cache.spill_pages(enough)

    def give_back(self, seq: LiveSequence) -> None:
        """Empty `seq`'s rows into the pool, saved as a snapshot first where that is worth it,
        and always for a running sequence, which is then paused: its generation takes them back
        (`resume`) before it goes on."""
        engine = self.engine
        if seq.state.length and (seq.busy or engine.worth_snapshot(seq.state, seq.state.length)):
            try:
                engine.cache.save(seq.state)
            except Exception as e:  # the rows are lost, not the request: a resume prefills them
                if not faults.is_oom(e):
                    raise
        if seq.busy:
            seq.paused = list(seq.state.tokens)
            engine.shared_steps.withdraw(seq.decoder)
            engine.emit("preempted", sequence=seq.index, tokens=len(seq.paused))
        seq.state.truncate(0)
        log.info("sequence %d gave its KV pages back for another's rows%s", seq.index,
                 " (preempted: its generation waits for them)" if seq.busy else "")

    def step_aside(self, seq: LiveSequence) -> bool:
        """A running sequence whose step or prefill chunk found no KV page: where another
        sequence runs with rows of its own (whose pages come free when it ends or is preempted),
        `seq` gives its rows back and waits, preempted, instead of failing its request. False where none does: its
        pages would come back to no one, and the request fails (KVPagesExhausted). A prompt
        resumes once all of it fits (room_to_resume): with room for less, it would step aside
        again at its next chunk."""
        others = [s for s in self.engine.sequences if s is not seq and s.busy and s.paused is None and s.state.length]
        if not others or seq.state.unread or seq.paused is not None:
            return False
        self.give_back(seq)
        return True

    def resume(self, seq: LiveSequence, stats: GenerationStats) -> bool:
        """Give a preempted sequence its rows back: its snapshot restored, the rest (all of them,
        where the snapshot is gone or its restore found no memory: Engine.restore_snapshot)
        prefilled as a prompt is (generation_loop.prefill: a chunk at a time, each a heartbeat, a
        hybrid's recurrent states checkpointed, an out-of-memory retried once with smaller
        chunks), counted in the generation's `stats`. False while its
        rows would crowd the sequences that run (sequences.room_to_resume), or no page is free
        (the state keeps what it got, and the next call goes on from there)."""
        engine = self.engine
        tokens, state = seq.paused, seq.state
        assert tokens is not None
        if state.length == 0 and not room_to_resume(engine.sequences, seq):
            return False
        self.resuming = True
        try:
            if state.length == 0:
                entry, usable = engine.cache.best(tokens)
                if entry is not None and usable:
                    engine.restore_snapshot(entry, min(usable, len(tokens)), state)
            if state.length < len(tokens):
                for _ in prefill(engine, seq, tokens, stats):
                    pass
        except KVPagesExhausted:
            return False
        finally:
            self.resuming = False
        seq.paused = None
        self.engine.emit("resumed", sequence=seq.index, tokens=state.length)
        return True
