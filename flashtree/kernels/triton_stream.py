"""The int4 GEMM in stream-K order: a fixed grid of programs, about as many as the SMs hold at
once, each taking an equal run of the layer's (output tile, run of K) units, whatever tiles
those runs belong to.

Why: the split-K GEMM (triton_quant.py) launches output tiles x splits programs, a number
that is seldom a whole multiple of what the SMs hold, so its last wave runs on part of the GPU
(a 27B's 23-row linears launch 1.4 to 2.8 waves of their 3 programs an SM), and a split of K that
does not divide its runs leaves programs with nothing to do. Here every program streams the same
number of runs, give or take one, and a tile cut between programs is summed by its last part to
finish (triton_split.store_part: the parts in order, so a tile's sum depends on the layer's
shape and the grid, never on the rows of x or the order the programs end in).

Each unit is the split-K GEMM's int4 step (triton_int4.run_dot): the same codes, layouts and
dequantization, int4 only."""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .reference import INT4_RUN
from .triton_int4 import MAGIC_KINDS, QUAD_PTX, SCALE_PTX, run_dot, tiled_at
from .triton_pdl import launch_options, pdl_start
from .triton_split import split_outputs, store_part

# The launches per rows of x: rows of W a program, warps, stages, and programs an SM (the grid
# is that many times the SMs; more than fit only queue)
STREAM_LAUNCH = {"one row": dict(block_n=64, num_warps=2, num_stages=3, per_sm=10),
                 "rows": dict(block_n=128, num_warps=4, num_stages=3, per_sm=3)}


@triton.jit
def _stream_kernel(X, C, S, MN, B, T, OUT, P, LOCKS, M, N, K, PER, stride_xm, stride_om, stride_c, stride_s,
                   stride_p, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr, SPTX: tl.constexpr,
                   RUN: tl.constexpr, TILED: tl.constexpr, TABLE: tl.constexpr = False, SUPER: tl.constexpr = 0,
                   PDL: tl.constexpr = False):
    """Units u of [PER * program, PER * (program + 1)), unit u being run u mod (K / RUN) of output
    tile u div (K / RUN) (BLOCK_N rows of W, OUT^T's tile as in triton_quant._gemm_kernel): the
    program's runs of each tile it meets are one part of that tile, part p of a tile being the p-th
    program that meets it."""
    steps = K // RUN
    units = tl.cdiv(N, BLOCK_N) * steps
    n_groups = K // GROUP
    u = tl.program_id(0) * PER
    end = tl.minimum(u + PER, units)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    pdl_start(PDL)
    while u < end:
        tile = u // steps
        tile_start = tile * steps
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for t in range(u - tile_start, tl.minimum(steps, end - tile_start)):
            s = rn * 0.0
            m = s
            if GROUP == RUN:  # the run's one group: its scale and minimum a row
                at = tiled_at(rn, N, stride_s, t, 1, TILED)
                s = tl.load(S + at, mask=n_ok, other=0.0).to(tl.float32)
                m = s if TABLE else tl.load(MN + at, mask=n_ok, other=0.0).to(tl.float32)
            acc = run_dot(acc, X, C, S, MN, T, rn, N, n_ok, rm, m_ok, t, s, m, n_groups, stride_xm, stride_c,
                          stride_s, GROUP, RUN, TILED, ASM, PTX, SPTX, TABLE, SUPER)
        if HAS_BIAS:
            if u == tile_start:
                acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        first = tile_start // PER
        store_part(acc, OUT, P, LOCKS, rm[None, :] * stride_om + rn[:, None], m_ok[None, :] & n_ok[:, None],
                   stride_p, tile, tl.program_id(0) - first, (tile_start + steps - 1) // PER - first + 1)
        u = tile_start + steps


def stream_grid(n: int, k: int, block_n: int, programs: int) -> tuple[int, int, int]:
    """(units a program, programs, the most parts a tile is cut into) for an [n, k] int4 weight
    in tiles of `block_n` rows, over at most `programs` programs."""
    steps = k // INT4_RUN
    units = triton.cdiv(n, block_n) * steps
    per = triton.cdiv(units, min(programs, units))
    return per, triton.cdiv(units, per), min(triton.cdiv(units, per), (steps - 1) // per + 2)


def stream_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], bits: int, group: int, block_n: Optional[int] = None,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None, per_sm: Optional[float] = None,
                asm: Optional[bool] = None, tiled: bool = False, table: Optional[torch.Tensor] = None,
                superscale: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] -> [M, N] for int4 weights, as triton_quant.gemm computes it (the same arguments,
    `per_sm` programs an SM in place of a split), in stream-K order. What is not given comes from
    STREAM_LAUNCH."""
    rows, n, k = x.shape[0], scale.shape[0], x.shape[-1]
    if bits != 4 or rows > 64 or k % INT4_RUN or not INT4_RUN // 4 <= group <= INT4_RUN:
        raise ValueError(f"the stream-K GEMM takes int4 in groups of {INT4_RUN // 4} to {INT4_RUN}, in_features a "
                         f"multiple of {INT4_RUN} and at most 64 rows, got {bits} bits, group {group}, "
                         f"{k} in_features, {rows} rows")
    chosen = STREAM_LAUNCH["one row" if rows == 1 else "rows"]
    block_n = block_n or chosen["block_n"]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    per, programs, parts = stream_grid(n, k, block_n, math.ceil((per_sm or chosen["per_sm"]) * sms))
    kind = MAGIC_KINDS[x.dtype]
    asm = (x.is_cuda if asm is None else asm) and kind != 0 and table is None
    block_m = block_m or max(16, triton.next_power_of_2(rows))
    out, partials, locks = split_outputs(rows, n, parts, triton.cdiv(n, block_n), x, out)
    codes = codes.view(torch.int16)  # words of four codes
    second = superscale if superscale is not None else scale if minimum is None else minimum
    _stream_kernel[(programs,)](
        x, codes, scale, second, bias if bias is not None else scale,
        scale if table is None else table, out, partials, locks, rows, n, k, per,
        x.stride(0), out.stride(0), codes.stride(0), scale.stride(0), rows * n,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=bias is not None, ASM=asm,
        PTX=QUAD_PTX.get(kind, ""), SPTX=SCALE_PTX.get(kind, ""), RUN=INT4_RUN, TILED=tiled,
        TABLE=table is not None, SUPER=0 if superscale is None else k // group // superscale.shape[1],
        num_warps=num_warps or chosen["num_warps"], num_stages=num_stages or chosen["num_stages"],
        **launch_options(x.device))
    return out
