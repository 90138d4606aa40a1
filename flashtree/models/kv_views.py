"""Views of a cache's logical rows that outlive a forward: `LiveRows`, rows read from the pool a
layer at a time (what a snapshot copies out), and `HeldPages`, rows kept by holding their pages
(a device snapshot, no copy). models/kv_cache.py says which rows a page holds and the rule that
keeps shared pages safe."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels.kv_storage import physical_rows

if TYPE_CHECKING:
    from .kv_cache import PagePool


class HeldPages:
    """Rows [0, length) of a cache kept by holding its pages: what a device snapshot keeps of
    a live sequence's KV, with no copy. The pages stay out of the free list until `release`.

    Safe beside the cache that wrote them: it writes only rows at or past its length, which
    is at least `length` until it goes back (`cut`), and going back into a page that another
    holds copies that page first. So the rows held here never change."""

    def __init__(self, pool: "PagePool", pages: list[int], length: int):
        if not pool.shared:
            raise ValueError("a cache alone in its pool has no pages to lend")
        self.pool = pool
        self.length = length
        self.pages = list(pages)
        for p in self.pages:
            self.pool.hold(p)

    def rows(self) -> dict[str, "LiveRows"]:
        """The held rows of every tensor, by name, as KVCache.rows gives a live cache's."""
        table = torch.tensor(self.pages, dtype=torch.int32, device=self.pool.device)
        index = physical_rows(torch.arange(self.length, device=self.pool.device), table)
        return {name: LiveRows(t, index) for name, t in self.pool.tensors.items()}

    def release(self) -> None:
        self.pool.release(self.pages)
        self.pages = []


class LiveRows:
    """A cache tensor's logical rows [0, n), read from the pool a layer at a time: what a
    snapshot copies out of a live cache without gathering every layer's rows on the device at
    once (a 62K-token 27B's rows are gigabytes). Indexing a layer gives that layer's rows, a
    new tensor; `clone()` gathers them all (the device tier's copy)."""

    def __init__(self, pool_tensor: torch.Tensor, index: torch.Tensor):
        self._t = pool_tensor
        self._index = index

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._t.shape[0], self._index.numel(), *self._t.shape[2:]))

    @property
    def dtype(self) -> torch.dtype:
        return self._t.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self._t.element_size()

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._t[layer].index_select(0, self._index)

    def clone(self) -> torch.Tensor:
        return self._t.index_select(1, self._index)
