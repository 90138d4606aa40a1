"""Triton kernels for group-wise quantized linears (kernels/reference.py `quant_linear` is what
they compute): a GEMV for one row (the AR step) and a small-M GEMM on tensor cores (a verified
tree, M up to budget + 1).

Both read the packed codes once and dequantize in registers, never materialising a dense weight.
Over one group the scale and minimum are constants, so x . w = scale * (x . codes) + minimum *
sum(x): one multiply-add per group instead of one per weight. A code (a 4-bit half of one, for
the GEMM's 16-bit tl.dot) becomes a float by integer ops alone, its bits placed under the
exponent of 1.0 (v = 1 + c / 2**bits, exact), and x . c = 2**bits * (x . v - sum(x)): the
int-to-float conversion it replaces runs at a quarter of the integer rate and would bound the
int4 GEMV at about half the memory bandwidth on an H100/H200. Int4 codes hold the even index in
the low nibble, so the kernels dot the low nibbles with x's even entries and the high ones with
its odd entries instead of interleaving them.

The launchers allocate only the output and read no device value on the host, so a forward that
calls them can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


MAGIC_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def one_plus_sixteenth(c, KIND: tl.constexpr):
    """1 + c/16 for integer codes 0 <= c < 16, exactly, in float32 (KIND 0), bfloat16 (1) or
    float16 (2): c becomes the top four mantissa bits of 1.0."""
    c = c.to(tl.int32)
    if KIND == 0:
        return ((c << 19) | 0x3F800000).to(tl.float32, bitcast=True)
    elif KIND == 1:
        return ((c << 3) | 0x3F80).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return ((c << 6) | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _gemv_kernel(X, C, S, MN, B, OUT, N, K, stride_c, stride_s,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """OUT[n] = sum_k X[k] W[n, k] for BLOCK_N rows n, GROUPS groups of K per iteration. Codes
    enter the float32 products as v = 1 + c / 2**BITS (their bits placed under 1.0's exponent),
    so a group's x . c is 2**BITS * (x . v - sum(x))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    n_groups = K // GROUP
    gi = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g0 in range(0, n_groups, GROUPS):
        g_ok = (g0 + gi) < n_groups
        sm_off = rows[:, None] * stride_s + g0 + gi[None, :]
        sm_ok = row_ok[:, None] & g_ok[None, :]
        s = tl.load(S + sm_off, mask=sm_ok, other=0.0).to(tl.float32) * (1 << BITS)
        m = tl.load(MN + sm_off, mask=sm_ok, other=0.0).to(tl.float32)
        if BITS == 8:
            kk = (g0 + gi)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]   # [GROUPS, GROUP]
            x = tl.load(X + kk, mask=g_ok[:, None], other=0.0).to(tl.float32)
            b = tl.load(C + rows[:, None, None] * stride_c + kk[None, :, :],
                        mask=row_ok[:, None, None] & g_ok[None, :, None], other=0).to(tl.int32)
            v = ((b << 15) | 0x3F800000).to(tl.float32, bitcast=True)
            dots = tl.sum(v * x[None, :, :], axis=2)                          # [BLOCK_N, GROUPS]
            xs = tl.sum(x, axis=1)
        else:
            HALF: tl.constexpr = GROUP // 2
            kk = (g0 + gi)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            x = tl.load(X + kk, mask=g_ok[:, None], other=0.0).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, [GROUPS, HALF, 2]))              # one contiguous load
            jj = (g0 + gi)[:, None] * HALF + tl.arange(0, HALF)[None, :]      # byte index
            b = tl.load(C + rows[:, None, None] * stride_c + jj[None, :, :],
                        mask=row_ok[:, None, None] & g_ok[None, :, None], other=0).to(tl.int32)
            lo = (((b << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            hi = (((b << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            dots = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
            xs = tl.sum(xe + xo, axis=1)
        acc += tl.sum(s * (dots - xs[None, :]) + m * xs[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(OUT + rows, acc.to(OUT.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm_kernel(X, C, S, MN, B, OUT, M, N, K, stride_xm, stride_om, stride_c, stride_s,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KIND: tl.constexpr, HAS_BIAS: tl.constexpr):
    """OUT[m, n] for a BLOCK_M x BLOCK_N tile, one group of K per iteration on tensor cores.
    Each 4-bit half of a code enters tl.dot as 1 + h/16 in x's dtype (one_plus_sixteenth), so
    x . h = 16 * (the dot - sum(x)); an 8-bit code is its two nibbles, c = 16 * hi + lo."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):
        s = tl.load(S + rn * stride_s + g, mask=n_ok, other=0.0).to(tl.float32) * 16.0
        m = tl.load(MN + rn * stride_s + g, mask=n_ok, other=0.0).to(tl.float32)
        if BITS == 8:
            kk = g * GROUP + tl.arange(0, GROUP)
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
            b = tl.load(C + rn[None, :] * stride_c + kk[:, None], mask=n_ok[None, :], other=0)
            xs = tl.sum(x.to(tl.float32), axis=1)[:, None]
            hi = tl.dot(x, one_plus_sixteenth(b >> 4, KIND)) - xs
            lo = tl.dot(x, one_plus_sixteenth(b & 15, KIND)) - xs
            acc += (16.0 * hi + lo) * s[None, :] + xs * m[None, :]
        else:
            HALF: tl.constexpr = GROUP // 2
            kk = g * GROUP + tl.arange(0, GROUP)
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0)
            xe, xo = tl.split(tl.reshape(x, [BLOCK_M, HALF, 2]))
            jj = g * HALF + tl.arange(0, HALF)
            b = tl.load(C + rn[None, :] * stride_c + jj[:, None], mask=n_ok[None, :], other=0)
            xs = (tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1))[:, None]
            dots = (tl.dot(xe, one_plus_sixteenth(b & 15, KIND))
                    + tl.dot(xo, one_plus_sixteenth(b >> 4, KIND)))
            acc += (dots - xs) * s[None, :] + xs * m[None, :]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None] * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: int = 4, k_tile: Optional[int] = None,
         num_warps: int = 4) -> torch.Tensor:
    """x [1, K] (contiguous) -> [1, N]. `block_n` output rows per program and `k_tile` inputs
    per iteration (default: 4 KiB of codes a program, e.g. 2048 int4) are the benchmark's knobs
    (benchmarks/quant_gemv.py). A GEMV is bound by the bytes in flight: many small programs
    streaming long rows keep more loads outstanding per SM than a few wide ones."""
    n, k = scale.shape[0], x.shape[-1]
    k_tile = k_tile or 4096 * 8 // (bits * block_n)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, codes, scale, minimum, bias if bias is not None else scale, out, n, k,
        codes.stride(0), scale.stride(0), BITS=bits, GROUP=group, GROUPS=max(1, k_tile // group),
        BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=num_warps)
    return out


def gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: int = 32,
         num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> [M, N] with M rows in tiles of 16 or 32 (tl.dot's
    smallest); int4 needs group >= 32 (a half group is tl.dot's K, at least 16)."""
    rows, n, k = x.shape[0], scale.shape[0], x.shape[-1]
    block_m = 16 if rows <= 16 else 32
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_m))
    _gemm_kernel[grid](
        x, codes, scale, minimum, bias if bias is not None else scale, out, rows, n, k,
        x.stride(0), out.stride(0), codes.stride(0), scale.stride(0), BITS=bits, GROUP=group,
        BLOCK_M=block_m, BLOCK_N=block_n, KIND=MAGIC_KINDS[x.dtype], HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages)
    return out
