"""Triton gated delta rule over T rows: a sequence (prefill chunk, the accepted path's fold) or a
tree (every node from the committed state along its own ancestors).

One program per (value head, block of value columns) keeps its slice of the state [Dk, BV] in
registers, in float32. A sequence is one pass (state after row t feeds row t+1). A tree is
walked depth-first (TreeIndex.order): a node continues its parent's state when the parent was
the node just visited; after a leaf, the next node is recomputed from the committed state along
its ancestor chain (`anc`, root first, the node last). T steps plus the replays at the leaves,
and no node state ever goes to memory; the steps are the sequence's very steps, so a node's
output and the fold of its path agree exactly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _scan_kernel(Q, K, V, G, B, S_IN, S_OUT, OUT, ANC, DEPTH, ORDER, RESTART,
                 stride_q, stride_k, stride_v, stride_g, stride_o, stride_anc, T,
                 DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 TREE: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    dk = tl.arange(0, BK)
    cols = vb * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    cols_ok = cols < DV
    s_ptr = h * DK * DV + dk[:, None] * DV + cols[None, :]
    s_mask = dk_ok[:, None] & cols_ok[None, :]
    S0 = tl.load(S_IN + s_ptr, mask=s_mask, other=0.0)
    S = S0
    for i in range(T):
        if TREE:  # depth-first: a row continues the state of the row before unless told to restart
            t = tl.load(ORDER + i)
            if tl.load(RESTART + i) != 0:
                S = S0
                for j in range(tl.load(DEPTH + t) - 1):
                    a = tl.load(ANC + t * stride_anc + j)
                    S = _step(S, K, V, G, B, a, h, stride_k, stride_v, stride_g, dk, cols, dk_ok, cols_ok, DK, DV)
        else:
            t = i
        S = _step(S, K, V, G, B, t, h, stride_k, stride_v, stride_g, dk, cols, dk_ok, cols_ok, DK, DV)
        if WRITE_OUT:
            q = tl.load(Q + t * stride_q + h * DK + dk, mask=dk_ok, other=0.0)
            o = tl.sum(S * q[:, None], 0)
            tl.store(OUT + t * stride_o + h * DV + cols, o, mask=cols_ok)
    if WRITE_STATE:
        tl.store(S_OUT + s_ptr, S, mask=s_mask)


@triton.jit
def _step(S, K, V, G, B, row, h, stride_k, stride_v, stride_g, dk, cols, dk_ok, cols_ok,
          DK: tl.constexpr, DV: tl.constexpr):
    k = tl.load(K + row * stride_k + h * DK + dk, mask=dk_ok, other=0.0)
    v = tl.load(V + row * stride_v + h * DV + cols, mask=cols_ok, other=0.0)
    g = tl.load(G + row * stride_g + h)
    b = tl.load(B + row * stride_g + h)
    S = S * tl.exp(g)
    pred = tl.sum(S * k[:, None], 0)
    delta = (v - pred) * b
    return S + k[:, None] * delta[None, :]


def scan(q: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, tree: Optional[Any], state_out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """See kernels.gated_delta.gated_delta_rule. All float32, last dims contiguous: q, k [T, H, Dk],
    v [T, H, Dv], g, beta [T, H] (one row stride), state [H, Dk, Dv]. With `tree` (a TreeIndex)
    the outputs are per node; `state_out` (a sequence only) receives the final state. Returns the
    outputs [T, H, Dv] when q is given."""
    t, heads, dk = k.shape
    dv = v.shape[-1]
    out = torch.empty(t, heads, dv, dtype=torch.float32, device=k.device) if q is not None else None
    bv = min(32, triton.next_power_of_2(dv))
    _scan_kernel[(heads, triton.cdiv(dv, bv))](
        q if q is not None else k, k, v, g, beta, state, state_out if state_out is not None else state,
        out if out is not None else v, *((tree.ancestors, tree.depth, tree.order, tree.restart) if tree else (g,) * 4),
        k.stride(0) if q is None else q.stride(0), k.stride(0), v.stride(0), g.stride(0),
        out.stride(0) if out is not None else 0, tree.ancestors.stride(0) if tree else 0, t,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, TREE=tree is not None, WRITE_OUT=q is not None,
        WRITE_STATE=state_out is not None, num_warps=4)
    return out
