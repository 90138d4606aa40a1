"""Triton gated delta rule over T rows: a sequence (prefill chunk, the accepted path's fold) or a
tree (every node from the committed state along its own ancestors).

One program per (value head, block of value columns) keeps its slice of the state [Dk, BV] in
registers, in float32. A sequence is one pass (state after row t feeds row t+1). A tree is
walked depth-first (TreeIndex.steps): a node continues its parent's state when the parent was
the node just visited; after a leaf, the next node is recomputed from the committed state along
its ancestor chain, root first. Each such restart begins a segment that needs nothing from the
steps before it, so the segments are dealt out to a few programs a state slice (the grid's third
axis), which run side by side: a tree takes about as long as its longest path's steps, not all of
its steps and replays one after another.
No node state ever goes to memory; the steps are the sequence's very steps, so a node's output
and the fold of its path agree exactly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_options, pdl_start


# T, the rows of a sequence, is not specialized on: a fold of an accepted path of 1, 16 or any other
# length, and a prefill chunk of any length, share one compiled kernel (Triton would compile T == 1
# and T % 16 == 0 apart; a new variant mid-request stalls it while it compiles); nor are a tree's
# programs a slice, which follow its rows
@triton.jit(do_not_specialize=["T", "SEGMENT_PROGRAMS"])
def _scan_kernel(Q, K, V, G, B, S_IN, S_OUT, OUT, STEPS, BOUNDS, N_SEGMENTS, ADDRESSES,
                 stride_q, stride_k, stride_v, stride_g, stride_o, stride_steps, stride_bounds,
                 stride_addresses, T, SEGMENT_PROGRAMS,
                 DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 TREE: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr,
                 BATCH: tl.constexpr = False, PDL: tl.constexpr = False):
    """The state slice of value head program_id(0), columns block program_id(1), through its
    steps: a sequence's rows in order, or, of a tree's listed steps (TreeIndex.steps: 4 * row +
    2 * emit + restart), segments program_id(2), program_id(2) + num_programs(2), ... (steps
    BOUNDS[i] to BOUNDS[i + 1] of the N_SEGMENTS). A segment runs from one restart to the next
    and starts from the committed state, so the segments of a tree (its first path, then each
    branch with its replayed ancestors) run side by side. A chain-seeded DDTree has one long
    segment (its chain) and a few short ones, so a few programs a slice (scan()'s
    `segment_programs`) serve it as well as one a tree row, most of which would have no segment.

    With BATCH (trees only), program_id(2) // SEGMENT_PROGRAMS picks one of several sequences'
    trees of T rows each: its committed state and delta-rule inputs at the addresses of its
    ADDRESSES row (gated_delta.ADDRESS_COLUMNS; S_IN, K, V, G, B are then only the first
    sequence's, for their strides), its tables the row of STEPS, BOUNDS and N_SEGMENTS, its rows
    of Q and OUT the batch's rows from T * the sequence on. Its programs are then the ones its
    launch alone would run, so its outputs have the same bits."""
    pdl_start(PDL)
    segment = tl.program_id(2)
    if BATCH:
        seq = segment // SEGMENT_PROGRAMS
        segment = segment - seq * SEGMENT_PROGRAMS
        Q = Q + seq * T * stride_q
        OUT = OUT + seq * T * stride_o
        STEPS = STEPS + seq * stride_steps
        BOUNDS = BOUNDS + seq * stride_bounds
        N_SEGMENTS = N_SEGMENTS + seq
        entry = ADDRESSES + seq * stride_addresses
        # 16-byte aligned (DeltaBatch checks), as a launch alone's tensor arguments are known to be:
        # Triton lays a load's values out by what it knows of the pointer's alignment, and the
        # state's layout decides the order of the sums over Dk
        S_IN = tl.multiple_of(tl.load(entry + 1).to(tl.pointer_type(tl.float32)), 16)
        K = tl.multiple_of(tl.load(entry + 2).to(tl.pointer_type(tl.float32)), 16)
        V = tl.multiple_of(tl.load(entry + 3).to(tl.pointer_type(tl.float32)), 16)
        G = tl.load(entry + 4).to(tl.pointer_type(tl.float32))
        B = tl.load(entry + 5).to(tl.pointer_type(tl.float32))
    h = tl.program_id(0)
    dk = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    cols_ok = cols < DV
    s_ptr = h * DK * DV + dk[:, None] * DV + cols[None, :]
    s_mask = dk_ok[:, None] & cols_ok[None, :]
    if TREE:
        for seg in range(segment, tl.load(N_SEGMENTS), SEGMENT_PROGRAMS):
            lo = tl.load(BOUNDS + seg)
            hi = tl.load(BOUNDS + seg + 1)
            S = tl.load(S_IN + s_ptr, mask=s_mask, other=0.0)
            S = _steps(S, lo, hi, Q, K, V, G, B, OUT, STEPS, h, stride_q, stride_k, stride_v, stride_g, stride_o,
                       dk, cols, dk_ok, cols_ok, DK, DV, TREE, WRITE_OUT)
    else:  # h * 0: tensors, so that the step counters are too (T may arrive as a constant)
        S = tl.load(S_IN + s_ptr, mask=s_mask, other=0.0)
        S = _steps(S, h * 0, T + h * 0, Q, K, V, G, B, OUT, STEPS, h, stride_q, stride_k, stride_v, stride_g,
                   stride_o, dk, cols, dk_ok, cols_ok, DK, DV, TREE, WRITE_OUT)
        if WRITE_STATE:
            tl.store(S_OUT + s_ptr, S, mask=s_mask)


@triton.jit
def _steps(S, lo, hi, Q, K, V, G, B, OUT, STEPS, h, stride_q, stride_k, stride_v, stride_g, stride_o,
           dk, cols, dk_ok, cols_ok, DK: tl.constexpr, DV: tl.constexpr, TREE: tl.constexpr, WRITE_OUT: tl.constexpr):
    """Steps [lo, hi) from the state slice S; returns the state after them. Each iteration issues
    the next step's loads before this step's arithmetic, so that their latency overlaps it: a step
    is a chain of dependent reductions, and without this every step waited for its own loads."""
    code = _code(STEPS, lo, hi, TREE, WRITE_OUT)
    k, v, g, b, q = _row(Q, K, V, G, B, code >> 2, h, stride_q, stride_k, stride_v, stride_g, dk, cols,
                         dk_ok, cols_ok, DK, DV, WRITE_OUT)
    for i in range(lo, hi):
        now, k_now, v_now, g_now, b_now, q_now = code, k, v, g, b, q
        code = _code(STEPS, i + 1, hi, TREE, WRITE_OUT)
        k, v, g, b, q = _row(Q, K, V, G, B, code >> 2, h, stride_q, stride_k, stride_v, stride_g, dk, cols,
                             dk_ok, cols_ok, DK, DV, WRITE_OUT)
        S = S * tl.exp(g_now)
        pred = tl.sum(S * k_now[:, None], 0)
        S = S + k_now[:, None] * ((v_now - pred) * b_now)[None, :]
        if WRITE_OUT:
            if (now & 2) != 0:
                o = tl.sum(S * q_now[:, None], 0)
                tl.store(OUT + (now >> 2) * stride_o + h * DV + cols, o, mask=cols_ok)
    return S


@triton.jit
def _code(STEPS, i, n, TREE: tl.constexpr, EMIT: tl.constexpr):
    """Step i's code, 4 * row + 2 * emit + restart (row 0, emitting nothing, past the last)."""
    if TREE:
        code = tl.load(STEPS + i, mask=i < n, other=0)
    elif EMIT:
        code = tl.where(i < n, 4 * i + 2, 0)
    else:
        code = tl.where(i < n, 4 * i, 0)
    return code


@triton.jit
def _row(Q, K, V, G, B, row, h, stride_q, stride_k, stride_v, stride_g, dk, cols, dk_ok, cols_ok,
         DK: tl.constexpr, DV: tl.constexpr, WITH_Q: tl.constexpr):
    """One row's inputs for value head h: k, v (this program's columns), g, beta, and q."""
    k = tl.load(K + row * stride_k + h * DK + dk, mask=dk_ok, other=0.0)
    v = tl.load(V + row * stride_v + h * DV + cols, mask=cols_ok, other=0.0)
    g = tl.load(G + row * stride_g + h)
    b = tl.load(B + row * stride_g + h)
    if WITH_Q:
        q = tl.load(Q + row * stride_q + h * DK + dk, mask=dk_ok, other=0.0)
    else:
        q = tl.zeros_like(k)
    return k, v, g, b, q


def scan(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, tree: Optional[Any], state_out: Optional[torch.Tensor], block_v: int = 16,
         num_warps: int = 1, segment_programs: int = 8, addresses: Optional[torch.Tensor] = None
         ) -> Optional[torch.Tensor]:
    """See kernels.gated_delta.gated_delta_rule. All float32, last dims contiguous: q, k [T, H, Dk],
    v [T, H, Dv], g, beta [T, H] (one row stride), state [H, Dk, Dv]. With `tree` (a TreeIndex)
    the outputs are per node; `state_out` (a sequence only) receives the final state. Returns the
    outputs [T, H, Dv] when q is given. `block_v` value columns a program, on `num_warps` warps,
    and a tree's segments dealt to `segment_programs` programs a slice (at most one a row): the
    benchmark's knobs (`python benchmarks/gated_delta_tree.py` sweeps them). The defaults are
    the fastest for a 23-node tree, one warp keeping each reduction over Dk inside the warp
    (faster than 32 columns on 4 warps), and still are with a tree's segments side by side. For
    the programs a slice the engine decides: in a 27B's verify, 8 or 16 a slice scan faster
    than one a tree row (`flashtree bench`'s verify kernel profile), while timed alone they
    order differently from run to run.

    With `addresses` [S, columns] (int64, a sequence a row: gated_delta.DeltaBatch) the scan is
    S trees' at once: q [S * R, H, Dk] their rows, `tree` their stacked IndexTables, and k, v,
    g, beta, state the first sequence's (the others' at their addresses, with these strides);
    the outputs are [S * R, H, Dv]."""
    heads, dk = k.shape[1:]
    dv = v.shape[-1]
    t = q.shape[0] if q is not None else k.shape[0]
    sequences = 1 if addresses is None else addresses.shape[0]
    each = t // sequences
    out = torch.empty(t, heads, dv, dtype=torch.float32, device=k.device) if q is not None else None
    bv = min(block_v, triton.next_power_of_2(dv))
    segments = min(each, segment_programs) if tree is not None else 1  # a tree has a segment a row at most
    tables = (tree.steps, tree.bounds, tree.n_segments) if tree is not None else (g,) * 3
    _scan_kernel[(heads, triton.cdiv(dv, bv), segments * sequences)](
        q if q is not None else k, k, v, g, beta, state, state_out if state_out is not None else state,
        out if out is not None else v, *tables, addresses if addresses is not None else g,
        k.stride(0) if q is None else q.stride(0), k.stride(0), v.stride(0), g.stride(0),
        out.stride(0) if out is not None else 0, tables[0].stride(0) if addresses is not None else 0,
        tables[1].stride(0) if addresses is not None else 0,
        addresses.stride(0) if addresses is not None else 0, each, segments,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, TREE=tree is not None,
        WRITE_OUT=q is not None,
        WRITE_STATE=state_out is not None, BATCH=addresses is not None, num_warps=num_warps,
        **launch_options(k.device))
    return out
