"""`flashtree bench --sessions`: decode steps of several live sequences one after another against
shared (runtime/batch_step.py: on the GPU one draft phase and one verify phase over every
sequence, elsewhere one verify forward over every tree).

A round is one ddtree step of every sequence. In turn, each sequence runs its own step (on the
GPU its own captured device step), as sequences decoding one after another do; shared, one
SharedSteps.run takes them all, as the engine's running generations do. Either way each step is
pipelined as the engine runs it: its sequence's next draft is queued before it is read, so the
GPU drafts while the host reads. Both passes start from
the same prefilled sequences (seeded random prompts of `context` tokens) and the same first
tokens, so greedy they emit the same tokens, and each row says whether they did: a shared step
must not change what a sequence outputs.

Random weights accept about one token a step on either path, so what the rows compare is the
time of a round at the same trees' sizes; tokens/s at a real accept length scale with it. A
round can not take less than one verify of all the rows plus each sequence's draft. Nothing here
needs a GPU: on the CPU the steps run eagerly and the shared one takes the host path, which is
how the tests check the measurement.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..models import inputs
from ..models.dflash import DFlashDraft
from ..models.kv_cache import PAGE_ROWS, pages_for
from ..models.registry import TargetModel
from ..runtime.batch_step import SharedSteps, StepOrder
from ..runtime.decoding import Decoder, StepResult
from ..runtime.device_step import Drafted
from ..runtime.graphs import ModelRunner
from ..runtime.sampling import Sampler, SamplingParams
from ..runtime.sequence import SequenceState
from .measure import kernel_times, sync

WARMUP = 2  # untimed rounds before each pass's timed ones: the graphs capture in them
PROFILED = 3  # rounds after the timed ones whose kernels the largest count's row profiles (one untimed)
PREFILL_CHUNK = 2048


def rows_needed(context: int, rounds: int, block_size: int, budget: int) -> int:
    """The cache rows (and positions) a sequence of the measurement can reach: its prompt, every
    round of a pass emitting a whole block, and the scratch rows of one more step's tree or block
    (each pass starts again at the prompt's end)."""
    return context + (WARMUP + rounds + 1 + PROFILED) * block_size + max(budget + 1, block_size)


@dataclass
class Session:
    """A prefilled sequence: its decoder, its prompt's length and the greedy token after it."""
    decoder: Decoder
    start: int
    first: int


@dataclass
class Pass:
    """The rounds of one pass: the median round's ms, the tokens the timed rounds emitted (every
    sequence's), each sequence's output in order (the untimed rounds' too), and where asked on a
    GPU the device time per kernel of a round after them (measure.kernel_times)."""
    ms: float
    timed_tokens: int
    tokens: list[list[int]]
    kernels: Optional[list[dict[str, Any]]] = None

    def tokens_per_s(self, rounds: int) -> float:
        """A timed round's mean tokens over the median round's time."""
        return self.timed_tokens / rounds / (self.ms / 1e3)


def open_sessions(target: TargetModel, draft: DFlashDraft, count: int, context: int, budget: int,
                  rounds: int, kv_type: Optional[str] = None, dflash2_tree: str = "topk") -> list[Session]:
    """`count` sequences, each with its own page tables over KV pools they share (as the engine's
    live sequences: their forwards' attention then runs one launch for all), runner (capturing on
    a GPU) and ddtree decoder of `budget` (a DFlash2 draft's tree from `dflash2_tree`),
    prefilled with a random prompt of `context` tokens (the same prompts whatever the count). A
    hybrid's recurrent states are kept at the prompt's end, where each pass starts."""
    norm = target.model.norm.weight  # dense in the model dtype, quantized or not
    dtype, device = norm.dtype, norm.device
    bs = draft.config.block_size
    rows = rows_needed(context, rounds, bs, budget)
    pools: list = [count * pages_for(rows) * PAGE_ROWS] * 2  # the first sequence's caches make them
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        state = SequenceState(target.new_cache(rows, dtype, device, budget + 1, kv_type, pool=pools[0]),
                              draft.new_cache(rows, dtype, device, pool=pools[1]), device)
        pools = [cache.pool for cache in state.kv_caches()]
        runner = ModelRunner(target, draft, state, draft.config.target_layer_ids, [1, budget + 1], bs,
                             device.type == "cuda")
        dec = Decoder(target, draft, state, runner, "ddtree", budget, bs, True, dflash2_tree)
        prompt = torch.randint(0, target.config.vocab_size, (context,), generator=gen).tolist()
        for at in range(0, context, PREFILL_CHUNK):
            logits = dec.prefill_chunk(prompt[at:at + PREFILL_CHUNK])
        state.checkpoint()
        out.append(Session(dec, context, int(logits.argmax())))
    return out


def _round(sessions: list[Session], bonus: list[int], sampler: Sampler, shared: Optional[SharedSteps],
           ahead: list[Optional[Drafted]]) -> list[StepResult]:
    """One step of every sequence after its `bonus`: in turn, or all in `shared`, each pipelined
    as the engine's generations run their steps: a step's next draft is queued before the step
    is read (on the GPU; `ahead` holds each sequence's, used by its next step and replaced).
    The room each step is given (two blocks) always leaves a whole block for the next draft."""
    room = 2 * sessions[0].decoder.block_size
    if shared is None:
        results = []
        for i, (s, b) in enumerate(zip(sessions, bonus)):
            launched = s.decoder.launch(b, sampler, room, ahead=ahead[i])
            try:
                ahead[i] = s.decoder.draft_ahead(launched, room)
            finally:
                results.append(s.decoder.read(launched))
        return results
    orders = [StepOrder(s.decoder, b, sampler, room, ahead=a) for s, b, a in zip(sessions, bonus, ahead)]
    shared.run(orders)
    results = []
    for i, order in enumerate(orders):
        if order.error is not None:
            raise order.error
        assert order.result is not None
        results.append(order.result)
        ahead[i] = order.next_ahead
    return results


def run_pass(sessions: list[Session], shared: bool, rounds: int, sampler: Sampler, profile: bool = False) -> Pass:
    """WARMUP + `rounds` rounds from the prompts' ends (each sequence cut back there first), the
    device waited for around each; the timed ones are the last `rounds`. With `profile`, on a GPU,
    1 + PROFILED rounds more under the profiler: where a round's device time goes, kernel by
    kernel (their tokens are not kept)."""
    device = sessions[0].decoder.device
    steps = SharedSteps() if shared else None
    bonus = [s.first for s in sessions]
    ahead: list[Optional[Drafted]] = [None] * len(sessions)
    tokens: list[list[int]] = [[] for _ in sessions]
    times, timed = [], 0
    for s in sessions:
        s.decoder.state.truncate(s.start)
    try:
        for i in range(WARMUP + rounds):
            sync(device)
            t0 = time.perf_counter()
            results = _round(sessions, bonus, sampler, steps, ahead)
            sync(device)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
                timed += sum(len(r.tokens) for r in results)
            for out, r in zip(tokens, results):
                out.extend(r.tokens)
            bonus = [r.tokens[-1] for r in results]
        kernels = None
        if profile and device.type == "cuda":
            def profiled_round() -> None:
                bonus[:] = [r.tokens[-1] for r in _round(sessions, bonus, sampler, steps, ahead)]
            kernels = kernel_times(profiled_round, PROFILED, top=24)
    finally:
        if steps is not None:
            steps.close()
    return Pass(1e3 * statistics.median(times), timed, tokens, kernels)


@contextmanager
def launches_per_sequence() -> Iterator[None]:
    """Batched forwards run their attention and recurrent scans a launch per sequence, as before
    they became one launch for all (models/inputs.py: AT_ONCE), until the block ends."""
    kept, inputs.AT_ONCE = inputs.AT_ONCE, False
    try:
        yield
    finally:
        inputs.AT_ONCE = kept


def session_row(target: TargetModel, draft: DFlashDraft, count: int, context: int, budget: int, rounds: int,
                kv_type: Optional[str] = None, dflash2_tree: str = "topk", profile: bool = False) -> dict[str, Any]:
    """The row of `count` sequences: ms a round in turn and shared, the speedup, each pass's
    tokens/s, and whether the two passes emitted the same tokens; the shared round again with a
    launch of attention and of each recurrent scan per sequence ("shared_per_sequence_ms", the
    same run's baseline of the one launch for all; its tokens must be the same too); with `profile` on a GPU, each pass's
    device time per kernel of a round ("kernels": in_turn, shared)."""
    sessions = open_sessions(target, draft, count, context, budget, rounds, kv_type, dflash2_tree)
    sampler = Sampler(SamplingParams(), target.config.vocab_size, sessions[0].decoder.device, [])
    try:
        turn = run_pass(sessions, False, rounds, sampler, profile)
        shared = run_pass(sessions, True, rounds, sampler, profile)
        with launches_per_sequence():
            per_sequence = run_pass(sessions, True, rounds, sampler)
    finally:
        for s in sessions:
            s.decoder.runner.close()
    kernels = {"kernels": {"in_turn": turn.kernels, "shared": shared.kernels}} if turn.kernels else {}
    return {**kernels, "sessions": count, "in_turn_ms": round(turn.ms, 3), "shared_ms": round(shared.ms, 3),
            "shared_per_sequence_ms": round(per_sequence.ms, 3),
            "speedup": round(turn.ms / shared.ms, 3),
            "in_turn_tokens_per_s": round(turn.tokens_per_s(rounds), 1),
            "shared_tokens_per_s": round(shared.tokens_per_s(rounds), 1),
            "same_tokens": turn.tokens == shared.tokens == per_sequence.tokens}


def measure_sessions(target: TargetModel, draft: DFlashDraft, counts: Sequence[int], context: int, budget: int,
                     rounds: int, kv_type: Optional[str] = None, dflash2_tree: str = "topk") -> dict[str, Any]:
    """What a bench run records under "sessions": the context, budget and rounds, and a row per
    count of sequences (session_row; the largest count's with its kernel profiles), each count's
    sequences freed before the next."""
    rows = []
    for count in counts:
        rows.append(session_row(target, draft, count, context, budget, rounds, kv_type, dflash2_tree,
                                profile=count == max(counts)))
        if target.model.norm.weight.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"context": context, "budget": budget, "rounds": rounds, "rows": rows}
