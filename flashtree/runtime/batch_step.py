"""One decode step for several live sequences at once: one target forward verifies every tree.

A batch-1 verify reads every weight to use it for a tree's 23 rows; the trees of several
sequences in one forward read them once for all (ForwardInput.batch), while each sequence's
attention and recurrent scan still run over its own caches. Each sequence drafts and builds its
tree as it would alone (its draft forward over its own draft cache), so the trees, the draws,
the walks and the commits are the ones its step alone would give: a sequence's greedy output is
the same whoever shares its steps.

This is the host path (trees built and walked on the host), which the engine takes where a step
is eager anyway (no CUDA graphs). An error while building one sequence's tree fails that
sequence's step only. An error in the shared verify (an out-of-memory, mostly) is not charged to
the batch: each sequence then verifies alone, so the failure lands on the step that causes it
and the others go on; nothing was committed before, since the verify only writes scratch rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from . import faults
from .decoding import Decoder, PlannedTree, StepResult
from .sampling import Sampler
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
    result: Optional[StepResult] = None
    error: Optional[BaseException] = None
    shared: int = 0

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


def run_orders(orders: list[StepOrder]) -> None:
    """Run one step for each order (their decoders over distinct sequences of one target)."""
    planned: list[tuple[StepOrder, PlannedTree]] = []
    for order in orders:
        dec = order.decoder
        try:
            dec.state.settled("a shared step")
            planned.append((order, dec.plan_tree(order.bonus, min(dec.block_size - 1, order.max_emit - 1))))
        except Exception as e:  # noqa: BLE001 (this sequence's step fails; the others go on)
            order.error = e
    if len(planned) == 1:
        _alone(*planned[0])
    elif planned:
        _together(planned)


def _alone(order: StepOrder, plan: PlannedTree) -> None:
    try:
        order.result = order.decoder.verify_tree(plan, order.sampler, order.want_trace)
        order.shared = 1
    except Exception as e:  # noqa: BLE001
        order.error = e


def _together(planned: list[tuple[StepOrder, PlannedTree]]) -> None:
    target = planned[0][0].decoder.target
    starts = [order.decoder.state.length for order, _ in planned]
    try:
        with faults.site("verify"):
            rows = [order.decoder.tree_rows(plan.tree) for order, plan in planned]
            parts = []
            for (order, _), r in zip(planned, rows):
                order.decoder.state.check_room(r.ids.shape[0])
                parts.append(order.decoder.runner.target_input(r.ids, r.positions, r.mask, r.index))
            hidden, feats = target(ForwardInput.batch(parts, planned[0][0].decoder.runner.feature_layers))
    except Exception:  # noqa: BLE001 (each verifies alone: the error lands on the step that has it)
        for order, plan in planned:
            _alone(order, plan)
        return
    sizes = [r.ids.shape[0] for r in rows]
    hiddens = hidden.split(sizes)
    features = feats.split(sizes) if feats is not None else [None] * len(sizes)
    for (order, plan), r, h, f, start in zip(planned, rows, hiddens, features, starts):
        try:
            order.result = order.decoder.accept(plan, order.sampler, r, h, f, start, order.want_trace)
            order.shared = len(planned)
        except Exception as e:  # noqa: BLE001
            order.error = e


class SharedSteps:
    """The steps the running generations queue to run together. A generation is a generator
    that the engine's caller advances one boundary at a time, each in turn: `take` queues its
    order and yields once (an empty step), in which the others queue theirs; the first of them
    to come back runs every queued order (run_orders) and each then takes its own result."""

    def __init__(self) -> None:
        self.orders: list[StepOrder] = []

    def take(self, order: StepOrder) -> Iterator[list[int]]:
        """Queue `order`, yield [] once, and return its step's result (or raise its error)."""
        self.orders.append(order)
        try:
            yield []
            if not order.done:
                orders, self.orders = self.orders, []
                run_orders(orders)
        finally:  # a generation closed while it waited leaves no order for a sequence it gave back
            if order in self.orders:
                self.orders.remove(order)
        if order.error is not None:
            raise order.error
        assert order.result is not None
        return order.result
