"""One request's generation in the live sequence it holds: the prefill of the prompt's rest in
chunks, the first token, then decode steps until a stop token, max_tokens or the context ends.

The loop is a generator that yields after each prefill chunk but the last and after each step's
tokens, so that a caller advances several requests in turn; it touches only its own sequence
(and, while other generations run, the step they share: batch_step.py). Which sequence a request
takes and how its prefix is reused stay the engine's (engine.py); the loop asks it for both, and
for its out-of-memory recovery.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Generator, Iterator, Optional

import torch

from ..errors import EngineOutOfMemory, KVPagesExhausted, NonFiniteLogits
from . import faults
from .step_orders import StepOrder
from .decoding import Drafted
from .generation import GenerationResult, GenerationStats, GenerationStream
from .grammar import GrammarConstraint, apply_mask
from .memory_plan import allocator_counts
from .sampling import Sampler, SamplingParams
from .sequences import LiveSequence

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("flashtree.engine")


def generate(engine: Engine, seq: LiveSequence, stream: GenerationStream, prompt_ids: list[int],
             sampling: SamplingParams, max_tokens: int, stops: set[int], want_trace: bool,
             grammar: Optional[GrammarConstraint]) -> Iterator[list[int]]:
    """Prefill and decode in `seq`, yielding [] after each prefill chunk but the last and
    each step's tokens; a cancel takes effect at the next of those boundaries. Logits that are
    not finite where a token is drawn (the first one's, or a step's accepted path's) fail the
    request with NonFiniteLogits, and `seq` is emptied first."""
    decoder = seq.decoder
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    out: list[int] = []
    traces: Optional[list[dict]] = [] if want_trace else None
    stream.traces = traces
    finish = "length"
    counts = allocator_counts(engine.device)
    try:
        t0 = time.perf_counter()
        stats.cached_tokens = engine.prepare_prefix(seq, prompt_ids, stats)
        sampler = Sampler(sampling, engine.target.config.vocab_size, engine.device, prompt_ids)
        logits = None
        for logits in prefill(engine, seq, prompt_ids, stats):
            if logits is None:
                yield from boundary(engine, seq, [], stream, stats)
            if stream.cancelled:
                break
        if logits is None:  # cancelled between chunks: what was prefilled stays for reuse
            stream.result = GenerationResult([], "cancelled", stats, traces, None)
            return
        with faults.site("sample"):
            allowed = grammar.root_mask() if grammar is not None else None
            adjusted = sampler.adjust(apply_mask(logits, allowed))
            emitted, finite = sampler.draw(adjusted).read()
            if not finite[0]:
                raise NonFiniteLogits(len(prompt_ids))
            logprobs = sampler.token_logprobs(adjusted, emitted) if sampling.logprobs is not None else None
        stream.logprobs = [] if logprobs is not None else None
        stats.prefill_s = time.perf_counter() - t0
        log.info("prompt %d tokens (%d cached): prefill %.3f s in %d forwards (slowest %.3f s), snapshots "
                 "%.3f s", len(prompt_ids), stats.cached_tokens, stats.prefill_s, stats.prefill_chunks,
                 stats.slowest_chunk_s, stats.snapshot_s)
        t1 = time.perf_counter()
        ahead: Optional[Drafted] = None  # the next step's draft, queued before this step's read
        while True:
            cut, finish = cut_step(emitted, stops, max_tokens - len(out), len(prompt_ids) + len(out),
                                   engine.max_ctx)
            out.extend(cut)
            if stream.logprobs is not None:
                stream.logprobs.extend((logprobs or [])[:len(cut)])
            with faults.site("sample", inject=False):
                sampler.observe(cut)
            if grammar is not None and not finish:
                grammar.advance(cut)
            # another sequence may take its rows meanwhile; a draft queued ahead is then dropped
            if cut and (yield from boundary(engine, seq, cut, stream, stats)):
                ahead = None
            if finish:  # a draft queued ahead only wrote scratch rows: it is dropped
                break
            if stream.cancelled:
                finish = "cancelled"
                break
            room = min(max_tokens - len(out), engine.max_ctx - len(prompt_ids) - len(out))
            t_step = time.perf_counter()
            if shares_steps(engine.sequences, grammar):
                res = None
                while res is None:  # None: preempted before its step ran; its rows come back first
                    order = StepOrder(decoder, out[-1], sampler, room, want_trace, seq, ahead=ahead)
                    try:
                        res = yield from engine.shared_steps.take(order)
                    except KVPagesExhausted:  # no page for its step: it waits for another's, if one runs
                        if not engine.preemption.step_aside(seq):
                            raise
                    if res is None:
                        ahead = None
                        yield from boundary(engine, seq, [], stream, stats)
                        if seq.paused is not None:  # cancelled while it waited: no rows to step from
                            break
                if res is None:
                    finish = "cancelled"
                    break
                stats.shared_steps += order.shared > 1
                stats.drafted_ahead += ahead is not None and ahead.error is None
                ahead = order.next_ahead  # its next step's draft, queued before this one was read
            else:
                stats.drafted_ahead += ahead is not None and ahead.error is None
                launched = decoder.launch(out[-1], sampler, room, want_trace, grammar, ahead)
                try:  # the GPU drafts the next step while the host reads this one and streams it
                    ahead = decoder.draft_ahead(launched, room, grammar)
                finally:  # a launched step is always read: its commit is already queued
                    res = decoder.read(launched)
            stats.step_s += time.perf_counter() - t_step
            stats.steps += 1
            stats.accept_lengths.append(len(res.tokens))
            if traces is not None and res.trace is not None:
                traces.append(res.trace)
            emitted, logprobs = res.tokens, res.logprobs
        stats.decode_s = time.perf_counter() - t1
    except EngineOutOfMemory as e:
        # a failed prefill has recovered already; no page comes back from clearing snapshots
        if e.site != "prefill" and not isinstance(e, KVPagesExhausted):
            engine.recover_from_oom(e.site)
        raise
    except NonFiniteLogits:
        # the rows that overflowed (the prompt's, or the conversation's so far) may hold NaNs
        # or infinities: no later request reuses them, nor a snapshot of them
        seq.state.truncate(0)
        raise
    stats.completion_tokens = len(out)
    after = allocator_counts(engine.device)
    for name, before in counts.items():
        setattr(stats, name, after[name] - before)
    stream.result = GenerationResult(out, finish, stats, traces, stream.logprobs)


def prefill(engine: Engine, seq: LiveSequence, prompt_ids: list[int], stats: GenerationStats
            ) -> Iterator[Optional[torch.Tensor]]:
    """Prefill the rest of the prompt in ubatch chunks, yielding None after each chunk (where
    the other generations take their turn) and the last position's logits at the end; on OOM
    clear the device tier and retry once with half the ubatch (not below the floor). A chunk
    that finds no KV page while another sequence runs steps aside (its rows saved, the
    sequence paused) and yields None: the caller's boundary takes the rows back once pages come
    free, and the chunk runs again."""
    config = engine.config
    ubatch, retried = config.prefill_ubatch, False
    interval = config.state_checkpoint_interval
    state = seq.state
    logits = None
    while state.length < len(prompt_ids):
        start = state.length
        end = start + ubatch
        if state.recurrent:  # hybrids: chunks end where recurrent states are kept
            end = min(end, (start // interval + 1) * interval)
            if start < len(prompt_ids) - 1:
                end = min(end, len(prompt_ids) - 1)
        chunk = prompt_ids[start:end]
        try:
            c0 = time.perf_counter()
            logits = seq.decoder.prefill_chunk(chunk)
            stats.prefill_chunks += 1
            stats.slowest_chunk_s = max(stats.slowest_chunk_s, time.perf_counter() - c0)
            engine.on_progress()
        except KVPagesExhausted:
            # held by running sequences: neither clearing nor a smaller chunk frees one, but
            # theirs come free as they end: the prompt waits for them (Preemption.step_aside)
            if not engine.preemption.step_aside(seq):
                raise
            yield None
            continue
        except EngineOutOfMemory:
            engine.recover_from_oom("prefill")
            if retried or ubatch <= config.prefill_ubatch_floor:
                raise EngineOutOfMemory("prefill", f"a {len(chunk)}-token chunk did not fit "
                                        "even after the caches were cleared") from None
            retried, ubatch = True, max(config.prefill_ubatch_floor, ubatch // 2)
            log.warning("retrying prefill with ubatch %d", ubatch)
            continue
        if state.recurrent and (state.length % interval == 0 or state.length == len(prompt_ids) - 1):
            # where a later request can resume: the prompt but its last token (the most an
            # identical prompt may reuse), and every interval
            state.checkpoint()
        if state.length < len(prompt_ids):
            yield None
    assert logits is not None
    yield logits


def boundary(engine: Engine, seq: LiveSequence, tokens: list[int], stream: GenerationStream,
             stats: GenerationStats) -> Generator[list[int], None, bool]:
    """Yield `tokens` at a point where nothing of the sequence's step is under way, so that its
    rows may be taken for another sequence's pages meanwhile (preemption.py); if they
    were, get them back before going on (Preemption.resume), a turn at a time until they fit,
    unless the request is cancelled. A draft of the next step queued ahead may be in
    flight: it writes only scratch rows past the sequence's length, queued on the one stream
    before anything a later owner of those pages writes, and the caller drops it. Returns
    whether the sequence was preempted."""
    seq.pausable = True
    try:
        yield tokens
    finally:
        seq.pausable = False
    preempted = seq.paused is not None
    stats.preemptions += preempted
    while seq.paused is not None and not stream.cancelled and not engine.preemption.resume(seq, stats):
        yield []
    return preempted


def shares_steps(sequences: list[LiveSequence], grammar: Optional[GrammarConstraint]) -> bool:
    """Whether a sequence's next step goes into a step shared with the other running sequences
    (batch_step.py): while another generation runs, and without a grammar (whose host step
    advances with its own tree)."""
    return grammar is None and sum(s.busy for s in sequences) > 1


def cut_step(emitted: list[int], stops: set[int], allowed: int, total: int, max_ctx: int
             ) -> tuple[list[int], str]:
    """A step's tokens as far as they go out, and the finish reason they reach ("" for none): up
    to a stop token, at most `allowed` (what max_tokens leaves), and not past `max_ctx` with
    `total` tokens in the sequence before them."""
    for i, tok in enumerate(emitted[:allowed]):
        if tok in stops:
            return emitted[:i], "stop"
    cut = emitted[:allowed]
    if len(cut) >= allowed:
        return cut, "length"
    if total + len(cut) >= max_ctx:
        return cut, "length"
    return cut, ""
