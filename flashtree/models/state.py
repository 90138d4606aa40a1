"""The per-layer state a model reads and writes: preallocated KV storage for one sequence, and
for hybrid models the recurrent states beside it.

Row index == position. How many rows are committed is not kept here: the sequence state
(runtime/sequence.py) owns that one length, for the target's cache and the draft's together, and
passes it to every forward as a device tensor. A forward writes its new rows right after the
committed ones; the caller then commits them, keeps a subset (`compact`, or `keep_path` at a
length only the device knows), or leaves them as scratch. Nothing is allocated after
construction.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..errors import ConfigError
from ..kernels.gated_delta import DeltaRows, gated_delta_fold
from ..kernels.reference import KV_CODES, QBLOCK, KVRows, QuantRows, has_scale


def kv_kind(kv_type: Optional[str], dtype: torch.dtype) -> Optional[str]:
    """The stored format of a --kv-type for a model computing in `dtype`: None where rows are
    kept as they are computed (`auto`, or bf16 for a bf16 model), else a kernels.reference kind."""
    if kv_type in (None, "auto") or (kv_type == "bf16" and dtype == torch.bfloat16):
        return None
    if kv_type not in KV_CODES:
        raise ConfigError(f"unknown KV cache type {kv_type!r}; known: auto, {', '.join(KV_CODES)}")
    return kv_type


class KVCache:
    """Keys and values of every layer, each side stored as `k_type`/`v_type` says (module
    kernels.reference: plain rows, or codes with block scales). All of a side's tensors are
    [layers, capacity, heads, ...]: a row's codes and scales share its index, so compacting,
    snapshotting and restoring move every tensor's rows alike, whatever the format."""

    def __init__(self, num_layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, k_type: Optional[str] = None,
                 v_type: Optional[str] = None):
        self.dtype = dtype
        self.capacity = capacity
        self.head_dim = head_dim
        self.kinds = {"k": kv_kind(k_type, dtype), "v": kv_kind(v_type or k_type, dtype)}
        self.tensors: dict[str, torch.Tensor] = {}
        rows = (num_layers, capacity, kv_heads)
        for side, kind in self.kinds.items():
            if kind is None:
                self.tensors[side] = torch.zeros(*rows, head_dim, dtype=dtype, device=device)
                continue
            code_dtype, per_code = KV_CODES[kind]
            if has_scale(kind) and head_dim % QBLOCK:
                raise ConfigError(f"KV cache type {kind} needs a head_dim divisible by {QBLOCK}, "
                                  f"this model's is {head_dim}")
            self.tensors[side] = torch.zeros(*rows, head_dim // per_code, dtype=code_dtype, device=device)
            if has_scale(kind):
                self.tensors[f"{side}_scale"] = torch.zeros(*rows, head_dim // QBLOCK, dtype=torch.float16,
                                                            device=device)

    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]

    def layer(self, i: int) -> tuple[KVRows, KVRows]:
        """Layer i's keys and values as the kernels take them: plain rows, or QuantRows."""
        def side(name: str) -> KVRows:
            kind = self.kinds[name]
            if kind is None:
                return self.tensors[name][i]
            scale = self.tensors.get(f"{name}_scale")
            return QuantRows(kind, self.tensors[name][i], scale[i] if scale is not None else None)

        return side("k"), side("v")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def bytes_per_token(self) -> int:
        return self.nbytes // self.capacity

    def layout(self) -> tuple:
        """What rows of another cache must match to be loaded here: dtype, per-row shape and
        layers as before quantized types existed (older disk files stay valid), and the types
        where either side is quantized."""
        plain = (str(self.k.dtype), tuple(self.k.shape[2:]), self.k.shape[0])
        if self.kinds == {"k": None, "v": None}:
            return plain
        return plain + (tuple((n, str(t.dtype), tuple(t.shape[2:])) for n, t in self.tensors.items()),
                        self.kinds["k"], self.kinds["v"])

    def compact(self, length: int, keep: torch.Tensor) -> None:
        """Move the scratch rows at offsets `keep` (relative to `length`, increasing) to rows
        [length, length + len(keep)), dropping the rest of the scratch."""
        n = keep.numel()
        rows = keep.to(self.k.device) + length
        for t in self.tensors.values():
            t[:, length:length + n] = t[:, rows]

    def keep_path(self, length: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> None:
        """`compact` at a length the host does not know: move the scratch rows at offsets `path`
        ([P] long, a tree's accepted path padded with its last node) to rows [length, length + P).
        `length` [1] is the committed length on the device; `count`, the path's real length, is
        not needed here: rows past it are copies of the last node's, past the length the step
        commits, and the next forward overwrites them (only committed rows are ever read)."""
        start = length.to(path.device, torch.long)
        rows = path + start
        dest = torch.arange(path.numel(), device=path.device) + start
        for t in self.tensors.values():
            t.index_copy_(1, dest, t.index_select(1, rows))

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        """Nothing to keep: a forward only writes rows past the committed length (scratch)."""
        yield

    def rows(self, n: int) -> dict[str, torch.Tensor]:
        """Views of the first n rows of every layer, by tensor name (for snapshots): `k`, `v`,
        and the quantized sides' `k_scale`/`v_scale`."""
        return {name: t[:, :n] for name, t in self.tensors.items()}

    def load_rows(self, rows: dict[str, torch.Tensor]) -> None:
        """Overwrite rows [0, n) of every tensor with `rows` (as `rows()` names them, [layers, n,
        ...]) from any device.

        Copied layer by layer: each layer's rows are contiguous even when a source is a prefix
        slice of a longer snapshot, so a copy from pinned host memory is one direct DMA (a
        strided source would first be gathered through pageable memory) and no device-side
        staging buffer is needed."""
        n = rows["k"].shape[1]
        if n > self.capacity:
            raise RuntimeError(f"snapshot of {n} rows does not fit capacity {self.capacity}")
        for name, live in self.tensors.items():
            for layer in range(live.shape[0]):
                live[layer, :n].copy_(rows[name][layer], non_blocking=True)

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
                 k_type: Optional[str] = None, v_type: Optional[str] = None):
        self.kv = KVCache(attn_layers, capacity, kv_heads, head_dim, dtype, device, k_type, v_type)
        self.dtype = dtype
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

    def keep_path(self, length: torch.Tensor, path: torch.Tensor, count: torch.Tensor) -> None:
        """keep_rows for a path whose real length `count` ([1], on the device) the host has not
        read: `path` [P] is padded with its last node. The KV rows move as KVCache.keep_path
        moves them. The fold runs all P steps, the padding ones as identities: a step of the
        delta rule is S * exp(g) + k (v - S^T k) beta, so g = 0 and beta = 0 leave S as it was
        (exp(0) is exactly 1 and the update is k times an exact zero, k and v being finite), and
        the state is the fold of the real steps alone. The conv window is the last node's, and
        the padding repeats the last node, so path[-1] is the last real one.

        Everything that can allocate (the gathers) runs before the live states are written."""
        self.kv.keep_path(length, path, count)
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

    def rows(self, n: int) -> dict[str, torch.Tensor]:
        return self.kv.rows(n)

    def load_rows(self, rows: dict[str, torch.Tensor]) -> None:
        self.kv.load_rows(rows)

    def layout(self) -> tuple:
        return self.kv.layout()

    def states(self) -> dict[str, torch.Tensor]:
        """The recurrent states at the committed length, by name."""
        return {"ssm": self.ssm, "conv": self.conv}
