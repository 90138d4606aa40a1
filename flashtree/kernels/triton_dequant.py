"""Prefill through a quantized linear: dequantize a slice of output rows into the activations'
dtype with one Triton kernel, then the dense matmul on it (cuBLAS), slice by slice.

A prefill chunk has hundreds of rows, so the matmul's tensor cores are worth one dense copy of
the weight; what the copy costs is memory traffic. The definition (reference.quant_linear) makes
it with half a dozen elementwise torch ops through float32 temporaries, about 40 bytes moved a
weight; this kernel reads the packed codes, scales and minima and writes the weight once, about
2.6 bytes a weight for int4 into bf16. Its arithmetic is the definition's, code * scale +
minimum (or for the table layout table[code] * scale, IQ4_XS's scale the product of its two
levels) in float32, then the cast."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .reference import INT4_RUN, TILE_ROWS, dequant_scratch_bytes
from .triton_pdl import launch_options, pdl_start
from .triton_int4 import group_at, tiled_at

BLOCK_R, BLOCK_K = 16, 256  # a program's tile of the weight: rows, columns (a multiple of the group)


@triton.jit
def _dequant_kernel(C, S, MN, T, W, N, K, stride_c, stride_s, stride_w, BITS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr, TILED: tl.constexpr,
                    TABLE: tl.constexpr = False, SUPER: tl.constexpr = 0, PDL: tl.constexpr = False):
    """W[rows, k] for a BLOCK_R x BLOCK_K tile: the codes times their group's scale, plus its
    minimum, each group's scale and minimum read once and broadcast over its codes. Int4 codes
    are read as the 16-bit words of their runs (C is int16; models/quant.py's layout: word i of a
    run of RUN holds codes i, RUN/4 + i, RUN/2 + i, 3RUN/4 + i) and put back in column order in
    registers (writing each nibble position as its own slice of columns, with a scale gathered
    per code, was slower). The launcher makes K a whole number of tiles (BLOCK_K
    divides it), and for int4 BLOCK_K a whole number of runs. With TILED (int4) C, S and MN lie
    in reference.tile_rows' order (triton_int4.tiled_at finds a unit's place, group_at a
    group's scale). With TABLE (int4) each code is looked up in T and there is no minimum; with
    SUPER too (IQ4_XS) MN holds the super-scales [N, K/GROUP/SUPER], row major, each group's
    scale its S times its MN."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (rows < N)[:, None]
    k0 = tl.program_id(1) * BLOCK_K
    if BITS == 4:  # the runs' words, their four nibbles put back in column order
        RUNS: tl.constexpr = BLOCK_K // RUN
        word = tl.arange(0, BLOCK_K // 4)[None, :]  # of this tile's runs
        at = tiled_at(rows[:, None], N, stride_c, k0 // RUN + word // (RUN // 4), RUN // 4, TILED)
        w = tl.load(C + at + word % (RUN // 4), mask=ok, other=0)
        w = w.to(tl.int32).reshape(BLOCK_R, RUNS, RUN // 4)
        low = tl.join(w & 15, (w >> 4) & 15)  # [rows, runs, word, nibble r of 0-1]
        high = tl.join((w >> 8) & 15, (w >> 12) & 15)  # [rows, runs, word, r - 2 of 2-3]
        code = tl.permute(tl.join(low, high), (0, 1, 4, 3, 2)).reshape(BLOCK_R, BLOCK_K)
    else:
        code = tl.load(C + rows[:, None] * stride_c + k0 + tl.arange(0, BLOCK_K)[None, :], mask=ok, other=0)
    at = group_at(rows[:, None], N, stride_s, k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :], GROUP, RUN,
                  TILED)
    s = tl.load(S + at, mask=ok, other=0.0).to(tl.float32)
    if SUPER > 0:
        sg = (k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]) // SUPER
        s = s * tl.load(MN + rows[:, None] * (K // GROUP // SUPER) + sg, mask=ok, other=0.0).to(tl.float32)
    if TABLE:
        w = tl.load(T + code.to(tl.int32)).reshape(BLOCK_R, BLOCK_K // GROUP, GROUP) * s[:, :, None]
    else:
        m = tl.load(MN + at, mask=ok, other=0.0).to(tl.float32)
        w = code.to(tl.float32).reshape(BLOCK_R, BLOCK_K // GROUP, GROUP) * s[:, :, None] + m[:, :, None]
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(W + rows[:, None] * stride_w + k[None, :], w.reshape(BLOCK_R, BLOCK_K).to(W.dtype.element_ty), mask=ok)


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
                    bits: int, group: int, tiled: bool = False, table: Optional[torch.Tensor] = None,
                    superscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight [rows, K] that codes/scale/minimum, or codes/scale/`table` (and `superscale`,
    contiguous: IQ4_XS) (rows of a quantized linear; `tiled`: in reference.tile_rows' order,
    but the super-scales) stand for, written into `out` (its dtype; rows contiguous)."""
    rows, k = out.shape
    if bits == 4:
        if k % INT4_RUN:
            raise ValueError(f"int4 dequantization needs in_features a multiple of {INT4_RUN}, got {k}")
        codes = codes.view(torch.int16)  # the runs' words
    if superscale is not None and (table is None or not superscale.is_contiguous()):
        raise ValueError("super-scales go with a table and are contiguous")
    block_k = max(group, BLOCK_K)
    while k % block_k:  # whole groups a tile (and int4 runs), as many as divide K
        block_k //= 2
    _dequant_kernel[(triton.cdiv(rows, BLOCK_R), k // block_k)](
        codes, scale, superscale if superscale is not None else scale if minimum is None else minimum,
        scale if table is None else table, out, rows, k,
        codes.stride(0), scale.stride(0), out.stride(0), BITS=bits, GROUP=group, BLOCK_R=BLOCK_R, BLOCK_K=block_k,
        RUN=INT4_RUN, TILED=tiled, TABLE=table is not None,
        SUPER=0 if superscale is None else k // group // superscale.shape[1],
        **launch_options(out.device))
    return out


def dequantized_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], bits: int, group: int, tiled: bool = False,
                       table: Optional[torch.Tensor] = None, superscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W^T + bias, W dequantized a slice of whole output rows at a time into one
    buffer of x's dtype, each slice followed by its matmul. The buffer takes the bytes that the
    memory plan holds for the definition's float32 scratch (dequant_scratch_bytes): in bf16 four
    times its weights, so few slices that their launches are not what a prefill chunk waits on.
    Tiled weights (`tiled`) are sliced at whole tiles; a `table` layout's codes are looked up
    (times `superscale` too where given)."""
    out_f, k = scale.shape[0], x.shape[-1]
    step = min(out_f, max(1, dequant_scratch_bytes() // (k * x.element_size())))
    if tiled and step < out_f:
        step = max(TILE_ROWS, step - step % TILE_ROWS)
    buffer = torch.empty(step, k, dtype=x.dtype, device=x.device)
    if step == out_f:
        return F.linear(x, dequantize_into(buffer, codes, scale, minimum, bits, group, tiled, table, superscale),
                        bias)
    out = x.new_empty(*x.shape[:-1], out_f)
    for start in range(0, out_f, step):
        end = min(start + step, out_f)
        weight = dequantize_into(buffer[:end - start], codes[start:end], scale[start:end],
                                 None if minimum is None else minimum[start:end], bits, group, tiled, table,
                                 None if superscale is None else superscale[start:end])
        out[..., start:end] = F.linear(x, weight, None if bias is None else bias[start:end])
    return out
