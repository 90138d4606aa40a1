"""The per-layer state a model reads and writes: preallocated KV storage for one sequence.

Row index == position. How many rows are committed is not kept here: the sequence state
(runtime/sequence.py) owns that one length, for the target's cache and the draft's together, and
passes it to every forward as a device tensor. A forward writes its new rows right after the
committed ones; the caller then commits them, keeps a subset (`compact`), or leaves them as
scratch. Nothing is allocated after construction.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def bytes_per_token(self) -> int:
        return self.nbytes // self.capacity

    def compact(self, length: int, keep: torch.Tensor) -> None:
        """Move the scratch rows at offsets `keep` (relative to `length`, increasing) to rows
        [length, length + len(keep)), dropping the rest of the scratch."""
        n = keep.numel()
        rows = keep.to(self.k.device) + length
        self.k[:, length:length + n] = self.k[:, rows]
        self.v[:, length:length + n] = self.v[:, rows]

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first n rows of every layer (for snapshots)."""
        return self.k[:, :n], self.v[:, :n]

    def load_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite rows [0, n) with k/v [layers, n, heads, D] from any device.

        Copied layer by layer: each layer's rows are contiguous even when `k` is a prefix slice
        of a longer snapshot, so a copy from pinned host memory is one direct DMA (a strided
        source would first be gathered through pageable memory) and no device-side staging
        buffer is needed."""
        n = k.shape[1]
        if n > self.capacity:
            raise RuntimeError(f"snapshot of {n} rows does not fit capacity {self.capacity}")
        for layer in range(self.k.shape[0]):
            self.k[layer, :n].copy_(k[layer], non_blocking=True)
            self.v[layer, :n].copy_(v[layer], non_blocking=True)
