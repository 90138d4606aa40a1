"""A hybrid target's tree scan index (gated_delta.TreeIndex's tables) computed on the device from
a tree's parents, so that a decode step whose tree stays on the device reads nothing back and
uploads nothing before its verify.

The tables are TreeIndex.build's for the same parents, element for element: the rows are
walked depth-first, children in increasing row order and roots (-1 parents) likewise; a row
whose parent is the row visited just before continues its state (one step, 4 * row + 2); any
other row (a new branch or a root) restarts from the committed state and replays its ancestors
root first (4 * ancestor, the first + 1, the row itself + 2) and begins a segment; `bounds`
holds each segment's first step then the step count, `n_segments` the segment count, and
`conv_rows` [R, K] each row's convolution inputs: the rows of cat(window, x) along its chain,
topped up from the window. Rows at or past a tree's n_nodes, and rows past its parents (up to
`rows`), are roots of their own: fill_'s padding rows. A row whose parent is not an earlier row
is a root too (DeviceTrees' rows never have one); that keeps every address in bounds whatever
the parents hold, as the device cannot check them without a read. Entries past the step count
and past the segment count are not part of the tables: the scan never reads them.

Each tree is computed on its own (a program per tree in the kernel), so a tree's tables do not
depend on how many trees are passed together. The definition here is vectorised PyTorch (about
forty launches, no read of the device), the spec and the path off Triton; the Triton kernel
(triton_tree_index.py) walks the tree in one program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import use_triton
from .tree import ancestor_masks


@dataclass
class IndexTables:
    steps: torch.Tensor       # [B, R * (R + 1) / 2] int32: 4 * row + 2 * emit + restart
    bounds: torch.Tensor      # [B, R + 1] int32: each segment's first step, then the step count
    n_segments: torch.Tensor  # [B] int32
    conv_rows: torch.Tensor   # [B, R, K] long


def max_steps(rows: int) -> int:
    """The steps a tree of `rows` rows can take: a path whose every row is replayed."""
    return rows * (rows + 1) // 2


def forest_parents(parents: torch.Tensor, n_nodes: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """[B, rows] long: `parents` [B, N] with the rows at or past n_nodes [B] (None: N), the rows
    past N and the rows whose parent is not an earlier row made roots (-1)."""
    b, n = parents.shape
    at = torch.arange(rows, device=parents.device)
    full = torch.nn.functional.pad(parents.long(), (0, rows - n), value=-1)
    limit = n_nodes.to(parents.device).long()[:, None].clamp(max=n) if n_nodes is not None else n
    return torch.where((at < limit) & (full >= 0) & (full < at), full, -1)


def empty_tables(batch: int, rows: int, conv_kernel: int, device: torch.device | str) -> IndexTables:
    """Uninitialised tables for `batch` trees of `rows` rows."""
    return IndexTables(torch.empty(batch, max_steps(rows), dtype=torch.int32, device=device),
                       torch.empty(batch, rows + 1, dtype=torch.int32, device=device),
                       torch.empty(batch, dtype=torch.int32, device=device),
                       torch.empty(batch, rows, conv_kernel, dtype=torch.long, device=device))


def tree_indexes(parents: torch.Tensor, n_nodes: Optional[torch.Tensor], conv_kernel: int,
                 rows: Optional[int] = None, out: Optional[IndexTables] = None) -> IndexTables:
    """The tables of each tree of parents [B, N] (long, on its device; n_nodes [B] int or None
    for N) over `rows` >= N rows (default N), written into `out` where given (contiguous, of
    those shapes: a TreeIndex's static buffers). Runs the Triton kernel where Triton runs, else
    the definition; nothing is read back to the host either way."""
    b, n = parents.shape
    rows = n if rows is None else rows
    if rows < max(n, 1) or conv_kernel < 1:
        raise ValueError(f"rows must be >= max(N, 1) = {max(n, 1)} and conv_kernel >= 1, got {rows}, {conv_kernel}")
    if out is not None:
        want = {"steps": ((b, max_steps(rows)), torch.int32), "bounds": ((b, rows + 1), torch.int32),
                "n_segments": ((b,), torch.int32), "conv_rows": ((b, rows, conv_kernel), torch.long)}
        for name, (shape, dtype) in want.items():
            got = getattr(out, name)
            if (tuple(got.shape) != shape or got.dtype != dtype or not got.is_contiguous()
                    or got.device != parents.device):
                raise ValueError(f"out.{name} must be a contiguous {dtype} {shape} on {parents.device}")
    if use_triton(parents):
        from .triton_tree_index import tree_indexes as kernel

        out = empty_tables(b, rows, conv_kernel, parents.device) if out is None else out
        if n_nodes is None:
            n_nodes = torch.full((b,), n, dtype=torch.int32, device=parents.device)
        kernel(parents, n_nodes, conv_kernel, rows, out)
        return out
    tables = reference_tree_indexes(parents, n_nodes, conv_kernel, rows)
    if out is None:
        return tables
    for name in ("steps", "bounds", "n_segments", "conv_rows"):
        getattr(out, name).copy_(getattr(tables, name))
    return out


def reference_tree_indexes(parents: torch.Tensor, n_nodes: Optional[torch.Tensor], conv_kernel: int,
                           rows: Optional[int] = None) -> IndexTables:
    """The definition, vectorised over the trees and their rows (entries past the counts: 0).

    With anc[t, a] (a is t or an ancestor of t, by ancestor_masks' pointer doubling), a row's
    depth is its count of ancestors, its subtree the rows it is an ancestor of, and its
    depth-first position `pre` the rows before it: its ancestors, plus the subtrees of every
    earlier sibling of it or of its ancestors. The row visited before a row is its parent
    exactly when that row restarts not; a restart takes depth + 1 steps, any other row one,
    and a row's first step is the sum over the rows visited before it. Each (row, ancestor)
    pair of a restart then lands at that first step + the ancestor's depth."""
    par = forest_parents(parents, n_nodes, parents.shape[1] if rows is None else rows)
    b, r = par.shape
    dev = par.device
    at = torch.arange(r, device=dev)
    anc = ancestor_masks(par, torch.full((b,), r, dtype=torch.int32, device=dev))  # [B, t, a]
    depth = anc.sum(-1) - 1
    size = anc.sum(1)
    earlier = (par[:, None, :] == par[:, :, None]) & (at[None, :] < at[:, None])  # [B, a, s]: s before a
    before = (earlier * size[:, None, :]).sum(-1)
    pre = (anc * (before + 1)[:, None, :]).sum(-1) - 1
    order = torch.empty_like(pre).scatter_(1, pre, at.expand(b, r).contiguous())
    restart = (par < 0) | (par != order.gather(1, (pre - 1).clamp(min=0)))
    length = torch.where(restart, depth + 1, 1)
    in_order = length.gather(1, order)
    first = (in_order.cumsum(1) - in_order).gather(1, pre)
    total = length.sum(1)
    s = max_steps(r)
    own = (at[:, None] == at[None, :])[None]  # [1, t, a]
    replay = restart[:, :, None]
    lands = anc & (replay | own)
    pos = first[:, :, None] + torch.where(replay, depth[:, None, :], 0)
    code = 4 * at[None, None, :] + 2 * own.long() + (replay & (depth[:, None, :] == 0)).long()
    steps = torch.zeros(b, s + 1, dtype=torch.long, device=dev)  # slot s takes what lands nowhere
    steps.scatter_(1, torch.where(lands, pos, s).flatten(1), code.expand(b, r, r).flatten(1))
    restarts_in_order = restart.gather(1, order).long()
    segment = (restarts_in_order.cumsum(1) - restarts_in_order).gather(1, pre)
    n_segments = restart.sum(1)
    bounds = torch.zeros(b, r + 2, dtype=torch.long, device=dev)  # slot r + 1 likewise
    bounds.scatter_(1, torch.where(restart, segment, r + 1), first)
    bounds.scatter_(1, n_segments[:, None], total[:, None])
    cols = []
    up = at.expand(b, r)
    for m in range(conv_kernel):  # column K-1-m: the m-th ancestor, or the window past the root
        cols.append(torch.where(m <= depth, conv_kernel - 1 + up, conv_kernel - 1 - (m - depth)))
        lifted = par.gather(1, up)
        up = torch.where(lifted >= 0, lifted, up)
    return IndexTables(steps[:, :s].int(), bounds[:, :r + 1].int(), n_segments.int(),
                       torch.stack(cols[::-1], -1))
