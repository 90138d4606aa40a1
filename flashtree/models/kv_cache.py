"""Paged KV storage: a pool of fixed-size pages that live sequences share, and one sequence's
cache as a page table over it.

Why pages: a sequence that reserved --max-ctx rows of its own kept them whether it used them or
not, and a request sharing a long prefix with another sequence had to copy those rows. Here a
sequence holds only the pages its rows need, and sequences with a common prefix hold the same
pages (`KVCache.share_pages`): no copy but the last, partly filled page.

The rule that keeps shared pages safe: a sequence writes only rows at or past its committed
length, and no other holder of a page it writes claims a row there at or past that length.
`ensure` gives a forward's rows their pages first; going back (`truncate`) or taking a prefix
(`share_pages`) releases the pages past the new length and copies the page that holds it if
another holder holds it too. A device snapshot (`HeldPages`) holds a live sequence's pages as
they are, its last partly written one included: it claims only rows below the length the
sequence had, which the sequence does not write again without first copying the page.

Logical row r of a sequence is physical row pages[r // PAGE_ROWS] * PAGE_ROWS + r % PAGE_ROWS
of the pool (kernels/kv_storage.py: Paged); the kernels read and write through the table, a
device tensor updated in place, so captured CUDA graphs follow it. Row index == position, as
before: how many rows are committed is the sequence state's (runtime/sequence.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Union

import torch

from ..errors import ConfigError, KVPagesExhausted
from ..kernels.kv_storage import (KV_CODES, PAGE_ROWS, QBLOCK, KVSide, Paged, QuantRows, has_scale, physical_rows,
                                  scale_dtype)
from .kv_views import HeldPages, LiveRows


def kv_kind(kv_type: Optional[str], dtype: torch.dtype) -> Optional[str]:
    """The stored format of a --kv-type for a model computing in `dtype`: None where rows are
    kept as they are computed (`auto`, or bf16 for a bf16 model), else a kernels.kv_storage kind."""
    if kv_type in (None, "auto") or (kv_type == "bf16" and dtype == torch.bfloat16):
        return None
    if kv_type not in KV_CODES:
        raise ConfigError(f"unknown KV cache type {kv_type!r}; known: auto, {', '.join(KV_CODES)}")
    return kv_type


def pages_for(rows: int) -> int:
    """Pages that hold `rows` rows."""
    return -(-rows // PAGE_ROWS)


class PagePool:
    """Every layer's K and V rows for `pages` pages (stored as the kinds say: plain rows, or codes
    with block scales, all [layers, pages * PAGE_ROWS, heads, ...] so a row's codes and scales
    share its index), which pages are free, and how many caches hold each.

    Page 0 of a pool that sequences share (`sink`) is never handed out: a page table's unused
    entries point at it, so a write past a sequence's pages (a warm-up's scratch) lands there and
    not in another sequence's rows.

    `reclaim(n)`, set by the engine, is asked to make n pages free when fewer are (it takes idle
    sequences' pages); when it cannot, taking them is an out-of-memory of the request that
    asked (KVPagesExhausted)."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, k_type: Optional[str] = None, v_type: Optional[str] = None,
                 sink: bool = True):
        self.dtype = dtype
        self.head_dim = head_dim
        self.kinds = {"k": kv_kind(k_type, dtype), "v": kv_kind(v_type or k_type, dtype)}
        self.shared = sink  # sequences share it (a cache alone in its pool keeps its pages)
        self.pages = pages_for(rows) + sink
        self.tensors: dict[str, torch.Tensor] = {}
        shape = (num_layers, self.pages * PAGE_ROWS, kv_heads)
        for side, kind in self.kinds.items():
            if kind is None:
                self.tensors[side] = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
                continue
            code_dtype, per_code = KV_CODES[kind]
            if has_scale(kind) and head_dim % QBLOCK:
                raise ConfigError(f"KV cache type {kind} needs a head_dim divisible by {QBLOCK}, "
                                  f"this model's is {head_dim}")
            self.tensors[side] = torch.zeros(*shape, head_dim // per_code, dtype=code_dtype, device=device)
            if has_scale(kind):
                self.tensors[f"{side}_scale"] = torch.zeros(*shape, head_dim // QBLOCK, dtype=scale_dtype(kind, dtype),
                                                            device=device)
        self.refs = [int(sink)] + [0] * (self.pages - 1)  # the sink is held for good
        self.free = list(range(self.pages - 1, int(sink) - 1, -1))  # pop() hands out the lowest first
        self.reclaim: Callable[[int], None] = lambda n: None

    @property
    def device(self) -> torch.device:
        return self.tensors["k"].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def free_pages(self) -> int:
        return len(self.free)

    @property
    def usable_pages(self) -> int:
        """The pages a sequence may hold: all but the sink."""
        return self.pages - self.shared

    def counts(self) -> dict[str, int]:
        """The pages a sequence may hold, those free, and those more than one cache holds (what
        /metrics reports)."""
        return {"total": self.usable_pages, "free": len(self.free),
                "shared": sum(r > 1 for r in self.refs[self.shared:])}

    def take(self, n: int) -> list[int]:
        """n free pages, now held once; all of them or none."""
        if len(self.free) < n:
            self.reclaim(n)
        if len(self.free) < n:
            raise KVPagesExhausted(f"{n} KV page(s) of {PAGE_ROWS} rows needed, {len(self.free)} free of "
                                   f"{self.pages - 1}; raise --kv-pool-tokens or lower --max-sequences")
        taken = [self.free.pop() for _ in range(n)]
        for p in taken:
            self.refs[p] = 1
        return taken

    def hold(self, page: int) -> None:
        self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def copy_page(self, src: int, dst: int, rows: int = PAGE_ROWS) -> None:
        """Copy the first `rows` rows of page src to page dst, in every tensor."""
        a, b = src * PAGE_ROWS, dst * PAGE_ROWS
        for t in self.tensors.values():
            t[:, b:b + rows].copy_(t[:, a:a + rows])

    def move_rows(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        """Pool rows `src` to pool rows `dest` in every tensor, all gathered before any is written
        (device ops only)."""
        for t in self.tensors.values():
            t.index_copy_(1, dest, t.index_select(1, src))

    def same_layout(self, other: "PagePool") -> bool:
        return all(other.tensors.get(n) is not None and other.tensors[n].shape[2:] == t.shape[2:]
                   and other.tensors[n].dtype == t.dtype for n, t in self.tensors.items())


PoolArg = Union[PagePool, int, None]


class KVCache:
    """One sequence's keys and values of every layer: a page table over a PagePool (`pool`: a
    shared pool, or a new one of that many rows; None: a pool of `capacity` rows for this cache
    alone, whose pages it holds from the start, in order, so that its logical rows are the
    pool's rows, as draft training reads them). `capacity` is the logical rows the table can
    map (its table has the pages that hold them)."""

    def __init__(self, num_layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, k_type: Optional[str] = None,
                 v_type: Optional[str] = None, pool: PoolArg = None):
        alone = pool is None
        if isinstance(pool, PagePool):
            want = PagePool(num_layers, 0, kv_heads, head_dim, dtype, "meta", k_type, v_type)
            if not want.same_layout(pool):
                raise ConfigError("a KV cache shares a pool of another layout")
        else:
            pool = PagePool(num_layers, pool or capacity, kv_heads, head_dim, dtype, device, k_type, v_type,
                            sink=not alone)
        self.pool = pool
        self.capacity = capacity
        self.table = torch.zeros(pages_for(capacity), dtype=torch.int32, device=pool.device)
        self.held: list[int] = []  # the pages of logical pages 0, 1, ...: the table's first entries
        if alone:
            self.ensure(capacity)

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def head_dim(self) -> int:
        return self.pool.head_dim

    @property
    def kinds(self) -> dict[str, Optional[str]]:
        return self.pool.kinds

    @property
    def k(self) -> torch.Tensor:
        return self.pool.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.pool.tensors["v"]

    def layer(self, i: int, table: Optional[torch.Tensor] = None) -> tuple[KVSide, KVSide]:
        """Layer i's keys and values as the kernels take them: the pool's rows (plain, or
        QuantRows) through this sequence's page table, or through `table` (several sequences'
        tables over this pool, ForwardInput.attention_at_once)."""
        def side(name: str) -> KVSide:
            kind = self.kinds[name]
            rows = self.pool.tensors[name][i]
            if kind is not None:
                scale = self.pool.tensors.get(f"{name}_scale")
                rows = QuantRows(kind, rows, scale[i] if scale is not None else None)
            return Paged(rows, self.table if table is None else table)

        return side("k"), side("v")

    def bytes_per_token(self) -> int:
        return self.pool.nbytes // (self.pool.pages * PAGE_ROWS)

    def layout(self) -> tuple:
        """What rows of another cache must match to be loaded here: dtype, per-row shape and
        layers as before quantized types existed (older disk files stay valid), and the types
        where either side is quantized."""
        plain = (str(self.k.dtype), tuple(self.k.shape[2:]), self.k.shape[0])
        if self.kinds == {"k": None, "v": None}:
            return plain
        return plain + (tuple((n, str(t.dtype), tuple(t.shape[2:])) for n, t in self.pool.tensors.items()),
                        self.kinds["k"], self.kinds["v"])

    # ---- pages ---------------------------------------------------------------------------
    def ensure(self, rows: int) -> None:
        """Give logical rows [0, rows) pages (a forward writes its rows only after this)."""
        if rows > self.capacity:
            raise RuntimeError(f"KV cache overflow: {rows} rows > capacity {self.capacity}")
        need = pages_for(rows) - len(self.held)
        if need <= 0:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("KV pages are reserved before a CUDA graph is captured, not during it")
        new = self.pool.take(need)
        self._write_table(len(self.held), new)
        self.held.extend(new)

    def _write_table(self, start: int, pages: list[int]) -> None:
        """Table entries [start, start + len(pages)) := pages, queued on the stream (from pinned
        memory on CUDA): a pageable copy would wait for the steps already queued."""
        if pages:
            src = torch.tensor(pages, dtype=torch.int32, pin_memory=self.table.is_cuda)
            self.table[start:start + len(pages)].copy_(src, non_blocking=True)

    def cut(self, length: int) -> None:
        """Rows from `length` on are forgotten: release the pages past it (to a pool that others
        share), and make the page that holds it this cache's alone (the next forward writes
        there)."""
        keep = pages_for(length)
        if keep > len(self.held):
            raise ValueError(f"rows [0, {length}) have no pages to keep")
        if keep < len(self.held) and self.pool.shared:
            self.pool.release(self.held[keep:])
            self.table[keep:len(self.held)] = 0
            del self.held[keep:]
        if length % PAGE_ROWS and self.pool.refs[self.held[-1]] > 1:
            self._own_page(keep - 1, length % PAGE_ROWS)

    def _own_page(self, i: int, rows: int) -> None:
        """Hold a new page in place of logical page i's, which another cache holds too, with its
        first `rows` rows copied (0: the caller writes them)."""
        page = self.pool.take(1)[0]
        if rows:
            self.pool.copy_page(self.held[i], page, rows)
        self.pool.release([self.held[i]])
        self.held[i] = page
        self._write_table(i, [page])

    def share_pages(self, pages: list[int], length: int) -> None:
        """Hold rows [0, length) of `pages` (another holder's, in order; pages past those rows
        are left to it) in place of this cache's own: whole pages by reference, the page
        `length` ends in copied (this cache writes past `length`). The pages are held before the
        copy's page is taken, so a reclaim that the taking starts cannot free them, and a pool
        with no page left raises with this cache as it was."""
        if len(pages) < pages_for(length):
            raise ValueError(f"{len(pages)} pages do not hold rows [0, {length})")
        pages = list(pages[:pages_for(length)])
        for p in pages:
            self.pool.hold(p)
        partial = length % PAGE_ROWS
        try:
            fresh = self.pool.take(1) if partial else []
        except BaseException:
            self.pool.release(pages)
            raise
        self.cut(0)
        if partial:
            self.pool.copy_page(pages[-1], fresh[0], partial)
            self.pool.release(pages[-1:])
            pages[-1] = fresh[0]
        self.held = pages
        self._write_table(0, pages)

    def hold_prefix(self, length: int) -> "HeldPages":
        """Rows [0, length) kept by reference to their pages (a device snapshot): no copy."""
        return HeldPages(self.pool, self.held[:pages_for(length)], length)

    def shared_pages(self) -> int:
        """Pages this cache holds that another cache holds too."""
        return sum(self.pool.refs[p] > 1 for p in self.held)

    # ---- rows ----------------------------------------------------------------------------
    def _physical(self, logical: torch.Tensor) -> torch.Tensor:
        return physical_rows(logical.to(self.table.device, torch.long), self.table)

    def compact(self, length: int, keep: torch.Tensor) -> None:
        """Move the scratch rows at offsets `keep` (relative to `length`, increasing) to rows
        [length, length + len(keep)), dropping the rest of the scratch."""
        self._move_rows(keep + length, torch.arange(length, length + keep.numel(), device=keep.device))

    def keep_path(self, length: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> None:
        """`compact` at a length the host does not know: move the scratch rows at offsets `path`
        ([P] long, a tree's accepted path padded with its last node) to rows [length, length + P).
        `length` [1] is the committed length on the device; `count`, the path's real length, is
        not needed here: rows past it are copies of the last node's, past the length the step
        commits, and the next forward overwrites them (only committed rows are ever read)."""
        keep_paths([self], [length], [path])

    def fold_path(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """At a device commit, what keep_path leaves besides the rows: nothing (attention only)."""

    def _move_rows(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        """Logical rows `src` to logical rows `dest`, in every tensor (device ops only)."""
        self.pool.move_rows(self._physical(src), self._physical(dest))

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Nothing to keep: a forward only writes rows past the committed length (scratch)."""
        yield

    def rows(self, n: int) -> dict[str, "LiveRows"]:
        """Logical rows [0, n) of every layer, by tensor name (for snapshots): `k`, `v`, and the
        quantized sides' `k_scale`/`v_scale`, read a layer at a time (LiveRows)."""
        index = self._physical(torch.arange(n, device=self.table.device))
        return {name: LiveRows(t, index) for name, t in self.pool.tensors.items()}

    def load_rows(self, rows: dict[str, torch.Tensor]) -> None:
        """Overwrite rows [0, n) of every tensor with `rows` (as `rows()` names them, [layers, n,
        ...]) from any device. A page another cache holds too is replaced by a new one, not
        written. Page by page, so a copy that fails part-way (an out-of-memory) leaves each
        page with its old rows or the new ones, which hold the same tokens (the caller kept
        only the prefix the two share).

        Copied layer by layer and page by page: each is a contiguous run in both, so a copy from
        pinned host memory is one direct DMA (a strided source would first be gathered through
        pageable memory) and no device-side staging buffer is needed."""
        n = rows["k"].shape[1]
        self.ensure(n)
        for i, first in enumerate(range(0, n, PAGE_ROWS)):
            if self.pool.refs[self.held[i]] > 1:
                self._own_page(i, 0)
            count, at = min(PAGE_ROWS, n - first), self.held[i] * PAGE_ROWS
            for name, live in self.pool.tensors.items():
                for layer in range(live.shape[0]):
                    live[layer, at:at + count].copy_(rows[name][layer, first:first + count], non_blocking=True)

    def keep_rows(self, length: int, keep: Optional[torch.Tensor]) -> None:
        """After a forward: keep the scratch rows at offsets `keep` (a tree's accepted path), or
        all of them in order (None: a prefill chunk)."""
        if keep is not None:
            self.compact(length, keep)

    def states(self) -> dict[str, torch.Tensor]:
        """Per-sequence state that is not rows (none: attention only)."""
        return {}

    def adopt(self) -> None:
        """At a commit (the draft's cache): nothing, the rows are written and the length moves."""


def keep_paths(caches: list[KVCache], lengths: list[torch.Tensor], paths: list[torch.Tensor]) -> None:
    """KVCache.keep_path for several caches at once (a shared verify phase's sequences, each
    path [P] and length [1] on the device): where the caches share a pool and a table size, one
    gather and one scatter a pool tensor for all of them, through their tables stacked, instead
    of a run of small launches per sequence. Exactly each one's own move: all rows are gathered
    before any is written, a sequence's rows are read and written only in its own pages past its
    length, and no two sequences write the same page there (the rule of shared pages, above)."""
    first = caches[0]
    if any(c.pool is not first.pool or c.table.shape != first.table.shape for c in caches[1:]):
        for cache, length, path in zip(caches, lengths, paths):
            keep_paths([cache], [length], [path])
        return
    device = first.table.device

    def rows(parts: list[torch.Tensor]) -> torch.Tensor:  # [S, ...]: one's a view, several's a stack
        return parts[0][None] if len(parts) == 1 else torch.stack(parts)

    tables = rows([c.table for c in caches])
    starts = rows(lengths).to(device, torch.long)  # [S, 1]
    src = rows(paths).to(device, torch.long) + starts
    dest = torch.arange(paths[0].shape[0], device=device) + starts
    first.pool.move_rows(physical_rows(src, tables).flatten(), physical_rows(dest, tables).flatten())
