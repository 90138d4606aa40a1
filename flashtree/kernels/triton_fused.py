"""Triton versions of the small per-layer ops, fused so a decoder layer is ~10 launches, not ~60.

Each kernel reproduces the rounding steps of the models' eager code (float32 math, a cast to
the activation dtype wherever eager PyTorch materialises a bf16 tensor), so it differs from the
eager result only by reduction order and the hardware's rsqrt/exp.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, SUM, stride_x, stride_r, stride_o, stride_s, n, eps, offset,
                     HAS_RES: tl.constexpr, CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(SUM.dtype.element_ty)
        tl.store(SUM + row * stride_s + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if CENTERED:  # scale (offset + w), multiplied in float32 before the cast (Qwen3.5)
        tl.store(OUT + row * stride_o + cols, (x * inv * (offset + w)).to(OUT.dtype.element_ty), mask=ok)
    else:  # cast, then scale by w (transformers' LLaMA/Qwen3 order)
        y = (x * inv).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (w * y).to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor], offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](x, res, weight, out, total, x.stride(0), res.stride(0),
                              out.stride(0), total.stride(0), n, eps, offset,
                              HAS_RES=residual is not None, CENTERED=offset != 0.0, BLOCK=block,
                              num_warps=max(1, min(16, block // 256)))
    return out, total


@triton.jit
def _rope_half(a, b, c, s, DT: tl.constexpr):
    """First half of rotate-half RoPE, rounded like eager `x * cos + rotate_half(x) * sin`."""
    c = c.to(DT).to(tl.float32)
    s = s.to(DT).to(tl.float32)
    return ((a * c).to(DT).to(tl.float32) + (b * s).to(DT).to(tl.float32)).to(DT)


@triton.jit
def _qkv_kernel(QKV, POS, COS, SIN, QW, KW, QOUT, KC, VC, LEN,
                stride_in, stride_qo, stride_kc, stride_vc, stride_rope, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, half)
    src = QKV + t * stride_in + h * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + half + i).to(tl.float32)
    DT = KC.dtype.element_ty
    row = tl.load(LEN).to(tl.int64) + t
    if h >= HQ + HKV:  # a value head: stored as it is
        dst = VC + row * stride_vc + (h - HQ - HKV) * D
        tl.store(dst + i, x1.to(DT))
        tl.store(dst + half + i, x2.to(DT))
    else:
        if HAS_NORM:
            if h < HQ:
                w1 = tl.load(QW + i).to(tl.float32)
                w2 = tl.load(QW + half + i).to(tl.float32)
            else:
                w1 = tl.load(KW + i).to(tl.float32)
                w2 = tl.load(KW + half + i).to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
            x1 = (w1 * (x1 * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        pos = tl.load(POS + t).to(tl.int64)
        c1 = tl.load(COS + pos * stride_rope + i)
        c2 = tl.load(COS + pos * stride_rope + half + i)
        s1 = tl.load(SIN + pos * stride_rope + i)
        s2 = tl.load(SIN + pos * stride_rope + half + i)
        o1 = _rope_half(x1, -x2, c1, s1, DT)
        o2 = _rope_half(x2, x1, c2, s2, DT)
        if h < HQ:
            dst = QOUT + t * stride_qo + h * D
        else:
            dst = KC + row * stride_kc + (h - HQ) * D
        tl.store(dst + i, o1)
        tl.store(dst + half + i, o2)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor,
                   heads: int, kv_heads: int) -> Optional[torch.Tensor]:
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    q_out = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device) if heads else None
    norm_w = q_norm if q_norm is not None else k_cache
    _qkv_kernel[(t, heads + 2 * kv_heads)](
        qkv, positions, cos, sin, norm_w, k_norm if k_norm is not None else norm_w,
        q_out if q_out is not None else qkv, k_cache, v_cache, length,
        qkv.stride(0), q_out.stride(0) if q_out is not None else 0, k_cache.stride(0),
        v_cache.stride(0), cos.stride(0), eps,
        HQ=heads, HKV=kv_heads, D=dim, HAS_NORM=k_norm is not None, num_warps=1)
    return q_out


@triton.jit
def _gated_qkv_kernel(QKV, COS, SIN, QW, KW, QOUT, GATE, KC, VC, LEN,
                      stride_in, stride_qo, stride_g, stride_kc, stride_vc, stride_rope, eps,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
    """One program per (row, head) of Qwen3.5's gated attention: query heads (with their gate),
    then key heads, then value heads. The zero-centered norm over the whole head, then RoPE on
    its first ROT dims: lane d < ROT pairs with d +- ROT/2 (rotate-half), loaded a second time."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    DT = KC.dtype.element_ty
    row = tl.load(LEN).to(tl.int64) + t
    if h >= HQ + HKV:  # a value head: stored as it is
        x = tl.load(QKV + t * stride_in + 2 * HQ * D + (h - HQ) * D + d)
        tl.store(VC + row * stride_vc + (h - HQ - HKV) * D + d, x.to(DT))
    else:
        if h < HQ:
            src = QKV + t * stride_in + h * 2 * D
            w_ptr = QW
        else:
            src = QKV + t * stride_in + 2 * HQ * D + (h - HQ) * D
            w_ptr = KW
        half: tl.constexpr = ROT // 2
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        x = tl.load(src + d).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        n = (x * inv * (1.0 + tl.load(w_ptr + d).to(tl.float32))).to(DT).to(tl.float32)
        npart = (xp * inv * (1.0 + tl.load(w_ptr + partner).to(tl.float32))).to(DT).to(tl.float32)
        rot = d < ROT
        rd = tl.where(rot, d, 0)
        c = tl.load(COS + t * stride_rope + rd, mask=rot, other=1.0)
        s = tl.load(SIN + t * stride_rope + rd, mask=rot, other=0.0)
        o = tl.where(rot, _rope_half(n, tl.where(d < half, -npart, npart), c, s, DT), n.to(DT))
        if h < HQ:
            tl.store(QOUT + t * stride_qo + h * D + d, o)
            gate = tl.load(src + D + d).to(tl.float32)
            tl.store(GATE + t * stride_g + h * D + d, (1.0 / (1.0 + tl.exp(-gate))).to(DT))
        else:
            tl.store(KC + row * stride_kc + (h - HQ) * D + d, o)


def gated_qkv_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    length: torch.Tensor, heads: int, kv_heads: int, rotary_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    q_out = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device)
    gate = torch.empty(t, heads * dim, dtype=qkv.dtype, device=qkv.device)
    _gated_qkv_kernel[(t, heads + 2 * kv_heads)](
        qkv, cos, sin, q_norm, k_norm, q_out, gate, k_cache, v_cache, length,
        qkv.stride(0), q_out.stride(0), gate.stride(0), k_cache.stride(0), v_cache.stride(0), cos.stride(0), eps,
        HQ=heads, HKV=kv_heads, D=dim, ROT=rotary_dim, num_warps=2)
    return q_out, gate


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_in, stride_out, n, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(GU + t * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_in + n + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + t * stride_out + cols, (act * u).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                 BLOCK=block, num_warps=4)
    return out
