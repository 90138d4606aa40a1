"""Triton kernel of a tree's scan index (tree_index.tree_indexes; tree_index.py states the rule).

One program per tree, one warp: the walk is a chain of dependent steps (each row's successor
follows from the row before), and within one warp a reduction is register shuffles with no
barrier. Every program runs the same loops on its own tree, so a tree's tables do not depend on
how many trees are passed together.

The walk's stack is implicit. A first pass over the rows, last to first, gives each row its
first child and its next sibling (the smallest later row with the same parent): a row's first
child is the smallest child seen so far when the pass reaches it from above. The depth-first
walk then keeps, in registers, the current root path (`path[j]`: the row at depth j) and each
path row's next sibling (`later[j]`); after a row, the walk descends to its first child (no
restart: the parent was the row before) or, at a leaf, moves to the next sibling of the deepest
path row that has one (a restart). That is the host build's stack order, without a stack.

Each visited row stores its steps (a restart replays `path[0..d]`, a vector store at the
row's first step; any other row stores one code), its segment's first step when it restarts,
and its conv row: column K-1-d+j takes path row j, the columns before it the window's rows.
Every address is stored once, so no lane's store can overtake another's to the same address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pick(values, at, i):
    """values[i] of a register vector (0 where i is out of range)."""
    return tl.sum(tl.where(at == i, values, 0), axis=0)


@triton.jit
def _tree_index_kernel(PAR, N_NODES, STEPS, BOUNDS, N_SEG, CONV, N, R, S,
                       K: tl.constexpr, KB: tl.constexpr, NP: tl.constexpr):
    tree = tl.program_id(0).to(tl.int64)
    at = tl.arange(0, NP)
    n = tl.minimum(tl.load(N_NODES + tree), N)
    par = tl.load(PAR + tree * N + at, mask=at < n, other=-1).to(tl.int32)
    par = tl.where((par >= 0) & (par < at), par, -1)  # only an earlier row is a parent
    # first children and next siblings (NP: none), rows last to first
    first = tl.full([NP], NP, tl.int32)
    sibling = tl.full([NP], NP, tl.int32)
    first_root = n * 0 + NP
    for i in range(0, R):
        row = R - 1 - i
        p = _pick(par, at, row)
        nxt = tl.where(p >= 0, _pick(first, at, p), first_root)
        sibling = tl.where(at == row, nxt, sibling)
        first = tl.where(at == p, row, first)
        first_root = tl.where(p < 0, row, first_root)
    # the walk: one row an iteration, from row 0 (a root: a parent is an earlier row)
    path = tl.zeros([NP], tl.int32)
    later = tl.full([NP], NP, tl.int32)
    cols = tl.arange(0, KB)
    row = n * 0
    d = n * 0
    restart = n * 0 + 1
    step = n * 0
    segment = n * 0
    for i in range(0, R):
        path = tl.where(at == d, row, path)
        later = tl.where(at == d, _pick(sibling, at, row), later)
        replay = restart != 0
        # a restart stores codes for path[0..d] from `step`; any other row its own code only
        dest = step + at - tl.where(replay, 0, d)
        code = 4 * path + tl.where((at == 0) & replay, 1, 0) + tl.where(at == d, 2, 0)
        mine = (at <= d) & (at + restart * NP >= d)  # path[0..d] on a restart, else path[d]
        tl.store(STEPS + tree * S + dest, code, mask=mine & (dest < S))
        tl.store(BOUNDS + tree * (R + 1) + segment, step, mask=replay)
        conv = CONV + (tree * R + row) * K
        col = K - 1 - d + at
        tl.store(conv + col, (K - 1 + path).to(tl.int64), mask=(at <= d) & (col >= 0))
        tl.store(conv + cols, (d + cols).to(tl.int64), mask=(cols < K) & (d + cols < K - 1))
        step += tl.where(replay, d + 1, 1)
        segment += restart
        child = _pick(first, at, row)
        up = tl.max(tl.where((at <= d) & (later < NP), at, -1), axis=0)  # deepest with a next sibling
        down = child < NP
        row = tl.where(down, child, _pick(later, at, up))
        d = tl.where(down, d + 1, up)
        restart = tl.where(down, 0, 1)
    tl.store(BOUNDS + tree * (R + 1) + segment, step)
    tl.store(N_SEG + tree, segment)


def tree_indexes(parents: torch.Tensor, n_nodes: torch.Tensor, conv_kernel: int, rows: int, out) -> None:
    """Write the tables of parents [B, N] (n_nodes [B]) over `rows` rows into `out` (a
    tree_index.IndexTables of contiguous tensors, shapes checked by the caller)."""
    b, n = parents.shape
    _tree_index_kernel[(b,)](parents.long().contiguous(), n_nodes.to(torch.int32).contiguous(), out.steps,
                             out.bounds, out.n_segments, out.conv_rows, n, rows, out.steps.shape[1],
                             K=conv_kernel, KB=triton.next_power_of_2(conv_kernel),
                             NP=triton.next_power_of_2(rows), num_warps=1)
