"""The per-layer state a model reads and writes: preallocated KV storage for one sequence, and
for hybrid models the recurrent states beside it.

Row index == position. How many rows are committed is not kept here: the sequence state
(runtime/sequence.py) owns that one length, for the target's cache and the draft's together, and
passes it to every forward as a device tensor. A forward writes its new rows right after the
committed ones; the caller then commits them, keeps a subset (`compact`), or leaves them as
scratch. Nothing is allocated after construction.
"""

from __future__ import annotations

from typing import Optional

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

    def keep_rows(self, length: int, keep: Optional[torch.Tensor]) -> None:
        """After a forward: keep the scratch rows at offsets `keep` (a tree's accepted path), or
        all of them in order (None: a prefill chunk)."""
        if keep is not None:
            self.compact(length, keep)

    def states(self) -> dict[str, torch.Tensor]:
        """Per-sequence state that is not rows (none: attention only)."""
        return {}


class HybridState:
    """A hybrid model's per-sequence state: KV rows for its full-attention layers, and per Gated
    DeltaNet layer the recurrent state [Hv, Dk, Dv] (float32, as the reference keeps it) and the
    convolution window [K-1, C] at the committed length.

    A forward never touches the committed states: it writes the new ones to the node scratch
    (`node_ssm`, `node_conv`: every tree node's, or a prefill's final one in slot 0), and
    `keep_rows` adopts the accepted node's (or slot 0's) once the step is certain."""

    def __init__(self, attn_layers: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, linear_layers: int, value_heads: int, key_dim: int,
                 value_dim: int, conv_channels: int, conv_window: int, max_nodes: int):
        self.kv = KVCache(attn_layers, capacity, kv_heads, head_dim, dtype, device)
        self.capacity = capacity
        self.ssm = torch.zeros(linear_layers, value_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.conv = torch.zeros(linear_layers, conv_window, conv_channels, dtype=dtype, device=device)
        self.node_ssm = torch.zeros(max_nodes, *self.ssm.shape, dtype=torch.float32, device=device)
        self.node_conv = torch.zeros(max_nodes, *self.conv.shape, dtype=dtype, device=device)

    @property
    def k(self) -> torch.Tensor:
        return self.kv.k

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + sum(t.numel() * t.element_size() for t in
                                    (self.ssm, self.conv, self.node_ssm, self.node_conv))

    def bytes_per_token(self) -> int:
        return self.kv.bytes_per_token()

    def keep_rows(self, length: int, keep: Optional[torch.Tensor]) -> None:
        """Keep the accepted path's KV rows and adopt its last node's states (slot 0's for a
        prefill chunk)."""
        if keep is not None:
            self.kv.compact(length, keep)
        node = keep[-1:] if keep is not None else torch.zeros(1, dtype=torch.long, device=self.ssm.device)
        self.ssm.copy_(self.node_ssm.index_select(0, node.to(self.ssm.device))[0])
        self.conv.copy_(self.node_conv.index_select(0, node.to(self.conv.device))[0])

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.rows(n)

    def load_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv.load_rows(k, v)

    def states(self) -> dict[str, torch.Tensor]:
        """The recurrent states at the committed length, by name."""
        return {"ssm": self.ssm, "conv": self.conv}
