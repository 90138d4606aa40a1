"""One decode step for several live sequences at once: one target forward verifies every tree.

A batch-1 verify reads every weight to use it for a tree's 23 rows; the trees of several
sequences in one forward read them once for all (ForwardInput.batch), while each sequence's
attention and recurrent scan still run over its own caches. Each sequence drafts and builds its
tree as it would alone (its draft forward over its own draft cache), so the trees, the draws,
the walks and the commits are the ones its step alone would give: a sequence's greedy output is
the same whoever shares its steps.

Two paths. Over static buffers (the CUDA path) each sequence queues its device step's draft
phase as alone (its tree built on the device), then one shared phase, captured once per set of
sequences, runs the batched verify and each sequence's head, argmax, walk and commit; each step
is then read as alone. A plain greedy request's head, argmax, walk and commit are in the phase;
another's (a temperature, a logit bias, penalties, logprobs) draws from its rows of the phase's
output after it, eagerly, as its step alone would. Elsewhere (the CPU,
--no-cuda-graphs) the host path: trees built and walked on the host around one eager batched
verify.

An error while drafting one sequence's tree fails that sequence's step only. An error in the
shared verify (an out-of-memory, mostly) is not charged to the batch: each sequence then
verifies alone, so the failure lands on the step that causes it and the others go on; nothing
was committed before, since the verify only writes scratch rows. Both paths take that rule
from one place, `verify_shared`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch

from . import faults
from .decoding import Decoder, PlannedTree, StepResult, TreeRows
from .device_step import DeviceSteps, Drafted, Launched, plain_greedy
from .graphs import Outputs, Replay
from .sampling import Sampler
from .sequences import LiveSequence
from ..models.dflash import DFlashDraft
from ..models.inputs import ForwardInput


@dataclass(eq=False)
class StepOrder:
    """A sequence's request for one decode step emitting at most `max_emit` tokens after
    `bonus`, and its outcome: `result`, or the `error` its step raised; `shared` is how many
    sequences' trees its verify forward held."""
    decoder: Decoder
    bonus: int
    sampler: Sampler
    max_emit: int
    want_trace: bool = False
    sequence: Optional[LiveSequence] = None  # what may be preempted while the order waits unrun
    result: Optional[StepResult] = None
    error: Optional[BaseException] = None
    shared: int = 0
    withdrawn: bool = False  # its sequence was preempted before the step ran

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


Item = TypeVar("Item")
Verified = TypeVar("Verified")


def verify_shared(items: list[Item], together: Callable[[list[Item]], Verified],
                  alone: Callable[[Item], None]) -> Optional[Verified]:
    """The verify of several sequences' steps, `items`, on either path: `together(items)`, the
    shared verify, as the out-of-memory site "verify"; its result (never None). With one item,
    or where the shared verify raises, each item's verify runs `alone` instead (None): the shared
    one wrote only scratch rows, so nothing was committed, and an error (an out-of-memory,
    mostly) is not charged to the batch but lands on the step that causes it, while the others
    go on."""
    if len(items) > 1:
        try:
            with faults.site("verify"):
                return together(items)
        except Exception:  # noqa: BLE001 (each verifies alone below)
            pass
    for item in items:
        alone(item)
    return None


def run_host_orders(orders: list[StepOrder]) -> None:
    """Run one step for each order on the host path (their decoders over distinct sequences
    of one target)."""
    planned: list[tuple[StepOrder, PlannedTree]] = []
    for order in orders:
        dec = order.decoder
        try:
            dec.state.settled("a shared step")
            planned.append((order, dec.plan_tree(order.bonus, min(dec.block_size - 1, order.max_emit - 1))))
        except Exception as e:  # noqa: BLE001 (this sequence's step fails; the others go on)
            order.error = e
    starts = [order.decoder.state.length for order, _ in planned]
    verified = verify_shared(planned, _verify_host, _alone)
    if verified is not None:
        _accept_each(planned, starts, *verified)


def _alone(planned: tuple[StepOrder, PlannedTree]) -> None:
    """A planned step's verify alone, its walk and its commit: the order's result or error."""
    order, plan = planned
    try:
        order.result = order.decoder.verify_tree(plan, order.sampler, order.want_trace)
        order.shared = 1
    except Exception as e:  # noqa: BLE001
        order.error = e


def _verify_host(planned: list[tuple[StepOrder, PlannedTree]]
                 ) -> tuple[list[TreeRows], torch.Tensor, Optional[torch.Tensor]]:
    """One eager target forward over every planned tree: their rows, hidden states and features."""
    rows = [order.decoder.tree_rows(plan.tree) for order, plan in planned]
    parts = []
    for (order, _), r in zip(planned, rows):
        order.decoder.state.check_room(r.ids.shape[0])
        parts.append(order.decoder.runner.target_input(r.ids, r.positions, r.mask, r.index))
    first = planned[0][0].decoder
    hidden, feats = first.target(ForwardInput.batch(parts, first.runner.feature_layers))
    return rows, hidden, feats


def _accept_each(planned: list[tuple[StepOrder, PlannedTree]], starts: list[int], rows: list[TreeRows],
                 hidden: torch.Tensor, feats: Optional[torch.Tensor]) -> None:
    """Each sequence's walk and commit over its share of the shared verify's outputs."""
    sizes = [r.ids.shape[0] for r in rows]
    hiddens = hidden.split(sizes)
    features = feats.split(sizes) if feats is not None else [None] * len(sizes)
    for (order, plan), r, h, f, start in zip(planned, rows, hiddens, features, starts):
        try:
            order.result = order.decoder.accept(plan, order.sampler, r, h, f, start, order.want_trace)
            order.shared = len(planned)
        except Exception as e:  # noqa: BLE001
            order.error = e


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
        where its sequence was preempted before the step ran (Engine._reclaim_pages): its
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
                    dec.state.reserve(max(dec.budget + 1, dec.block_size))  # past its capacity: its step refuses
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
        drafted = self._draft_together(orders)
        for order in orders:
            try:
                staged += self._stage(order, drafted.get(id(order)))
            except Exception as e:  # noqa: BLE001 (this sequence's step fails; the others go on)
                order.error = e
        verified = verify_shared(staged, self._verify_together, _own_phase)
        for i, (order, steps, drafted) in enumerate(staged):
            if order.done:  # its own phase failed, or ran its step alone
                continue
            try:
                if verified is None or plain_greedy(order.sampler):
                    launched = steps.launched(drafted, order.sampler, order.want_trace, True)
                else:
                    launched = _draw_after(order, steps, drafted, *verified[i])
                order.result = order.decoder.read(launched)
                order.shared = len(staged) if verified is not None else 1
            except Exception as e:  # noqa: BLE001
                order.error = e

    def _verify_together(self, staged: list[Staged]) -> list[Outputs]:
        """The shared verify phase over the staged steps: each step's hidden rows and features
        (those of a plain greedy step, walked and committed in the phase, unused)."""
        steps = [s for _, s, _ in staged]
        drawn = tuple(plain_greedy(order.sampler) for order, _, _ in staged)
        return self._phase(("verify", drawn), steps, self._verify_phase(steps, drawn))()

    def _draft_together(self, orders: list[StepOrder]) -> dict[int, Drafted]:
        """One draft phase for the orders whose DFlash drafts can share it (the whole block to
        draft, room for it, the draft's static buffers): their blocks in one draft forward, then
        each sequence's tree built from its rows. Their Drafted by id(order); {} when fewer than
        two can, or when the shared phase fails (each then drafts alone)."""
        def joins(order: StepOrder) -> bool:
            dec = order.decoder
            return (type(dec.draft) is DFlashDraft and dec.runner.draft_run is not None
                    and "_draft_logprobs" not in vars(dec) and order.max_emit >= dec.block_size
                    and dec.state.reserve(dec.block_size))

        together = [o for o in orders if joins(o)]
        if len(together) < 2:
            return {}
        steps = [o.decoder.device_steps() for o in together]
        try:
            with faults.site("draft"):
                for order, s in zip(together, steps):
                    order.decoder.runner.bonus.fill_(order.bonus)
                    s.buf.set_cap(order.decoder.block_size - 1)
                self._phase("draft", steps, self._draft_phase(steps))()
        except Exception:  # noqa: BLE001 (each drafts alone: an error lands on its own step)
            return {}
        return {id(o): Drafted(s.depth, s.size(s.depth), s.is_chain(s.depth)) for o, s in zip(together, steps)}

    @staticmethod
    def _draft_phase(steps: list[DeviceSteps]) -> Any:
        def phase() -> None:
            batch = ForwardInput.batch([s.dec.runner.block_input() for s in steps])
            hidden = steps[0].dec.draft(batch)
            for s, h in zip(steps, batch.split(hidden)):
                s._build(True, (h[1:], None))
        return phase

    @staticmethod
    def _stage(order: StepOrder, drafted: Optional[Drafted]) -> list[Staged]:
        """Draft the order's tree (unless a shared draft phase did) and stage it for a shared
        phase ([it]); a step that cannot join one (ar, no room for a draft, a tree larger than a
        captured verify) runs alone ([])."""
        dec = order.decoder
        cap = min(dec.block_size - 1, order.max_emit - 1)
        if dec.draft is None or cap <= 0:
            order.result, order.shared = dec.step(order.bonus, order.sampler, order.max_emit, order.want_trace), 1
            return []
        steps = dec.device_steps()
        drafted = drafted or steps.draft(cap, order.bonus)
        with faults.site("verify", inject=False):
            joins = steps.stage(drafted, None)
        if not joins:
            order.result, order.shared = dec.read(steps.verify(drafted, order.sampler, order.want_trace)), 1
            return []
        return [(order, steps, drafted)]

    @staticmethod
    def _verify_phase(steps: list[DeviceSteps], drawn: tuple[bool, ...]) -> Callable[[], list[Outputs]]:
        """The batched verify of the steps' trees, then the head, argmax, walk and commit of
        each step whose `drawn` is true (plain greedy); every step's outputs."""
        def phase() -> list[Outputs]:
            parts = [s.dec.runner.fill_verify(s.rows, *s.static_rows()).inp for s in steps]
            batch = ForwardInput.batch(parts, steps[0].dec.runner.feature_layers)
            hidden, feats = steps[0].dec.target(batch)
            outputs = list(zip(batch.split(hidden), batch.split(feats) if feats is not None else [None] * len(steps)))
            for s, greedy, (h, f) in zip(steps, drawn, outputs):
                if greedy:
                    s.commit_greedy(h, f)
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
        if not plain_greedy(order.sampler):
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


def _pausable(order: StepOrder, waiting: bool) -> None:
    """Whether the order's sequence may be preempted: while the order waits unrun."""
    if order.sequence is not None:
        order.sequence.pausable = waiting and not order.withdrawn
