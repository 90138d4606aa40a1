"""A decode step's order from one generation to the steps several sequences share
(batch_step.py), the rule for a shared verify that fails, and the shared step's host path.

`verify_shared` is the one place both paths take their failure rule from: a shared verify that
raises is not charged to the batch, each step then verifies alone. The host path (the CPU,
--no-cuda-graphs) plans each sequence's tree on the host, verifies all of them in one eager
batched forward, and walks and commits each on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch

from . import faults
from .decoding import Decoder, PlannedTree, StepResult, TreeRows
from .device_step import Drafted
from .sampling import Sampler
from .sequences import LiveSequence
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
    ahead: Optional[Drafted] = None  # its draft, queued before the previous step was read
    next_ahead: Optional[Drafted] = None  # the next step's, queued by this one before its read

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
