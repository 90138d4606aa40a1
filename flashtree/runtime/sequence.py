"""SequenceState: how far the live sequence has got, in one place.

It owns the committed token ids, the target's and the draft's KV caches, and the committed
length as a device tensor (what the kernels and the captured CUDA graphs read). Both caches
always hold rows [0, length) for the same tokens: every change is one transaction that moves
the length only after each cache has its rows (`commit`), so an exception mid-step (an
out-of-memory in sampling, a cancelled client) leaves the state as it was before the step, with
nothing to reconcile. Rows at and after `length` are scratch that forwards write and commits keep.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..models.state import KVCache


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SequenceState:
    def __init__(self, target: KVCache, draft: Optional[KVCache], device: torch.device):
        self.target = target
        self.draft = draft
        self.capacity = target.capacity
        self.tokens: list[int] = []
        self.length_dev = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def check_room(self, rows: int) -> None:
        """Refuse a forward whose scratch rows would run past the caches (the kernels write
        where they are told)."""
        if self.length + rows > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length + rows} rows > capacity {self.capacity}")

    def commit(self, tokens: list[int]) -> None:
        """Rows [length, length + len(tokens)) of every cache now hold `tokens`."""
        self.check_room(len(tokens))
        self.tokens.extend(tokens)
        self.length_dev.fill_(len(self.tokens))

    def truncate(self, n: int) -> None:
        """Forget every row from n on (cheap: rows are just overwritten later)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate to {n} outside [0, {self.length}]")
        del self.tokens[n:]
        self.length_dev.fill_(n)

    def keep_prefix_of(self, prompt: list[int], limit: int) -> int:
        """Truncate to the longest common prefix with `prompt` (at most `limit`); its length."""
        self.truncate(min(common_prefix(self.tokens, prompt), limit))
        return self.length

    # ---- snapshots ---------------------------------------------------------------------------
    def rows(self, n: int) -> dict[str, torch.Tensor]:
        """Views of the first n committed rows of every cache, by name (for snapshots)."""
        views = dict(zip(("tk", "tv"), self.target.rows(n)))
        if self.draft is not None:
            views.update(zip(("dk", "dv"), self.draft.rows(n)))
        return views

    def load(self, tokens: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Make the state hold `tokens` from a snapshot's rows (the first len(tokens) of them).

        Before any row is overwritten the state keeps only its common prefix with `tokens`:
        those rows hold the same tokens at the same positions as the snapshot's, so a copy that
        fails half-way (an out-of-memory) leaves a consistent, shorter state."""
        n = len(tokens)
        if n > self.capacity:
            raise RuntimeError(f"snapshot of {n} rows does not fit capacity {self.capacity}")
        self.keep_prefix_of(tokens, n)
        self.target.load_rows(tensors["tk"][:, :n], tensors["tv"][:, :n])
        if self.draft is not None:
            self.draft.load_rows(tensors["dk"][:, :n], tensors["dv"][:, :n])
        self.tokens[:] = tokens
        self.length_dev.fill_(n)

    def layout(self) -> tuple:
        """What a snapshot's rows must match to be loaded here (dtype and per-row shapes)."""
        draft = tuple(self.draft.k.shape[2:]) + (self.draft.k.shape[0],) if self.draft is not None else None
        return (str(self.target.k.dtype), tuple(self.target.k.shape[2:]), self.target.k.shape[0], draft)

    def bytes_per_token(self) -> int:
        return self.target.bytes_per_token() + (self.draft.bytes_per_token() if self.draft is not None else 0)
