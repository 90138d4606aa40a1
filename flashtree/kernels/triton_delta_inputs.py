"""Triton prologue and epilogue of a Gated DeltaNet layer, around the scan (triton_gated_delta):
what were ~40 small PyTorch ops per layer and step (conv, SiLU, L2 norms, softplus, casts, the
gated output norm) in two launches, since at batch 1 each of those ops costs a launch and a few
microseconds while moving only kilobytes.

`delta_inputs`: one program per (row, head slot): the Hk query heads, the Hk key heads, then the
Hv value heads. A program convolves its head's channels over the K inputs the row sees (the
committed window then the new rows; along the ancestors for a tree), applies SiLU and, for q/k,
the L2 norm; q and k are written once per value head that shares them. Value-head programs
also make the row's g and beta. The rows' windows after the step go where the caller says (the
pending window of a sequence, each node's window of a tree), so no copy follows.

`gated_rms_norm`: one program per (row, value head): the scan's float32 output cast to the
activation dtype, RMSNorm with the weight, times silu(z).

Both round where the eager definitions (reference.py) materialise a tensor in the activation
dtype, so they differ from it only by reduction order and the hardware's exp/sqrt.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_options, pdl_start


@triton.jit
def _delta_inputs_kernel(P, WIN, W, ALOG, DTB, ROWS, Q, K, V, G, BETA, NEWWIN, ADDRESSES,
                         stride_p, stride_win, stride_q, stride_k, stride_v, stride_g, stride_beta,
                         stride_nt, stride_nw, stride_addresses, T, q_scale,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         KW: tl.constexpr, BD: tl.constexpr, TREE: tl.constexpr, BATCH: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """Row program_id(0)'s head slot program_id(1). With BATCH (trees only), the rows are several
    sequences' trees of T rows each: row program_id(0) is row t of tree program_id(0) // T, whose
    window and delta-rule buffers are at the addresses of its ADDRESSES row (the columns of
    gated_delta.ADDRESS_COLUMNS; WIN, K, V, G, BETA and NEWWIN are then only the first
    sequence's, for their types), and ROWS holds a [T, KW] table a tree."""
    pdl_start(PDL)
    t = tl.program_id(0)
    slot = tl.program_id(1)
    if BATCH:  # from here on, the program is the one its tree's launch alone would run
        seq = t // T
        t = t - seq * T
        P = P + seq * T * stride_p
        Q = Q + seq * T * stride_q
        ROWS = ROWS + seq * T * KW
        entry = ADDRESSES + seq * stride_addresses  # aligned as in triton_gated_delta's scan
        WIN = tl.multiple_of(tl.load(entry + 0).to(tl.pointer_type(WIN.dtype.element_ty)), 16)
        K = tl.multiple_of(tl.load(entry + 2).to(tl.pointer_type(tl.float32)), 16)
        V = tl.multiple_of(tl.load(entry + 3).to(tl.pointer_type(tl.float32)), 16)
        G = tl.load(entry + 4).to(tl.pointer_type(tl.float32))
        BETA = tl.load(entry + 5).to(tl.pointer_type(tl.float32))
        NEWWIN = tl.multiple_of(tl.load(entry + 6).to(tl.pointer_type(NEWWIN.dtype.element_ty)), 16)
    keys: tl.constexpr = HK * DK
    channels: tl.constexpr = 2 * HK * DK + HV * DV
    is_v = slot >= 2 * HK
    width = tl.where(is_v, DV, DK)
    c0 = tl.where(is_v, 2 * keys + (slot - 2 * HK) * DV, slot * DK)
    d = tl.arange(0, BD)
    ok = d < width
    c = c0 + d
    DT = NEWWIN.dtype.element_ty
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(KW):
        if TREE:
            r = tl.load(ROWS + t * KW + j).to(tl.int32)
        else:
            r = t + j
        r = r + tl.zeros([BD], dtype=tl.int32)  # a vector, so the masks below are per lane
        rw = tl.minimum(r, KW - 2)
        rx = tl.maximum(r - (KW - 1), 0)
        xw = tl.load(WIN + rw * stride_win + c, mask=ok & (r < KW - 1), other=0.0)
        xx = tl.load(P + rx * stride_p + c, mask=ok & (r >= KW - 1), other=0.0)
        x = (xw.to(tl.float32) + xx.to(tl.float32)).to(DT)
        w = tl.load(W + c * KW + j, mask=ok, other=0.0)
        acc += (x.to(tl.float32) * w.to(tl.float32)).to(DT).to(tl.float32)
        if j > 0:  # the row's window after it: every node's for a tree, the last row's for a sequence
            if TREE:
                tl.store(NEWWIN + t * stride_nt + (j - 1) * stride_nw + c, x, mask=ok)
            else:
                tl.store(NEWWIN + (j - 1) * stride_nw + c, x, mask=ok & (r * 0 + t == T - 1))
    mixed = acc.to(DT).to(tl.float32)
    s = (mixed / (1.0 + tl.exp(-mixed))).to(DT).to(tl.float32)
    s = tl.where(ok, s, 0.0)
    repeat: tl.constexpr = HV // HK
    if slot < 2 * HK:
        inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) + 1e-6)
        if slot < HK:
            y = s * inv / q_scale
            for i in range(repeat):
                tl.store(Q + t * stride_q + (slot * repeat + i) * DK + d, y, mask=ok)
        else:
            y = s * inv
            for i in range(repeat):
                tl.store(K + t * stride_k + ((slot - HK) * repeat + i) * DK + d, y, mask=ok)
    else:
        h = slot - 2 * HK
        tl.store(V + t * stride_v + h * DV + d, s, mask=ok)
        b = tl.load(P + t * stride_p + channels + HV * DV + h).to(tl.float32)
        a = tl.load(P + t * stride_p + channels + HV * DV + HV + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(P.dtype.element_ty).to(tl.float32)
        dt = a + tl.load(DTB + h).to(tl.float32)
        softplus = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
        g = -tl.exp(tl.load(ALOG + h).to(tl.float32)) * softplus
        tl.store(G + t * stride_g + h, g)
        tl.store(BETA + t * stride_beta + h, beta)


def delta_inputs(proj: torch.Tensor, window: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, key_heads: int, key_dim: int, value_dim: int,
                 rows: Optional[torch.Tensor], k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, windows: torch.Tensor, addresses: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """See kernels.gated_delta.delta_inputs: writes k, v, g, beta, windows (their last dim
    contiguous, any row stride); returns q [T, Hv, Dk] float32. With `addresses` [S, columns]
    (int64, a sequence a row) the rows are S trees' of T / S rows each, `rows` their conv tables
    [S, T / S, K] and the buffers each sequence's at its addresses (window ... windows: the
    first sequence's, whose strides all share)."""
    t = proj.shape[0]
    heads = a_log.shape[0]
    kw = conv_weight.shape[1]
    q = torch.empty(t, heads, key_dim, dtype=torch.float32, device=proj.device)
    tree = rows is not None
    each = t if addresses is None else t // addresses.shape[0]
    _delta_inputs_kernel[(t, 2 * key_heads + heads)](
        proj, window, conv_weight, a_log, dt_bias, rows if tree else proj, q, k, v, g, beta, windows,
        addresses if addresses is not None else proj,
        proj.stride(0), window.stride(0), q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        windows.stride(0) if tree else 0, windows.stride(-2),
        addresses.stride(0) if addresses is not None else 0, each, key_dim ** 0.5,
        HK=key_heads, HV=heads, DK=key_dim, DV=value_dim, KW=kw,
        BD=triton.next_power_of_2(max(key_dim, value_dim)), TREE=tree, BATCH=addresses is not None,
        num_warps=1, **launch_options(proj.device))
    return q


@triton.jit
def _gated_norm_kernel(X, Z, W, OUT, stride_x, stride_z, stride_o, eps,
                       HV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    ok = d < D
    DT = OUT.dtype.element_ty
    x = tl.load(X + t * stride_x + h * D + d, mask=ok, other=0.0).to(DT).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    normed = (w * (x * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    z = tl.load(Z + t * stride_z + h * D + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_o + h * D + d, (normed * (z / (1.0 + tl.exp(-z)))).to(DT), mask=ok)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """See kernels.gated_delta.gated_output: x [T, H, D] float32 (unit stride within a row),
    z [T, H*D] -> [T, H*D] in `dtype`."""
    t, heads, dim = x.shape
    out = torch.empty(t, heads * dim, dtype=dtype, device=x.device)
    _gated_norm_kernel[(t, heads)](x, z, weight, out, x.stride(0), z.stride(0), out.stride(0), eps,
                                   HV=heads, D=dim, BD=triton.next_power_of_2(dim), num_warps=1,
                                   **launch_options(x.device))
    return out
