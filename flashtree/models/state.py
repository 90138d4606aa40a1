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

from ..kernels.gated_delta import DeltaRows, gated_delta_fold


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

    A forward never touches the committed states. A prefill chunk leaves its final states in
    `pending_*`; a tree leaves each node's delta-rule inputs and conv window in `node_*`.
    `keep_rows` then adopts them once the step is certain: the pending states, or the accepted
    path's fold (the same steps the forward took along that path, so exactly its states)."""

    def __init__(self, attn_layers: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, linear_layers: int, value_heads: int, key_dim: int,
                 value_dim: int, conv_channels: int, conv_window: int, max_nodes: int):
        self.kv = KVCache(attn_layers, capacity, kv_heads, head_dim, dtype, device)
        self.capacity = capacity
        f32 = dict(dtype=torch.float32, device=device)
        self.ssm = torch.zeros(linear_layers, value_heads, key_dim, value_dim, **f32)
        self.conv = torch.zeros(linear_layers, conv_window, conv_channels, dtype=dtype, device=device)
        self.pending_ssm, self.pending_conv = torch.zeros_like(self.ssm), torch.zeros_like(self.conv)
        self.node_conv = torch.zeros(max_nodes, *self.conv.shape, dtype=dtype, device=device)
        self.node_k = torch.zeros(max_nodes, linear_layers, value_heads, key_dim, **f32)
        self.node_v = torch.zeros(max_nodes, linear_layers, value_heads, value_dim, **f32)
        self.node_g = torch.zeros(max_nodes, linear_layers, value_heads, **f32)
        self.node_beta = torch.zeros(max_nodes, linear_layers, value_heads, **f32)

    @property
    def k(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v(self) -> torch.Tensor:
        return self.kv.v

    def bytes_per_token(self) -> int:
        return self.kv.bytes_per_token()

    def delta_rows(self, layer: int, rows: int, tree: bool) -> DeltaRows:
        """Where DeltaNet layer `layer` writes a step's delta-rule inputs and conv windows: a
        tree's go straight to the node buffers (no copy after the forward); a sequence's inputs
        are scratch for its scan, and its last window goes to `pending_conv`."""
        if tree:
            return DeltaRows(self.node_k[:rows, layer], self.node_v[:rows, layer], self.node_g[:rows, layer],
                             self.node_beta[:rows, layer], self.node_conv[:rows, layer])
        _, heads, key_dim, value_dim = self.ssm.shape
        f32 = dict(dtype=torch.float32, device=self.ssm.device)
        return DeltaRows(torch.empty(rows, heads, key_dim, **f32), torch.empty(rows, heads, value_dim, **f32),
                         torch.empty(rows, heads, **f32), torch.empty(rows, heads, **f32), self.pending_conv[layer])

    def keep_rows(self, length: int, keep: Optional[torch.Tensor]) -> None:
        """Adopt a prefill chunk's final states (keep None), or keep the accepted path's KV rows
        and fold its delta-rule inputs into the live states."""
        if keep is None:
            self.ssm.copy_(self.pending_ssm)
            self.conv.copy_(self.pending_conv)
            return
        self.kv.compact(length, keep)
        path = keep.to(self.ssm.device)
        layers, heads = self.ssm.shape[:2]
        steps = len(keep)  # every layer's heads at once: they are independent
        live = self.ssm.view(layers * heads, *self.ssm.shape[2:])
        gated_delta_fold(live, self.node_k[path].view(steps, layers * heads, -1),
                         self.node_v[path].view(steps, layers * heads, -1),
                         self.node_g[path].view(steps, layers * heads),
                         self.node_beta[path].view(steps, layers * heads), out=live)
        self.conv.copy_(self.node_conv.index_select(0, path[-1:])[0])

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.rows(n)

    def load_rows(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv.load_rows(k, v)

    def states(self) -> dict[str, torch.Tensor]:
        """The recurrent states at the committed length, by name."""
        return {"ssm": self.ssm, "conv": self.conv}
