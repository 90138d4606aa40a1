"""The Gated DeltaNet ops with their tree form: Triton on CUDA (fla-core's chunked kernel for long
prefill chunks where it is installed, ours for the rest), their definitions (reference.py)
elsewhere.

A tree of T new rows is described once per step by a TreeIndex built from the parents, on the
host (build) or, for a tree that stays on the device, there (from_parents: tree_index.py): the
delta rule's steps, depth-first (a new branch recomputes its node from the committed state
along the node's ancestors), and the K conv inputs each row sees. Everything is a fixed-size
tensor, so a captured graph can read them from static buffers.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import deterministic, use_triton
from .reference import delta_inputs as reference_inputs
from .reference import gated_delta_fold as reference_fold
from .reference import gated_delta_rule as reference_rule
from .reference import gated_rms_norm as reference_gated_norm
from .tree_index import IndexTables, forest_parents, tree_indexes

# A sequence's row of a DeltaBatch's address table, per layer: where each of its DeltaNet buffers
# for that layer begins (the committed conv window and state, then where its tree's delta-rule
# inputs and windows go), in the order the kernels' BATCH mode loads them.
ADDRESS_COLUMNS = ("window", "state", "k", "v", "g", "beta", "windows")


@dataclass
class TreeIndex:
    parents: torch.Tensor    # [T] long, on the host (the tree's device for from_parents): -1 = the committed sequence
    steps: torch.Tensor      # [S] int32: the scan's steps in order, each 4 * row + 2 * emit + restart
    bounds: torch.Tensor     # [B + 1] int32: each segment's first step, then the step count
    n_segments: torch.Tensor  # [1] int32: how many segments (B) the scan runs
    conv_rows: torch.Tensor  # [T, K] long: rows of cat(window, x) each row's convolution sees
    n_host: Optional[int]    # the step count on the host (fill_ places the padding rows' steps after it)
    segments_host: Optional[int]  # n_segments on the host; both None where the tables were made on the device
    roots: Optional["TreeIndex"] = None  # static buffers only: every row a root of its own

    @classmethod
    def build(cls, parents: Sequence[int], conv_kernel: int, device: torch.device | str) -> "TreeIndex":
        """The scan walks the rows depth-first, so that each row continues its parent's state,
        left in registers by the step before; where the row visited before is not its parent (a
        new branch), the state restarts from the committed one and the row's ancestors are
        replayed first (steps that emit nothing). Every step is listed, so the kernel's loop is
        uniform and can load the next step's inputs while it computes this one; each restart
        begins a segment (`bounds`), which needs nothing from the steps before it: the Triton
        scan runs a tree's segments side by side."""
        chains: list[list[int]] = []
        children: list[list[int]] = [[] for _ in parents]
        for t, p in enumerate(parents):
            chains.append((chains[p] if p >= 0 else []) + [t])
            if p >= 0:
                children[p].append(t)
        order: list[int] = []
        stack = [t for t, p in enumerate(parents) if p < 0][::-1]
        while stack:
            order.append(stack.pop())
            stack.extend(reversed(children[order[-1]]))
        steps: list[int] = []
        starts: list[int] = []
        for i, t in enumerate(order):
            if i == 0 or parents[t] != order[i - 1]:  # replay the chain from the committed state
                starts.append(len(steps))
                steps += [4 * a + (1 if j == 0 else 0) for j, a in enumerate(chains[t])]
                steps[-1] += 2
            else:
                steps.append(4 * t + 2)
        window = list(range(conv_kernel - 1))
        conv = [(window + [conv_kernel - 1 + a for a in c])[-conv_kernel:] for c in chains]
        # one upload per step: every table in one int32 tensor, cut into views on the device
        n, b = len(steps), len(starts)
        flat = torch.tensor(steps + starts + [n, b] + [x for row in conv for x in row], dtype=torch.int32).to(device)
        return cls(torch.tensor(list(parents), dtype=torch.long), flat[:n], flat[n:n + b + 1],
                   flat[n + b + 1:n + b + 2], flat[n + b + 2:].view(len(parents), conv_kernel).long(), n, b)

    @classmethod
    def from_parents(cls, parents: torch.Tensor, n_nodes: torch.Tensor, conv_kernel: int) -> "TreeIndex":
        """build's index for parents [T] long on their device (a DeviceTrees row: n_nodes [1] int
        there, the rows from it on roots of their own), made there (tree_index.tree_indexes): no
        value is read back and none uploaded, so a step whose tree stays on the device needs no
        read before its verify. `bounds` has T + 1 entries and `steps` T(T+1)/2, the counts only
        on the device (n_host and segments_host None); what lies past them is never read.
        `parents` keeps the padding rows as -1: what the reference scan reads off Triton."""
        tables = tree_indexes(parents[None], n_nodes.reshape(1), conv_kernel)
        return cls(forest_parents(parents[None], n_nodes.reshape(1), parents.shape[0])[0], tables.steps[0],
                   tables.bounds[0], tables.n_segments, tables.conv_rows[0], None, None)

    @classmethod
    def static(cls, rows: int, conv_kernel: int, device: torch.device | str) -> "TreeIndex":
        """Buffers for trees of up to `rows` nodes (a captured graph's): every row a root of its
        own until `fill_` copies a tree in, so padding rows stay harmless and in bounds. A tree
        of `rows` nodes takes at most rows * (rows + 1) / 2 steps (a path replayed at each row)
        and has at most `rows` segments (one a leaf)."""
        index = cls.build([-1] * rows, conv_kernel, device)
        index.roots = cls.build([-1] * rows, conv_kernel, device)  # what fill_ gives padding rows
        index.steps = torch.zeros(rows * (rows + 1) // 2, dtype=torch.int32, device=device)
        index.steps[:rows] = index.roots.steps
        return index

    def fill_(self, tree: "TreeIndex") -> None:
        """Copy `tree` (at most as many rows) into these buffers, the rows after it as roots (a
        segment of one step each). A tree made on the device (from_parents) stays there: its
        tables are copied where it has as many rows, else made again from its parents
        (fill_parents_); either way nothing is read back or uploaded."""
        t, total = tree.parents.shape[0], self.parents.shape[0]
        if tree.n_host is None or tree.segments_host is None:
            if t < total:
                self.fill_parents_(tree.parents)
                return
            for mine, theirs in ((self.steps, tree.steps), (self.bounds, tree.bounds),
                                 (self.n_segments, tree.n_segments), (self.conv_rows, tree.conv_rows)):
                mine.copy_(theirs)
            self._parents_(tree.parents)
            self.n_host = self.segments_host = None
            return
        self._parents_(tree.parents)
        pad = total - t
        self.steps[:tree.n_host].copy_(tree.steps)
        self.steps[tree.n_host:tree.n_host + pad].copy_(self.roots.steps[t:])
        self.bounds[:tree.segments_host].copy_(tree.bounds[:-1])
        torch.add(self.roots.bounds[:pad + 1], tree.n_host,
                  out=self.bounds[tree.segments_host:tree.segments_host + pad + 1])
        self.n_host = tree.n_host + pad
        self.segments_host = tree.segments_host + pad
        self.n_segments.fill_(self.segments_host)
        self.conv_rows[:t] = tree.conv_rows
        self.conv_rows[t:] = self.roots.conv_rows[t:]

    def fill_parents_(self, parents: torch.Tensor, n_nodes: Optional[torch.Tensor] = None) -> None:
        """fill_ with the index of parents [t] (t at most these buffers' rows; n_nodes [1], None
        for t), made on the parents' device, where these buffers must be, straight into them
        (tree_index.tree_indexes): no index between, no read, no upload. The counts stay on the
        device (n_host and segments_host None): the scan reads them from the buffers. What it
        launches reads and writes device memory only, so a graph can capture it too."""
        n = None if n_nodes is None else n_nodes.reshape(1)
        tree_indexes(parents[None], n, self.conv_rows.shape[1], self.parents.shape[0],
                     IndexTables(self.steps[None], self.bounds[None], self.n_segments, self.conv_rows[None]))
        self._parents_(forest_parents(parents[None], n, parents.shape[0])[0])
        self.n_host = self.segments_host = None

    def _parents_(self, parents: torch.Tensor) -> None:
        """`parents` then roots, where the reference scan reads them: on the device the tree's
        parents come from (a copy across devices would read the device or upload), so a tree
        made on the device moves them there and a host tree moves them back."""
        if self.parents.device != parents.device:
            self.parents = torch.empty(self.parents.shape, dtype=torch.long, device=parents.device)
        self.parents.fill_(-1)
        self.parents[:parents.shape[0]] = parents


@dataclass
class DeltaRows:
    """Where a step's delta-rule inputs go (float32) and the conv windows after its rows: the
    scratch a sequence's scan reads, or a tree's per-node buffers (HybridState) that the commit
    folds. Last dims contiguous; rows may be strided."""
    k: torch.Tensor        # [T, Hv, Dk], normalised
    v: torch.Tensor        # [T, Hv, Dv]
    g: torch.Tensor        # [T, Hv]
    beta: torch.Tensor     # [T, Hv]
    windows: torch.Tensor  # [K-1, C] after a sequence; [T, K-1, C] for a tree


def layer_addresses(window: torch.Tensor, state: torch.Tensor, rows: DeltaRows) -> list[int]:
    """A layer's row of a sequence's address table (ADDRESS_COLUMNS): its buffers' first bytes."""
    return [t.data_ptr() for t in (window, state, rows.k, rows.v, rows.g, rows.beta, rows.windows)]


@dataclass
class DeltaBatch:
    """Several sequences' trees of R rows each through a DeltaNet layer in one launch per kernel,
    where a launch a sequence would leave most of the GPU idle (a tree's scan is a few thousand
    one-warp programs walking 23 steps). The sequences' buffers stay where they are (a sequence
    owns them for its life, so their addresses never change): each kernel program finds its
    sequence's through `addresses`, and otherwise runs what that sequence's launch alone would
    run, so batching changes no bits. Built once a forward (the stacks are device copies, so a
    captured graph's replay sees what the parts' tables hold then)."""
    addresses: torch.Tensor  # [S, L, len(ADDRESS_COLUMNS)] int64, or a layer's [S, columns]
    trees: IndexTables       # the trees' tables, a row a sequence

    @classmethod
    def of(cls, addresses: Sequence[torch.Tensor], trees: Sequence[TreeIndex]) -> "DeltaBatch":
        """The batch of sequences with these address tables ([L, columns] each) and trees (of as
        many rows each); tables of different lengths (trees built on the host) padded."""
        def stack(xs: Sequence[torch.Tensor]) -> torch.Tensor:
            n = max(x.shape[0] for x in xs)
            return torch.stack([torch.nn.functional.pad(x, (0, n - x.shape[0])) if x.shape[0] < n else x
                                for x in xs])
        return cls(torch.stack(list(addresses)),
                   IndexTables(stack([t.steps for t in trees]), stack([t.bounds for t in trees]),
                               torch.cat([t.n_segments for t in trees]),
                               torch.stack([t.conv_rows for t in trees])))

    def at(self, layer: int) -> "DeltaBatch":
        """The batch at one layer (its address rows)."""
        return DeltaBatch(self.addresses[:, layer], self.trees)


def delta_inputs_batch(proj: torch.Tensor, batch: DeltaBatch, window: torch.Tensor, conv_weight: torch.Tensor,
                       a_log: torch.Tensor, dt_bias: torch.Tensor, key_heads: int, key_dim: int,
                       value_dim: int, out: DeltaRows) -> torch.Tensor:
    """delta_inputs for a layer's batch (DeltaBatch.at) of S trees over proj [S * R, ...]: each
    sequence's k, v, g, beta and windows go to its buffers; `window` and `out` are the first
    sequence's (the strides of all). Returns q [S * R, Hv, Dk]. Triton only."""
    from .triton_delta_inputs import delta_inputs as kernel

    return kernel(proj, window, conv_weight, a_log, dt_bias, key_heads, key_dim, value_dim, batch.trees.conv_rows,
                  out.k, out.v, out.g, out.beta, out.windows, batch.addresses)


def gated_delta_tree_batch(q: torch.Tensor, batch: DeltaBatch, state: torch.Tensor, rows: DeltaRows
                           ) -> torch.Tensor:
    """gated_delta_rule over a layer's batch of S trees (DeltaBatch.at): q [S * R, Hv, Dk], each
    sequence's inputs and committed state at its addresses (`state` and `rows` the first's).
    Returns the outputs [S * R, Hv, Dv]. Triton only."""
    from .triton_gated_delta import scan

    return scan(q, rows.k, rows.v, rows.g, rows.beta, state, batch.trees, None, addresses=batch.addresses)


def delta_inputs(proj: torch.Tensor, window: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, key_heads: int, key_dim: int, value_dim: int,
                 tree: Optional[TreeIndex], out: DeltaRows) -> torch.Tensor:
    """reference.delta_inputs (conv window, SiLU, L2 norms, g, beta) in one launch on CUDA: writes
    k, v, g, beta and the windows into `out`, returns q [T, Hv, Dk] float32. conv_weight [C, K]."""
    rows = tree.conv_rows if tree is not None else None
    if use_triton(proj):
        from .triton_delta_inputs import delta_inputs as kernel

        return kernel(proj, window, conv_weight, a_log, dt_bias, key_heads, key_dim, value_dim, rows,
                      out.k, out.v, out.g, out.beta, out.windows)
    q, k, v, g, beta, windows = reference_inputs(proj, window, conv_weight, a_log, dt_bias, key_heads,
                                                 key_dim, value_dim, rows)
    for dest, src in ((out.k, k), (out.v, v), (out.g, g), (out.beta, beta), (out.windows, windows)):
        dest.copy_(src)
    return q


def gated_output(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
                 ) -> torch.Tensor:
    """The scan's float32 output x [T, Hv, Dv] cast to `dtype`, RMSNormed per head and gated by
    silu(z), z [T, Hv*Dv] (reference.gated_rms_norm): [T, Hv*Dv] in `dtype`, one launch on CUDA."""
    if use_triton(x):
        from .triton_delta_inputs import gated_rms_norm as kernel

        return kernel(x, z, weight, eps, dtype)
    t, heads, dim = x.shape
    return reference_gated_norm(x.to(dtype), z.view(t, heads, dim), weight, eps).reshape(t, -1)


# A sequence this long (a prefill chunk) runs fla-core's chunked kernel where it is installed: its
# chunks of 64 rows are matmuls, where our scan walks the rows one by one. Shorter ones (an AR step,
# a chain's block, a prompt's tail) and every tree run our scan.
CHUNKED_MIN_ROWS = 64


@functools.lru_cache(maxsize=1)
def chunked_rule() -> Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """fla-core's `chunk_gated_delta_rule` (the `gpu` extra) when FLASHTREE_FLA_PREFILL=1, else
    None. Its final state is float32 (accumulated in float32 across chunks; the matmuls inside a
    chunk run at Triton's default float32 dot precision), and it takes the layer's state as its
    initial state, so chunks carry across calls as our scan's do; the conv windows stay ours.
    Opt-in: per layer it agrees with our scan within 5e-3, but over a 4B-shape model's 700-token
    prefill the last logits differ by several percent (tests/test_gpu_hybrid_kernels.py), so a
    prefix resumed from a state checkpoint need not continue exactly as a fresh prefill would
    until that is understood. Never in the deterministic mode: our scan takes a prefill's rows
    with the very steps of a decode step, a tree and a fold."""
    if os.environ.get("FLASHTREE_FLA_PREFILL") != "1":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, tree: Optional[TreeIndex],
                     final: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(outputs [T, H, Dv], the final state for a sequence / None for a tree); float32 inputs:
    q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] the committed one. A
    sequence's final state is written into `final` where given (a contiguous [H, Dk, Dv])."""
    long_chunk = tree is None and q.is_cuda and q.shape[0] >= CHUNKED_MIN_ROWS and not deterministic()
    chunked = chunked_rule() if long_chunk else None
    if chunked is not None and not (q.requires_grad and torch.is_grad_enabled()):
        out, last = chunked(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                            initial_state=state[None].contiguous(), output_final_state=True)
        return out[0], (last[0] if final is None else final.copy_(last[0]))
    if use_triton(q):
        from .triton_gated_delta import scan

        if tree is not None:
            return scan(q, k, v, g, beta, state, tree, None), None
        final = torch.empty_like(state) if final is None else final
        return scan(q, k, v, g, beta, state, None, final), final
    out, last = reference_rule(q, k, v, g, beta, state, tree.parents if tree is not None else None)
    if tree is not None:
        return out, None
    return out, (last if final is None else final.copy_(last))


def gated_delta_fold(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The state after the rows k, v, g, beta in order (an accepted path) from `state`, written
    into `out` where given (contiguous; `state` itself folds in place: the kernel's programs
    each read their slice before writing it)."""
    if use_triton(k):
        from .triton_gated_delta import scan

        final = torch.empty_like(state) if out is None else out
        scan(None, k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, None, final)
        return final
    folded = reference_fold(state, k, v, g, beta)
    return folded if out is None else out.copy_(folded)
