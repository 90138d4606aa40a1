"""A hybrid model's per-sequence state: the KV cache of its full-attention layers
(models/kv_cache.py) and the recurrent states of its Gated DeltaNet layers beside it.

How many rows are committed is not kept here: the sequence state (runtime/sequence.py) owns that
one length and passes it to every forward as a device tensor. A forward writes its new rows
right after the committed ones and leaves its states as pending or per-node inputs; the caller
then keeps them (`keep_rows`, or `keep_path` at a length only the device knows) or leaves them as
scratch. The recurrent states are allocated at construction, and nothing after it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..kernels.gated_delta import ADDRESS_COLUMNS, DeltaRows, gated_delta_fold, layer_addresses
from .kv_cache import KVCache, PoolArg


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
                 value_dim: int, conv_channels: int, conv_window: int, max_nodes: int,
                 k_type: Optional[str] = None, v_type: Optional[str] = None, pool: PoolArg = None):
        self.kv = KVCache(attn_layers, capacity, kv_heads, head_dim, dtype, device, k_type, v_type, pool)
        self.dtype = dtype
        self.capacity = self.kv.capacity
        f32 = dict(dtype=torch.float32, device=device)
        self.ssm = torch.zeros(linear_layers, value_heads, key_dim, value_dim, **f32)
        self.conv = torch.zeros(linear_layers, conv_window, conv_channels, dtype=dtype, device=device)
        self.pending_ssm, self.pending_conv = torch.zeros_like(self.ssm), torch.zeros_like(self.conv)
        self.node_conv = torch.zeros(max_nodes, *self.conv.shape, dtype=dtype, device=device)
        self.node_k = torch.zeros(max_nodes, linear_layers, value_heads, key_dim, **f32)
        self.node_v = torch.zeros(max_nodes, linear_layers, value_heads, value_dim, **f32)
        self.node_g = torch.zeros(max_nodes, linear_layers, value_heads, **f32)
        self.node_beta = torch.zeros(max_nodes, linear_layers, value_heads, **f32)
        # where each layer's buffers begin, for a batch's one launch (kernels.gated_delta.DeltaBatch):
        # made once, since nothing here is ever allocated again
        rows = [layer_addresses(self.conv[n], self.ssm[n], self.delta_rows(n, max_nodes, True))
                for n in range(linear_layers)]
        self.addresses = torch.tensor(rows, dtype=torch.int64).reshape(linear_layers, len(ADDRESS_COLUMNS)).to(device)
        self.aligned = all(a % 16 == 0 for row in rows for a in row)  # what the batched kernels declare

    @property
    def k(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v(self) -> torch.Tensor:
        return self.kv.v

    def batches_with(self, other: "HybridState") -> bool:
        """Whether the two states' DeltaNet buffers have the same shapes and types, so that one
        launch can address both through the first's strides (DeltaBatch)."""
        pairs = [(getattr(self, name), getattr(other, name)) for name in ("ssm", "conv", "node_conv", "node_k")]
        return all((a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) for a, b in pairs)

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

    def keep_path(self, length: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> None:
        """keep_rows for a path whose real length `count` ([1], on the device) the host has not
        read: `path` [P] is padded with its last node. The KV rows move as KVCache.keep_path
        moves them. The fold runs all P steps, the padding ones as identities: a step of the
        delta rule is S * exp(g) + k (v - S^T k) beta, so g = 0 and beta = 0 leave S as it was
        (exp(0) is exactly 1 and the update is k times an exact zero, k and v being finite), and
        the state is the fold of the real steps alone. The conv window is the last node's, and
        the padding repeats the last node, so path[-1] is the last real one.

        The KV rows are written first: they lie past the committed length, scratch until the
        length moves, so an out-of-memory in the fold leaves the committed state as it was."""
        self.kv.keep_path(length, path, count)
        self.fold_path(path, count)

    def fold_path(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """keep_path's recurrent part: the padded path's fold into the live states and the last
        node's conv window. Everything that can allocate (the gathers) runs before the live
        states are written."""
        path = path.to(self.ssm.device)
        layers, heads = self.ssm.shape[:2]
        steps = path.numel()
        real = (torch.arange(steps, device=path.device) < count.to(path.device))[:, None, None]
        g = torch.where(real, self.node_g[path], 0.0)
        beta = torch.where(real, self.node_beta[path], 0.0)
        window = self.node_conv.index_select(0, path[-1:])[0]
        live = self.ssm.view(layers * heads, *self.ssm.shape[2:])
        gated_delta_fold(live, self.node_k[path].view(steps, layers * heads, -1),
                         self.node_v[path].view(steps, layers * heads, -1),
                         g.view(steps, layers * heads), beta.view(steps, layers * heads), out=live)
        self.conv.copy_(window)

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Run a block that may fold into the live recurrent states (a captured step's warm-up
        runs) and put them back afterwards. The copies go to `pending_*`, scratch that only a
        prefill chunk uses between its forward and its commit, so nothing is allocated."""
        self.pending_ssm.copy_(self.ssm)
        self.pending_conv.copy_(self.conv)
        try:
            yield
        finally:
            self.ssm.copy_(self.pending_ssm)
            self.conv.copy_(self.pending_conv)

    def layout(self) -> tuple:
        return self.kv.layout()

    def states(self) -> dict[str, torch.Tensor]:
        """The recurrent states at the committed length, by name."""
        return {"ssm": self.ssm, "conv": self.conv}
