"""One decode step for several live sequences at once: one target forward verifies every tree.

A batch-1 verify reads every weight to use it for a tree's 23 rows; the trees of several
sequences in one forward read them once for all (ForwardInput.batch), while each sequence's
attention and recurrent scan still run over its own caches. Each sequence drafts and builds its
tree as it would alone (its draft forward over its own draft cache), so the trees, the draws,
the walks and the commits are the ones its step alone would give: a sequence's greedy output is
the same whoever shares its steps.

Two paths. Over static buffers (the CUDA path) one draft phase drafts every sequence's block and
builds each tree on the device, then one verify phase, each captured once per set of sequences,
runs the batched verify and each sequence's argmax, walk and commit; each step is then read as
alone. Both phases apply the head once over every sequence's rows (it is as large as a few
layers, and its read costs the same for 16 rows or 90), and what follows it once too: the draft
phase's log-softmax and top-k, the verify phase's argmax (a launch over 15 or 23 rows of the
vocabulary leaves most of the GPU idle). A plain greedy request's argmax, walk and commit are in
the phase;
another's (a temperature, a logit bias, penalties, logprobs) draws from its rows of the phase's
output after it, eagerly, as its step alone would. Before any step is read the next steps' draft
phase is queued behind it (as the pipelined loop drafts ahead alone), its roots the bonuses the
commits left on the device: the GPU drafts while the host reads and streams, and each
generation passes its draft to its next order. Elsewhere (the CPU, --no-cuda-graphs) the host
path: trees built and walked on the host around one eager batched verify.

An error while drafting one sequence's tree fails that sequence's step only, and so do logits
that are not finite on its accepted path (each sequence's rows carry their own flags, read with
its step: NonFiniteLogits). An error in the shared verify (an out-of-memory, mostly) is not
charged to the batch: each sequence then verifies alone, so the failure lands on the step that
causes it and the others go on; nothing was committed before, since the verify only writes
scratch rows. Both paths take that rule from one place, step_orders.verify_shared, where the
orders and the host path live.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import torch

from . import faults
from ..errors import KVPagesExhausted
from ..kernels.tree import draft_top_k
from .decoding import Decoder
from .device_step import DeviceSteps, Drafted, Launched, Proposal, Walk
from .graphs import Outputs, Replay
from .sampling import Draws, argmax_draws
from .step_orders import StepOrder, run_host_orders, verify_shared
from ..models.dflash import DFlashDraft
from ..models.inputs import ForwardInput


Staged = tuple[StepOrder, DeviceSteps, Drafted]
# captured shared phases kept at most: each set of sequences that runs together captures two (its
# draft and its verify phase), and 8 sequences make 247 sets of two or more; the least recently
# used go (a set that comes back captures again, a fraction of a second)
MAX_SHARED_PHASES = 16


class SharedSteps:
    """The steps the running generations queue to run together, and the shared phases captured
    for them. A generation is a generator that the engine's caller advances one boundary at a
    time, each in turn: `take` queues its order and yields once (an empty step), in which the
    others queue theirs; the first of them to come back runs every queued order (`run`) and
    each then takes its own result."""

    def __init__(self) -> None:
        self.orders: list[StepOrder] = []
        self.running: list[StepOrder] = []  # the orders of the step being run
        self.phases: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # least recently used first
        self.pool: Optional[tuple] = None

    def take(self, order: StepOrder) -> Iterator[list[int]]:
        """Queue `order`, yield [] once, and return its step's result (or raise its error); None
        where its sequence was preempted before the step ran (preemption.py): its
        generation takes its rows back and queues again. Until its step is under way, the
        order's sequence may be preempted (`pausable`)."""
        self.orders.append(order)
        try:
            _pausable(order, True)
            yield []
            _pausable(order, False)
            if not order.done and not order.withdrawn:
                orders, self.orders = self.orders, []
                self.run(orders)
        finally:  # a generation closed while it waited leaves no order for a sequence it gave back
            _pausable(order, False)
            if order in self.orders:
                self.orders.remove(order)
        if order.error is not None:
            raise order.error
        if order.result is None and order.withdrawn:
            return None
        assert order.result is not None
        return order.result

    def withdraw(self, decoder: Decoder) -> None:
        """The order of a sequence just preempted leaves the step it was to share."""
        for order in self.orders + self.running:
            if order.decoder is decoder and not order.done:
                order.withdrawn = True

    def _reserve(self, orders: list[StepOrder]) -> list[StepOrder]:
        """Give each order's sequence the pages its step may write before any step is under way:
        where none are left, a waiting order's sequence may be preempted for them (the latest
        request's first) and its order withdrawn; an order that finds none fails alone. The
        orders still to run."""
        self.running = orders
        try:
            for order in orders:
                if order.withdrawn:
                    continue
                _pausable(order, False)
                dec = order.decoder
                try:
                    dec.state.reserve(dec.step_rows)  # past its capacity: its step refuses
                except Exception as e:  # noqa: BLE001 (no page left: this sequence's step fails)
                    order.error = e
        finally:
            for order in orders:
                _pausable(order, False)
        return [o for o in orders if not o.withdrawn and o.error is None]

    @torch.inference_mode()
    def run(self, orders: list[StepOrder]) -> None:
        """One step for each order (their pages reserved first, `_reserve`): the device path
        where every runner has static buffers."""
        orders = self._reserve(orders)
        if not orders:
            return
        if not all(order.decoder.runner.static for order in orders):
            run_host_orders(orders)
            return
        staged: list[Staged] = []
        drafted = self._draft_together([o for o in orders if o.ahead is None])
        for order in orders:
            try:
                staged += self._stage(order, order.ahead or drafted.get(id(order)))
            except Exception as e:  # noqa: BLE001 (this sequence's step fails; the others go on)
                order.error = e
        verified = verify_shared(staged, self._verify_together, _own_phase)
        launched: list[tuple[StepOrder, Launched]] = []
        for i, (order, steps, drafted_tree) in enumerate(staged):
            if order.done:  # its own phase failed, or ran its step alone
                continue
            try:
                if verified is None or order.sampler.plain_greedy:
                    launched.append((order, steps.launched(drafted_tree, order.sampler, order.want_trace, True)))
                else:
                    launched.append((order, _draw_after(order, steps, drafted_tree, *verified[i])))
            except Exception as e:  # noqa: BLE001
                order.error = e
        self._draft_ahead(launched)
        for order, step in launched:
            try:
                order.result = order.decoder.read(step)
                order.shared = len(staged) if verified is not None else 1
            except Exception as e:  # noqa: BLE001
                order.error = e

    def _verify_together(self, staged: list[Staged]) -> list[Outputs]:
        """The shared verify phase over the staged steps: each step's hidden rows and features
        (those of a plain greedy step, walked and committed in the phase, unused)."""
        steps = [s for _, s, _ in staged]
        drawn = tuple(order.sampler.plain_greedy for order, _, _ in staged)
        return self._phase(("verify", drawn), steps, self._verify_phase(steps, drawn))()

    def _draft_together(self, orders: list[StepOrder]) -> dict[int, Drafted]:
        """One draft phase for the orders whose DFlash drafts can share it (_drafts_together):
        their blocks in one draft forward, then each sequence's tree built from its rows. Their
        Drafted by id(order); {} when fewer than two can, or when the shared phase fails (each
        then drafts alone)."""
        together = [o for o in orders if _drafts_together(o.decoder, o.max_emit)]
        if len(together) < 2:
            return {}
        try:
            drafted = self._queue_drafts([o.decoder for o in together], [o.bonus for o in together])
        except Exception:  # noqa: BLE001 (each drafts alone: an error lands on its own step)
            return {}
        return {id(o): d for o, d in zip(together, drafted)}

    def _draft_ahead(self, launched: list[tuple[StepOrder, Launched]]) -> None:
        """Queue the next step's draft of each launched order behind this step's verify, before
        any is read, so that the GPU drafts while the host reads and streams (Decoder.draft_ahead's
        rule: only where the next depth cap is certain, this step's most tokens leaving room for
        a whole block): one shared draft phase for two or more, each root the bonus its commit
        left on the device. Each such order's next_ahead; where the shared phase fails, none
        (each drafts at its next step, where an error lands on its own step)."""
        ready = [(o, step) for o, step in launched
                 if o.decoder.next_block_certain(step, o.max_emit) and _drafts_together(o.decoder, o.max_emit)]
        if len(ready) == 1:
            order, step = ready[0]
            order.next_ahead = order.decoder.draft_ahead(step, order.max_emit)
        elif ready:
            try:
                drafted = self._queue_drafts([o.decoder for o, _ in ready], [None] * len(ready))
            except Exception:  # noqa: BLE001 (no draft ahead: the next steps draft as they come)
                return
            for (order, _), d in zip(ready, drafted):
                order.next_ahead = d

    def _queue_drafts(self, decoders: list[Decoder], bonuses: list[Optional[int]]) -> list[Drafted]:
        """The shared draft phase of these sequences' DFlash blocks at the block's depth cap,
        each root its bonus (None: the one its last commit left on the device)."""
        steps = [dec.device_steps() for dec in decoders]
        with faults.site("draft"):
            for dec, s, bonus in zip(decoders, steps, bonuses):
                if bonus is not None:
                    dec.runner.bonus.fill_(bonus)
                s.buf.set_cap(dec.block_size - 1)
            self._phase("draft", steps, self._draft_phase(steps))()
        return [Drafted(s.depth, s.size(s.depth), s.is_chain(s.depth)) for s in steps]

    @staticmethod
    def _draft_phase(steps: list[DeviceSteps]) -> Any:
        def phase() -> None:
            batch = ForwardInput.batch([s.dec.runner.block_input() for s in steps])
            dec = steps[0].dec
            # the head and the candidates (one engine's blocks take as many) once for every
            # block's rows: each row's values are its own whatever rows come with it, and a
            # launch for 15 rows leaves most of the GPU idle
            logits = dec.target.logits(dec.draft(batch))
            proposals: list[Proposal]
            if steps[0].chain_mode:  # each block's first row is its bonus
                proposals = [rows[1:].argmax(-1) for rows in batch.split(logits)]
            else:
                vals, ids = draft_top_k(logits, steps[0].k)
                proposals = [(v[1:], i[1:]) for v, i in zip(batch.split(vals), batch.split(ids))]
            DeviceSteps.build_together(steps, proposals)
        return phase

    @staticmethod
    def _stage(order: StepOrder, drafted: Optional[Drafted]) -> list[Staged]:
        """Draft the order's tree (unless a shared draft phase, or one queued ahead, did) and stage it for a shared
        phase ([it]); a step that cannot join one (ar, no room for a draft, a tree larger than a
        captured verify) runs alone ([])."""
        dec = order.decoder
        cap = min(dec.block_size - 1, order.max_emit - 1)
        if dec.draft is None or cap <= 0:
            order.result, order.shared = dec.step(order.bonus, order.sampler, order.max_emit, order.want_trace), 1
            return []
        steps = dec.device_steps()
        if drafted is not None and drafted.error is not None:  # a draft queued ahead that failed to launch
            raise drafted.error
        if drafted is None or drafted.cap != cap:
            drafted = steps.draft(cap, order.bonus)
        with faults.site("verify", inject=False):
            joins = steps.stage(drafted, None)
        if not joins:
            order.result, order.shared = dec.read(steps.verify(drafted, order.sampler, order.want_trace)), 1
            return []
        return [(order, steps, drafted)]

    @staticmethod
    def _verify_phase(steps: list[DeviceSteps], drawn: tuple[bool, ...]) -> Callable[[], list[Outputs]]:
        """The batched verify of the steps' trees, the head over all their rows, then for the
        steps whose `drawn` is true (plain greedy) each one's argmax and walk, the draft's
        context rows of every walked path, and each one's commit; every step's outputs. Each
        step's walk packs its own rows' finite flags: one sequence's overflow fails its read only."""
        def phase() -> list[Outputs]:
            parts = [s.dec.runner.fill_verify(s.rows, *s.static_rows()).inp for s in steps]
            batch = ForwardInput.batch(parts, steps[0].dec.runner.feature_layers)
            target = steps[0].dec.target
            hidden, feats = target(batch)
            outputs = list(zip(batch.split(hidden), batch.split(feats) if feats is not None else [None] * len(steps)))
            if any(drawn):  # the head read once for every greedy step's rows (the others' too: it costs the same)
                every = argmax_draws(target.logits(hidden))  # each sequence's rows' own flags, split with its draws
                split = [Draws(t, f) for t, f in zip(batch.split(every.tokens), batch.split(every.finite))]
                greedy = [(s, f, draws) for s, g, (_, f), draws in zip(steps, drawn, outputs, split) if g]
                walks = DeviceSteps.walk_together([s for s, _, _ in greedy], [d for _, _, d in greedy])
                walked = [(s, walk, f) for (s, f, _), walk in zip(greedy, walks)]
                _append_contexts(walked)
                DeviceSteps.commit_together([s for s, _, _ in walked], [walk for _, walk, _ in walked])
            return outputs
        return phase

    def _phase(self, kind: Any, steps: list[DeviceSteps], phase: Any) -> Any:
        """A shared phase over these sequences' steps (`kind` "draft", or the verify's with which
        steps it draws): captured at its first use where their runners capture (one graph per
        kind and set of sequences, all in one pool), else `phase` itself, run directly."""
        if not steps[0].dec.runner.captures:
            return phase
        key = (kind, *(id(s) for s in steps))
        if key in self.phases:
            self.phases.move_to_end(key)
        else:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            while len(self.phases) >= MAX_SHARED_PHASES:  # a graph's image lies outside the allocator
                self.phases.popitem(last=False)[1].reset()

            @contextlib.contextmanager
            def preserved() -> Iterator[None]:  # every sequence's committed state, around the warm-up runs
                with contextlib.ExitStack() as stack:
                    for s in steps:
                        stack.enter_context(s.dec.state.preserved())
                    yield

            with torch.inference_mode():
                self.phases[key] = Replay(phase, self.pool, preserved)
        return self.phases[key]

    def close(self) -> None:
        """Release the shared phases' graphs."""
        for run in self.phases.values():
            run.reset()
        self.phases.clear()


def _own_phase(staged: Staged) -> None:
    """A staged step's verify alone where the shared one did not run: a plain greedy step's own
    phase (its verify graph, read after), another's whole step (its result); where it fails,
    the order's error."""
    order, steps, drafted = staged
    try:
        if not order.sampler.plain_greedy:
            order.result = order.decoder.read(steps.verify(drafted, order.sampler, order.want_trace))
            order.shared = 1
            return
        with faults.site("sample"):
            runner = steps.dec.runner
            runner.graph(("verify", *steps.name), steps.greedy_phase, steps.dec.state.preserved)()
    except Exception as e:  # noqa: BLE001
        order.error = e


def _draw_after(order: StepOrder, steps: DeviceSteps, drafted: Drafted, hidden: torch.Tensor,
                feats: Optional[torch.Tensor]) -> Launched:
    """A step the shared phase verified but did not draw: the head over its tree's rows of the
    phase's output, the sampler's draws, the walk and the commit (DeviceSteps.draw_and_commit)."""
    with faults.site("verify", inject=False):
        logits = order.decoder.target.logits(hidden[:drafted.n])
    return steps.draw_and_commit(drafted, order.sampler, order.want_trace, logits, feats)


def _drafts_together(dec: Decoder, max_emit: int) -> bool:
    """Whether a sequence's next draft can join a shared draft phase: a DFlash draft over its
    static buffers (not an instance's own _draft_logprobs, a test's oracle), a whole block to
    draft and room for it: its pages, where the pool has them (a draft ahead of the next step
    finds none when the pool is dry, and steps in flight leave no sequence to preempt for one:
    that sequence drafts at its next step, whose reservation may preempt another)."""
    if not (type(dec.draft) is DFlashDraft and dec.runner.draft_run is not None
            and "_draft_logprobs" not in vars(dec) and max_emit >= dec.block_size):
        return False
    try:
        return dec.state.reserve(dec.block_size)
    except KVPagesExhausted:
        return False


def _pausable(order: StepOrder, waiting: bool) -> None:
    """Whether the order's sequence may be preempted: while the order waits unrun, its draft
    queued ahead or not. A draft queued ahead wrote only scratch rows past the sequence's length,
    queued on the one stream before anything a later owner of those pages writes; preempted, the
    order is withdrawn and its generation drops that draft (generation_loop: it drafts again
    once its rows are back). Otherwise, with every waiting order's draft queued ahead (the CUDA
    path's steps), no sequence could give its pages to another."""
    if order.sequence is not None:
        order.sequence.pausable = waiting and not order.withdrawn


def _append_contexts(walked: list[tuple[DeviceSteps, Walk, Optional[torch.Tensor]]]) -> None:
    """The draft's context rows of each walked path (its features and tokens), inside a shared
    verify phase: one DFlash draft forward for all the paths (its projection of the features
    and each layer's K/V projection read once, each sequence's rows stored in its own cache,
    ForwardInput.batch; a DFlash2 draft's too), else each sequence's own append (an MTP draft's
    rows, or a single one)."""
    walked = [(s, walk, f) for s, walk, f in walked if f is not None and s.dec.draft is not None]
    with faults.site("verify", inject=False):
        if len(walked) > 1 and all(isinstance(s.dec.draft, DFlashDraft) for s, _, _ in walked):
            parts = []
            for s, walk, f in walked:
                state = s.dec.state
                state.check_room(walk.path.shape[0])
                parts.append(ForwardInput(embeds=s.context_rows(walk, f)[0], cache=state.draft,
                                          lengths=state.length_dev))
            walked[0][0].dec.draft.write_context(ForwardInput.batch(parts))
            return
        for s, walk, f in walked:
            s.dec.runner.append_context(*s.context_rows(walk, f), True)
