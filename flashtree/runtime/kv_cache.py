"""Preallocated KV storage for one sequence.

Rows [0, length) hold committed tokens, one row per position (row index == position). A forward
writes its new rows right after them, at [length, length + T), without committing: the caller
then either `advance`s (prefill, AR), or keeps a subset with `compact` (tree verify), or leaves the
rows as scratch to be overwritten (draft blocks). Nothing is allocated after construction.
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
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def bytes_per_token(self) -> int:
        return self.nbytes // self.capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [T, kv_heads, D] at rows [length, length+T) of `layer`; return the views of
        rows [0, length+T) to attend over."""
        end = self.length + k.shape[0]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.k[layer, self.length:end] = k
        self.v[layer, self.length:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def advance(self, n: int) -> None:
        """Commit the next n rows written after `length`."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length + n} rows > capacity {self.capacity}")
        self.length += n

    def truncate(self, n: int) -> None:
        """Forget every row from n on (cheap: rows are just overwritten later)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate to {n} outside [0, {self.length}]")
        self.length = n

    def compact(self, keep: torch.Tensor) -> None:
        """Commit the uncommitted rows at offsets `keep` (relative to `length`, increasing), moved to
        consecutive rows; the rest of the scratch is dropped."""
        n = keep.numel()
        rows = keep.to(self.k.device) + self.length
        self.k[:, self.length:self.length + n] = self.k[:, rows]
        self.v[:, self.length:self.length + n] = self.v[:, rows]
        self.length += n

    def export_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first n committed rows of every layer (for snapshots)."""
        return self.k[:, :n], self.v[:, :n]

    def import_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the committed state with the given rows [layers, n, heads, D], from any device.

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
        self.length = n
