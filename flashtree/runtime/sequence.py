"""SequenceState: how far the live sequence has got, in one place.

It owns the committed token ids, the target's and the draft's KV caches, and the committed
length as a device tensor (what the kernels and the captured CUDA graphs read). Both caches
always hold rows [0, length) for the same tokens (an MTP draft's row length - 1 pairs the last
token with the next, so it is rewritten before it is read: models/mtp.py): every change is one transaction that moves
the length only after each cache has its rows (`commit`), so an exception mid-step (an
out-of-memory in sampling, a cancelled client) leaves the state as it was before the step, with
nothing to reconcile. Rows at and after `length` are scratch that forwards write and commits keep.

A decode step may also commit on the device alone: it moves `length_dev` by its accepted count
without the host knowing the count, so that the next step can be queued before the host reads
this one's result. Until the host reads it (`settle`), the host's token list lags the device:
`length` is what the host has read, and `bound` an upper bound of the device's length (each
unread commit counts its most rows), which is what room checks use. Nothing that needs the
tokens themselves (truncate, snapshots, checkpoints, a host commit) runs while a commit is unread.

A hybrid target also has recurrent states (Gated DeltaNet), which hold the whole sequence and
cannot be truncated. So for it the state can only go back to lengths where a copy of the states
was kept: `checkpoint()` keeps one (the engine does at each prompt's end and every
--state-checkpoint-interval tokens of a prefill), `reusable()` finds the longest one at or below
a common prefix, and snapshots carry the checkpoints they contain.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Optional, Union

import torch

from ..models.kv_cache import KVCache
from ..models.kv_views import HeldPages, LiveRows
from ..models.state import HybridState

TargetState = Union[KVCache, HybridState]


PREFIX_RUN = 1024  # tokens common_prefix compares at once
CACHE_PREFIXES = ("t", "d")  # a snapshot's names of the target's and the draft's cache tensors (kv_caches' order)


def by_cache(per_cache: "list[Mapping[str, LiveRows]]") -> dict[str, "LiveRows"]:
    """Each cache's rows (kv_caches' order) under the names a snapshot gives them: `tk`, `tv`,
    ... for the target's, `dk`, ... for the draft's."""
    return {f"{prefix}{name}": t for prefix, rows in zip(CACHE_PREFIXES, per_cache) for name, t in rows.items()}


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """How many leading tokens a and b share. Runs of PREFIX_RUN tokens are compared as whole
    lists (in C), then the run that differs token by token: a request is held against every
    live sequence and snapshot, each up to --max-ctx tokens long, before its prefill starts."""
    n = min(len(a), len(b))
    i = 0
    while i + PREFIX_RUN <= n and list(a[i:i + PREFIX_RUN]) == list(b[i:i + PREFIX_RUN]):
        i += PREFIX_RUN
    while i < n and a[i] == b[i]:
        i += 1
    return i


def state_points(names: "list[str] | set[str]", length: int) -> Optional[tuple[int, ...]]:
    """The lengths at which a snapshot with these tensor names holds recurrent states (its own
    length, its checkpoints `name@n`, and 0), or None where every length is usable (no states)."""
    if not any("@" in n or n in ("ssm", "conv") for n in names):
        return None
    return tuple(sorted({0, length} | {int(n.split("@")[1]) for n in names if "@" in n}))


class SequenceState:
    def __init__(self, target: TargetState, draft: Optional[KVCache], device: torch.device,
                 max_checkpoints: int = 8):
        self.target = target
        self.draft = draft
        self.capacity = target.capacity  # rows the page tables map (the pages are a shared pool's)
        self.tokens: list[int] = []
        self.length_dev = torch.zeros(1, dtype=torch.int32, device=device)
        self.unread: list[int] = []  # per device commit the host has not read: its most rows
        self.recurrent = bool(target.states())  # (a draft's states come with a hybrid target only)
        self.max_checkpoints = max_checkpoints
        self.checkpoints: dict[int, dict[str, torch.Tensor]] = {}  # length -> states there

    def states(self) -> dict[str, torch.Tensor]:
        """What the sequence holds at its length besides rows: the target's recurrent states and
        a draft's carried values (an MTP draft's last target hidden), kept by checkpoints and
        snapshots alike."""
        if self.draft is None:
            return self.target.states()
        return {**self.target.states(), **self.draft.states()}

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def bound(self) -> int:
        """The most rows the device's length can hold: the host's, plus each unread commit's
        most rows."""
        return len(self.tokens) + sum(self.unread)

    def kv_caches(self) -> list[KVCache]:
        """The caches whose pages the sequence holds (models/kv_cache.py): the target's KV (a
        hybrid's attention layers') and the draft's."""
        target = self.target.kv if isinstance(self.target, HybridState) else self.target
        return [target] + ([self.draft] if self.draft is not None else [])

    def reserve(self, rows: int) -> bool:
        """Give the `rows` rows past the device's length pages in every cache, before a forward
        writes them (a captured one included: it writes where the page table says); False
        where they would run past the capacity. Against `bound`: the rows start at the device's
        length, which the host may not have read yet. An exhausted page pool is an
        EngineOutOfMemory of this request."""
        end = self.bound + rows
        if end > self.capacity:
            return False
        for cache in self.kv_caches():
            cache.ensure(end)
        return True

    def check_room(self, rows: int) -> None:
        """`reserve`, refusing a forward whose scratch rows would run past the caches (the
        kernels write where they are told)."""
        if not self.reserve(rows):
            raise RuntimeError(f"KV cache overflow: {self.bound + rows} rows > capacity {self.capacity}")

    def settled(self, what: str) -> None:
        """Refuse `what` while a device commit is unread (the host's tokens lag the device's)."""
        if self.unread:
            raise RuntimeError(f"{what} with {len(self.unread)} device commit(s) not yet read")

    def commit(self, tokens: list[int]) -> None:
        """Rows [length, length + len(tokens)) of every cache now hold `tokens`."""
        self.settled("commit")
        self.check_room(len(tokens))
        if self.draft is not None:
            self.draft.adopt()
        self.tokens.extend(tokens)
        self.length_dev.fill_(len(self.tokens))

    def commit_on_device(self, count: torch.Tensor) -> None:
        """A step's caches hold its rows: move the device's length by `count` ([1], on the
        device, unread). Device work only, so that a captured phase can hold it; the launch
        that ran it then calls `launched`."""
        if self.draft is not None:
            self.draft.adopt()
        self.length_dev.add_(count)

    def launched(self, most: int) -> None:
        """A device commit of at most `most` rows has been queued (after commit_on_device ran
        or was replayed): the host's tokens follow at `settle`, in the order of the commits.
        (The launch checked the room before its forwards wrote a row.)"""
        self.unread.append(most)

    def settle(self, tokens: list[int]) -> None:
        """The host has read the oldest unread device commit: it committed `tokens`."""
        if not self.unread:
            raise RuntimeError("settle without an unread device commit")
        if len(tokens) > self.unread[0]:
            raise RuntimeError(f"a device commit of {len(tokens)} rows, at most {self.unread[0]} expected")
        self.unread.pop(0)
        self.tokens.extend(tokens)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Run a block that may commit (a captured step's warm-up runs), then put the committed
        length and the recurrent states back: only scratch rows stay written."""
        length = self.length_dev.clone()
        try:
            with self.target.preserved(), (self.draft.preserved() if self.draft is not None
                                           else contextlib.nullcontext()):
                yield
        finally:
            self.length_dev.copy_(length)

    def truncate(self, n: int) -> None:
        """Forget every row from n on (cheap: rows are just overwritten later). With recurrent
        states, n must be the length, 0, or a checkpoint, whose states come back."""
        self.settled("truncate")
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate to {n} outside [0, {self.length}]")
        if self.recurrent and n != self.length:
            if n not in self.points():
                raise ValueError(f"no recurrent state kept at {n} (kept: {self.points()})")
            for name, live in self.states().items():
                live.copy_(self.checkpoints[n][name]) if n else live.zero_()
        for p in [p for p in self.checkpoints if p > n]:
            del self.checkpoints[p]
        del self.tokens[n:]
        self.length_dev.fill_(n)
        for cache in self.kv_caches():
            cache.cut(n)

    def share_prefix(self, lender: "SequenceState", n: int) -> int:
        """Hold the lender's first n tokens (with recurrent states: down to the last length the
        lender kept them at) in place of this state's rows: its KV pages by reference (the page
        that n ends in copied: models/kv_cache.py), its states and checkpoints copied. Returns
        the length. The state is emptied first, so a failure part-way (no page or memory left)
        leaves it empty rather than with rows its tokens do not match.

        Everything is taken from the lender before the first page is (its pages held: `hold`,
        `_share_lent`): the reclaim that an empty pool starts can give an idle lender's rows back."""
        self.settled("share_prefix")
        lender.settled("lending rows")
        if self.recurrent:
            n = max(p for p in lender.points() if p <= n)
        live = lender.states()
        states = {name: (t if n == lender.length else lender.checkpoints[n][name]).clone() if n else None
                  for name, t in live.items()}
        checkpoints = {p: {k: v.clone() for k, v in kept.items()} for p, kept in lender.checkpoints.items() if p < n}
        tokens = lender.tokens[:n]
        self.truncate(0)
        self._share_lent(lender.hold(n), n)
        for name, target in self.states().items():
            target.copy_(states[name]) if states[name] is not None else target.zero_()
        self.checkpoints = checkpoints
        self.tokens[:] = tokens
        self.length_dev.fill_(n)
        return n

    def points(self) -> list[int]:
        """Lengths this state can go back to: any, without recurrent states; else 0, the
        checkpoints and the length."""
        return sorted({0, self.length, *self.checkpoints})

    def reusable(self, prompt: list[int], limit: int) -> int:
        """How much of `prompt` (at most `limit` tokens) the live state can serve."""
        n = min(common_prefix(self.tokens, prompt), limit)
        if not self.recurrent:
            return n
        return max(p for p in self.points() if p <= n)

    def keep_prefix_of(self, prompt: list[int], limit: int) -> int:
        """Truncate to the longest reusable prefix of `prompt` (at most `limit`); its length."""
        self.truncate(self.reusable(prompt, limit))
        return self.length

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent states at the current length (nothing without them); the
        shortest go first beyond `max_checkpoints`."""
        self.settled("checkpoint")
        if not self.recurrent or self.length == 0 or self.length in self.checkpoints:
            return
        self.checkpoints[self.length] = {k: v.clone() for k, v in self.states().items()}
        while len(self.checkpoints) > self.max_checkpoints:
            del self.checkpoints[min(self.checkpoints)]

    # ---- snapshots ---------------------------------------------------------------------------
    def rows(self, n: int) -> dict[str, "torch.Tensor | LiveRows"]:
        """The first n committed rows of every cache, by name (for snapshots: LiveRows, read
        from the pages a layer at a time), and `state_views(n)`."""
        self.settled("a snapshot")
        return {**by_cache([cache.rows(n) for cache in self.kv_caches()]), **self.state_views(n)}

    def state_views(self, n: int) -> dict[str, torch.Tensor]:
        """With recurrent states (then n must be the length), views of those states and every
        checkpoint's (`name@length`); else nothing."""
        if not self.recurrent:
            return {}
        if n != self.length:
            raise ValueError(f"recurrent states exist at the length {self.length}, not at {n}")
        views = dict(self.states())
        for p, states in self.checkpoints.items():
            views.update({f"{name}@{p}": t for name, t in states.items()})
        return views

    def _share_lent(self, lent: list[HeldPages], n: int) -> None:
        """Each cache holds rows [0, n) of its `lent` pages (kv_caches' order), which are then
        released, also on a failure. The holds are the caller's, taken before any cache shares:
        a share may take a page, and the reclaim that an empty pool starts can give the pages'
        other holder (an idle lender, a snapshot) back before the next cache shares them."""
        try:
            for cache, pages in zip(self.kv_caches(), lent):
                cache.share_pages(pages.pages, n)
        finally:
            for pages in lent:
                pages.release()

    def hold(self, n: int) -> list[HeldPages]:
        """The first n committed rows of every cache (kv_caches' order) kept by reference to
        their pages (models/kv_views.py: HeldPages), for a device snapshot or a share."""
        self.settled("a snapshot")
        return [cache.hold_prefix(n) for cache in self.kv_caches()]

    def snapshot_mismatch(self, tensors: Mapping[str, torch.Tensor], length: int) -> Optional[str]:
        """Why `tensors` are not a snapshot of `length` tokens that `load` can take (None: they
        are). Exactly the tensors `rows(length)` gives: each cache's (the target's `t*`, the
        draft's `d*`, quantized sides with their scales) of this state's dtype and of shape
        [layers, length, ...]; with recurrent states, each state and, per checkpoint `@p`
        (0 < p <= length), every state again at its live shape. Nothing else: a name `load`
        does not read is not a state this engine wrote.

        A disk file's checksum only proves that its bytes are the ones its writer signed, and
        its fingerprint only that the writer claimed this layout. `load` trusts the shapes: a
        cache with too few rows is copied as far as it goes, leaving stale rows under the tokens
        it claims (a wrong answer), and a missing tensor or another head size fails every request
        sharing the prefix. So a file is checked against this before any of it reaches the live
        state."""
        states = self.states()
        expected = by_cache([cache.rows(0) for cache in self.kv_caches()])
        want = {name: (t.dtype, (t.shape[0], length, *t.shape[2:])) for name, t in expected.items()}
        want.update({name: (t.dtype, tuple(t.shape)) for name, t in states.items()})
        for name in tensors:  # the checkpoints the snapshot claims: all of their states are due
            base, at, point = name.partition("@")
            if at and base in states and point.isascii() and point.isdigit() and 0 < int(point) <= length:
                want.update({f"{s}@{int(point)}": (t.dtype, tuple(t.shape)) for s, t in states.items()})
        for name, (dtype, shape) in want.items():
            found = tensors.get(name)
            if found is None:
                return f"tensor {name} is missing (expected {dtype} {list(shape)})"
            if (found.dtype, tuple(found.shape)) != (dtype, shape):
                return f"tensor {name}: expected {dtype} {list(shape)}, found {found.dtype} {list(found.shape)}"
        if extra := sorted(set(tensors) - set(want)):
            return f"unexpected tensors {', '.join(extra)}"
        return None

    def load(self, tokens: list[int], tensors: dict[str, torch.Tensor],
             held: Optional[list[HeldPages]] = None) -> int:
        """Make the state hold a prefix of `tokens` from a snapshot of them: all of them, or with
        recurrent states the longest the snapshot kept states for. Returns its length. The rows
        come from `tensors` (copied), or from `held` pages (shared: models/kv_cache.py), with
        the states and checkpoints in `tensors`.

        Before any row is overwritten the state keeps only its reusable prefix of the tokens:
        those rows hold the same tokens at the same positions as the snapshot's, so a copy that
        fails half-way (an out-of-memory) leaves a consistent, shorter state. Shared pages
        replace a cache's whole table, so a failure there empties the state."""
        self.settled("load")
        n = len(tokens)
        total = held[0].length if held is not None else tensors["tk"].shape[1]
        points = state_points(set(tensors), total)
        if points is not None:
            n = max(p for p in points if p <= n)
        if n > self.capacity:
            raise RuntimeError(f"snapshot of {n} rows does not fit capacity {self.capacity}")
        self.keep_prefix_of(tokens, n)
        if held is not None:
            try:  # holds of the load's own: the reclaim can move this very snapshot down a tier
                self._share_lent([HeldPages(pages.pool, pages.pages, pages.length) for pages in held], n)
            except BaseException:
                self.truncate(0)
                raise
        else:
            for prefix, cache in zip(CACHE_PREFIXES, self.kv_caches()):
                cache.load_rows({name: tensors[f"{prefix}{name}"][:, :n] for name in cache.pool.tensors})
        if points is not None:
            for name, live in self.states().items():
                saved = tensors[name] if n == total else tensors.get(f"{name}@{n}")
                live.copy_(saved) if saved is not None else live.zero_()
            self.checkpoints = {p: {name: tensors[f"{name}@{p}"].to(live.device).clone()
                                    for name, live in self.states().items()}
                                for p in points if 0 < p < n}
        self.tokens[:] = tokens[:n]
        self.length_dev.fill_(n)
        return n

    def layout(self) -> tuple:
        """What a snapshot's rows must match to be loaded here (dtypes, KV types and per-row
        shapes): part of the disk tier's fingerprint, so a file of another KV type is skipped."""
        draft, d = None, self.draft
        if d is not None:  # a plain draft cache in the form from before --draft-kv-type: older disk files stay valid
            draft = d.layout() if any(d.kinds.values()) else (*d.k.shape[2:], d.k.shape[0])
        states = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in self.states().items())
        return (*self.target.layout(), draft, states)

    def bytes_per_token(self) -> int:
        return self.target.bytes_per_token() + (self.draft.bytes_per_token() if self.draft is not None else 0)
