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

from .kv_storage import Q4, KVSide, paged_side_args, sequence_rows
from .triton_kv_read import PAGE_ROWS
from .triton_pdl import launch_options, pdl_start


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, SUM, stride_x, stride_r, stride_o, stride_s, n, eps, offset,
                     HAS_RES: tl.constexpr, CENTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
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
                              num_warps=max(1, min(16, block // 256)), **launch_options(x.device))
    return out, total


@triton.jit
def _rope_half(a, b, c, s, DT: tl.constexpr):
    """First half of rotate-half RoPE, rounded like eager `x * cos + rotate_half(x) * sin`."""
    c = c.to(DT).to(tl.float32)
    s = s.to(DT).to(tl.float32)
    return ((a * c).to(DT).to(tl.float32) + (b * s).to(DT).to(tl.float32)).to(DT)


@triton.jit
def _store_half(codes, scales, x, OFF: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr):
    """Dims [OFF, OFF + HALF) of one head's row, x [HALF], into its codes (and block scales) as
    KIND stores them (kv_storage.side_args), with kv_storage.quantize_kv's arithmetic."""
    i = tl.arange(0, HALF)
    if KIND == 0:
        tl.store(codes + OFF + i, x.to(codes.dtype.element_ty))
    elif KIND == 1:
        fp8 = tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(codes + OFF + i, fp8.to(tl.uint8, bitcast=True))
    else:
        NB: tl.constexpr = HALF // 32
        b = tl.reshape(x.to(tl.float32), (NB, 32))
        if KIND == 2:
            sc = tl.math.div_rn(tl.max(tl.abs(b), 1), tl.full((NB,), 127.0, tl.float32)).to(scales.dtype.element_ty)
        else:  # the block's value of largest magnitude, sign kept, maps onto code 0
            hi = tl.max(b, 1)
            lo = tl.min(b, 1)
            sc = tl.math.div_rn(tl.where(-lo > hi, lo, hi), tl.full((NB,), -8.0, tl.float32))
            sc = sc.to(scales.dtype.element_ty)
        sf = sc.to(tl.float32)
        # x / scale correctly rounded, then the add: nothing the compiler may fuse into an FMA
        q = tl.math.div_rn(b, tl.broadcast_to(tl.where(sf != 0, sf, 1.0)[:, None], (NB, 32)))
        tl.store(scales + OFF // 32 + tl.arange(0, NB), sc)
        if KIND == 2:
            code = tl.clamp(tl.floor(q + 0.5), -127.0, 127.0).to(tl.int8)
            tl.store(codes + OFF + tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :], code)
        else:
            code = tl.clamp(tl.floor(q + 8.5), 0.0, 15.0).to(tl.int32)
            even, odd = tl.split(tl.reshape(code, (HALF // 2, 2)))
            tl.store(codes + OFF // 2 + tl.arange(0, HALF // 2), (even | (odd << 4)).to(tl.uint8))


@triton.jit
def _cache_row(LEN, PAGES, t, rows_each, stride_ps, PAGED: tl.constexpr):
    """The cache row new row t is stored at: its sequence's logical row length + its index among
    that sequence's rows, through the sequence's page table when PAGED (kernels/kv_storage.py:
    Paged). Sequence s (of a launch over several) owns rows [s rows_each, (s + 1) rows_each),
    LEN[s] and the table at PAGES + s stride_ps."""
    seq = t // rows_each
    row = tl.load(LEN + seq).to(tl.int64) + (t - seq * rows_each)
    if PAGED:
        row = tl.load(PAGES + seq * stride_ps + row // PAGE_ROWS).to(tl.int64) * PAGE_ROWS + row % PAGE_ROWS
    return row


@triton.jit(do_not_specialize=["rows_each", "stride_ps"])
def _qkv_kernel(QKV, POS, COS, SIN, QW, KW, QOUT, KC, VC, KS, VS, LEN, PAGES,
                stride_in, stride_qo, stride_kc, stride_vc, stride_ks, stride_vs, stride_rope, eps,
                rows_each, stride_ps,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_PACK: tl.constexpr, V_PACK: tl.constexpr,
                PAGED: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, half)
    src = QKV + t * stride_in + h * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + half + i).to(tl.float32)
    DT = QKV.dtype.element_ty
    row = _cache_row(LEN, PAGES, t, rows_each, stride_ps, PAGED)
    if h >= HQ + HKV:  # a value head: stored as it is (or quantized)
        hv = h - HQ - HKV
        v_codes = VC + row * stride_vc + hv * (D // V_PACK)
        v_scales = VS + row * stride_vs + hv * (D // 32)
        _store_half(v_codes, v_scales, x1, 0, half, V_KIND)
        _store_half(v_codes, v_scales, x2, half, half, V_KIND)
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
            tl.store(dst + i, o1)
            tl.store(dst + half + i, o2)
        else:
            k_codes = KC + row * stride_kc + (h - HQ) * (D // K_PACK)
            k_scales = KS + row * stride_ks + (h - HQ) * (D // 32)
            _store_half(k_codes, k_scales, o1, 0, half, K_KIND)
            _store_half(k_codes, k_scales, o2, half, half, K_KIND)


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], eps: float,
                   k_cache: KVSide, v_cache: KVSide, length: torch.Tensor,
                   heads: int, kv_heads: int, dim: int) -> Optional[torch.Tensor]:
    t = qkv.shape[0]
    (kc, ks, k_kind), (vc, vs, v_kind), pages = paged_side_args(k_cache, v_cache)
    rows_each, stride_ps = sequence_rows(t, length.numel(), k_cache)
    q_out = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device) if heads else None
    norm_w = q_norm if q_norm is not None else qkv
    _qkv_kernel[(t, heads + 2 * kv_heads)](
        qkv, positions, cos, sin, norm_w, k_norm if k_norm is not None else norm_w,
        q_out if q_out is not None else qkv, kc, vc, ks, vs, length, pages if pages is not None else length,
        qkv.stride(0), q_out.stride(0) if q_out is not None else 0, kc.stride(0), vc.stride(0),
        ks.stride(0), vs.stride(0), cos.stride(0), eps, rows_each, stride_ps,
        HQ=heads, HKV=kv_heads, D=dim, HAS_NORM=k_norm is not None, K_KIND=k_kind, V_KIND=v_kind,
        K_PACK=2 if k_kind == Q4 else 1, V_PACK=2 if v_kind == Q4 else 1, PAGED=pages is not None, num_warps=1,
        **launch_options(qkv.device))
    return q_out


@triton.jit(do_not_specialize=["rows_each", "stride_ps"])
def _gated_qkv_kernel(QKV, COS, SIN, QW, KW, QOUT, GATE, KC, VC, KS, VS, LEN, PAGES,
                      stride_in, stride_qo, stride_g, stride_kc, stride_vc, stride_ks, stride_vs, stride_rope,
                      eps, rows_each, stride_ps,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                      K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_PACK: tl.constexpr, V_PACK: tl.constexpr,
                      PAGED: tl.constexpr = False, PDL: tl.constexpr = False):
    """One program per (row, head) of Qwen3.5's gated attention: query heads (with their gate),
    then key heads, then value heads. The zero-centered norm over the whole head, then RoPE on
    its first ROT dims: lane d < ROT pairs with d +- ROT/2 (rotate-half), loaded a second time.
    Keys and values are stored as their cache side stores them (K_KIND, V_KIND: side_args;
    a block type quantized over the whole head by _store_half)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    DT = QOUT.dtype.element_ty
    row = _cache_row(LEN, PAGES, t, rows_each, stride_ps, PAGED)
    if h >= HQ + HKV:  # a value head: stored as it is (or quantized)
        hv = h - HQ - HKV
        xv = tl.load(QKV + t * stride_in + 2 * HQ * D + (h - HQ) * D + d)
        _store_half(VC + row * stride_vc + hv * (D // V_PACK), VS + row * stride_vs + hv * (D // 32), xv, 0, D,
                    V_KIND)
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
            hk = h - HQ
            _store_half(KC + row * stride_kc + hk * (D // K_PACK), KS + row * stride_ks + hk * (D // 32), o, 0, D,
                        K_KIND)


def gated_qkv_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, k_cache: KVSide, v_cache: KVSide,
                    length: torch.Tensor, heads: int, kv_heads: int, rotary_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    dim = q_norm.shape[0]
    (kc, ks, k_kind), (vc, vs, v_kind), pages = paged_side_args(k_cache, v_cache)
    rows_each, stride_ps = sequence_rows(t, length.numel(), k_cache)
    q_out = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device)
    gate = torch.empty(t, heads * dim, dtype=qkv.dtype, device=qkv.device)
    _gated_qkv_kernel[(t, heads + 2 * kv_heads)](
        qkv, cos, sin, q_norm, k_norm, q_out, gate, kc, vc, ks, vs, length, pages if pages is not None else length,
        qkv.stride(0), q_out.stride(0), gate.stride(0), kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0),
        cos.stride(0), eps, rows_each, stride_ps,
        HQ=heads, HKV=kv_heads, D=dim, ROT=rotary_dim, K_KIND=k_kind, V_KIND=v_kind,
        K_PACK=2 if k_kind == Q4 else 1, V_PACK=2 if v_kind == Q4 else 1, PAGED=pages is not None, num_warps=2,
        **launch_options(qkv.device))
    return q_out, gate


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_in, stride_out, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
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
                                                 BLOCK=block, num_warps=4, **launch_options(out.device))
    return out
