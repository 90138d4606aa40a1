"""Triton kernel of the best-first tree build (tree.build_trees; tree.py states the rule).

One program per row (a sequence's tree), one warp: the build is a chain of dependent steps
(pop the best, push two), each a pair of reductions over the frontier, and within one warp a
reduction is register shuffles with no barrier. Every row runs the same sequential loop on its
own data, so a row's tree does not depend on how many rows there are or how they are split.

The frontier lives in registers: entry i is the i-th push (append only, so a slot's index IS
its insertion order), a float64 score and an int64 key packing slot << 48 | parent << 32 |
rank << 16 | depth; a popped or unused entry holds key EMPTY and score -inf. A step takes
m = max(score) and then the smallest key among the live entries scoring m: the smallest key is
the smallest slot, so this is the heap's (-score, insertion order) order, and the key carries
the entry's fields out of the same reduction. Pushes never exceed D (the chain seed's siblings
and its first child) + 2 * budget (each pop pushes at most two), so F, that bound rounded up to
a power of two, never overflows.

The output rows are built in registers too and stored once at the end: stores to one address
from different lanes of a program are not ordered without a barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EMPTY = tl.constexpr(1 << 62)  # key of a free or popped frontier slot: above every packed key
FIELD_MAX = 1 << 16  # depth, rank and parent each take 16 bits of a key, the slot 14 more


@triton.jit
def _pack(slot, depth, rank, parent):
    return ((tl.cast(slot, tl.int64) << 48) | (tl.cast(parent, tl.int64) << 32)
            | (tl.cast(rank, tl.int64) << 16) | tl.cast(depth, tl.int64))


@triton.jit
def _push(score, key, slots, at, on, value, depth, rank, parent):
    """Put (value, fields) in slot `at` where `on`."""
    here = (slots == at) & on
    return tl.where(here, value, score), tl.where(here, _pack(at, depth, rank, parent), key)


@triton.jit
def _build_trees_kernel(logp_ptr, ids_ptr, bonus_ptr, cap_ptr, tok_ptr, par_ptr, dep_ptr, n_ptr,
                        D, K, budget, CHAIN: tl.constexpr, F: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lp_row = logp_ptr + row * D * K
    id_row = ids_ptr + row * D * K
    root = tl.load(bonus_ptr + row)
    cap = tl.minimum(tl.maximum(tl.load(cap_ptr + row), 0), D)
    slots = tl.arange(0, F)
    score = tl.full([F], float("-inf"), tl.float64)
    key = tl.full([F], EMPTY, tl.int64)
    at = tl.arange(0, NP)
    tokens = tl.zeros([NP], tl.int64) + root  # padding rows: copies of the root
    parents = tl.full([NP], -1, tl.int64)
    depths = tl.zeros([NP], tl.int64)
    n = cap * 0  # nodes after the root (int32, like the counters it is compared with)
    pushes = cap * 0
    if CHAIN:
        # the top-1 chain, each depth first pushing the rank-1 sibling: build_tree's order
        length = tl.minimum(cap, budget)
        s = (cap * 0).to(tl.float64)  # the chain's score so far, as build_tree's `score`
        for d in range(0, D):
            on = d < length
            w = on & (K > 1)
            second = tl.load(lp_row + d * K + 1, mask=w, other=0.0).to(tl.float64)
            score, key = _push(score, key, slots, pushes, w, s + second, d + 1, 1, n)
            pushes += w.to(tl.int32)
            first = tl.load(lp_row + d * K, mask=on, other=0.0).to(tl.float64)
            s = tl.where(on, s + first, s)
            node = n + 1
            here = (at == node) & on
            tokens = tl.where(here, tl.load(id_row + d * K, mask=on, other=0), tokens)
            parents = tl.where(here, n.to(tl.int64), parents)
            depths = tl.where(here, d + 1, depths)
            n += on.to(tl.int32)
        w = (length > 0) & (length < cap)  # the chain's end takes its first child next
        nxt = tl.load(lp_row + tl.minimum(length, D - 1) * K, mask=w,
                      other=0.0).to(tl.float64)
        score, key = _push(score, key, slots, pushes, w, s + nxt, length + 1, 0, n)
        pushes += w.to(tl.int32)
    else:
        w = (cap > 0) & (budget > 0)
        first = tl.load(lp_row, mask=w, other=0.0).to(tl.float64)
        score, key = _push(score, key, slots, pushes, w, first, 1, 0, 0)
        pushes += w.to(tl.int32)
    popped = n * 0
    while (n < budget) & (popped < pushes):  # room left, and a live entry to pop
        m = tl.max(score, axis=0)
        best = tl.min(tl.where((score == m) & (key != EMPTY), key, EMPTY), axis=0)
        depth = (best & 0xFFFF).to(tl.int32)
        rank = ((best >> 16) & 0xFFFF).to(tl.int32)
        parent = ((best >> 32) & 0xFFFF).to(tl.int32)
        gone = slots == (best >> 48)
        key = tl.where(gone, EMPTY, key)
        score = tl.where(gone, float("-inf"), score)
        popped += 1
        base = lp_row + (depth - 1) * K
        # the next sibling: score - own log-prob + sibling's, in this order (build_tree's)
        w = rank + 1 < K
        own = tl.load(base + rank).to(tl.float64)
        sib = tl.load(base + rank + 1, mask=w, other=0.0).to(tl.float64)
        score, key = _push(score, key, slots, pushes, w, m - own + sib, depth, rank + 1, parent)
        pushes += w.to(tl.int32)
        n += 1
        here = at == n
        tokens = tl.where(here, tl.load(id_row + (depth - 1) * K + rank), tokens)
        parents = tl.where(here, parent.to(tl.int64), parents)
        depths = tl.where(here, depth.to(tl.int64), depths)
        # the first child, while the cap allows
        w = depth < cap
        kid = tl.load(lp_row + tl.minimum(depth, D - 1) * K, mask=w, other=0.0).to(tl.float64)
        score, key = _push(score, key, slots, pushes, w, m + kid, depth + 1, 0, n)
        pushes += w.to(tl.int32)
    out = row * (budget + 1) + at
    keep = at < budget + 1
    tl.store(tok_ptr + out, tokens, mask=keep)
    tl.store(par_ptr + out, parents, mask=keep)
    tl.store(dep_ptr + out, depths, mask=keep)
    tl.store(n_ptr + row, n + 1)


def frontier_size(budget: int, depth: int) -> int:
    """Frontier slots for a budget and D: the push bound D + 2 * budget, as a power of two."""
    return triton.next_power_of_2(max(2, depth + 2 * budget))


def build_trees(logp: torch.Tensor, ids: torch.Tensor, bonus: torch.Tensor, budget: int,
                chain_seed: bool, depth_cap: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depths, n_nodes) as tree.DeviceTrees holds them; budget >= 1, D, K >= 1
    (tree.build_trees answers the empty cases itself)."""
    b, d, k = logp.shape
    f = frontier_size(budget, d)
    if max(d, k, budget + 1) >= FIELD_MAX or f > 1 << 14:
        raise ValueError(f"tree too large for the kernel's keys: D={d}, K={k}, budget={budget}")
    width = budget + 1
    tokens = torch.empty(b, width, dtype=torch.long, device=logp.device)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    n_nodes = torch.empty(b, dtype=torch.int32, device=logp.device)
    _build_trees_kernel[(b,)](logp.float().contiguous(), ids.long().contiguous(), bonus.long().contiguous(),
                              depth_cap.to(torch.int32).contiguous(), tokens, parents, depths, n_nodes,
                              d, k, budget, CHAIN=chain_seed, F=f, NP=triton.next_power_of_2(width),
                              num_warps=1)
    return tokens, parents, depths, n_nodes
