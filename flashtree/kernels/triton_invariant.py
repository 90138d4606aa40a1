"""The dense linear of the deterministic mode: x @ W^T + bias whose every output row is computed
the same way whatever the rows beside it.

cuBLAS picks its algorithm, tiles and split of K from the shape, so one row's result depends on
how many rows came with it: a prefill chunk, a 23-row tree and one AR row round differently. Here
the launch is fixed (InvariantLaunch: tiles of block_m x block_n over steps of block_k), and K is
split into runs of at least kernels.DET_SPLIT_K below kernels.DET_WIDE outputs (a function of the
shape alone, kernels.deterministic_splits), into no more runs than bring the launch to
InvariantLaunch.programs, whose float32 partials are added in split order
(triton_split.store_split). Rows only ever share a tile, where each output element is its own
dot, so a row's bits follow from its own values. Launches take at most kernels.DET_SLICE rows,
which bounds the partials (the memory plan counts them) and keeps a launch's tiles within the
split-K counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import DET_SLICE, by_row_slices, deterministic_splits
from .triton_pdl import launch_options, pdl_start
from .triton_split import split_outputs, split_range, store_split


@dataclass(frozen=True)
class InvariantLaunch:
    """The deterministic linear's launch: fixed for every shape and row count, since the tile's
    steps of K are its order of summation. block_m stays a multiple of 64 on Hopper so that every
    row count runs the same MMA instruction. `programs` (for one row tile) caps the split of K:
    past about three programs an SM, more runs of K add partials to sum and no bandwidth
    (benchmarks/invariant_gemm.py times the launches)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    programs: int = 384


DET_LAUNCH = InvariantLaunch()


@triton.jit
def _linear_kernel(X, W, B, OUT, P, LOCKS, M, N, K, stride_xm, stride_wn, stride_om, stride_p, n_tiles,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Output tile program_id(0) (row tile major, n_tiles along N) over split program_id(1)'s
    steps of K: acc [BLOCK_M, BLOCK_N] = x W^T in float32, masked rows and columns read as zero."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    rm = (tile // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    lo, hi = split_range(tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(lo, hi):
        kk = step * BLOCK_K + rk
        k_ok = kk < K
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    store_split(acc, OUT, P, LOCKS, rm[:, None] * stride_om + rn[None, :], m_ok[:, None] & n_ok[None, :], stride_p)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     cfg: InvariantLaunch = DET_LAUNCH) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T + bias in x's dtype (16-bit, on CUDA or the interpreter),
    each row bit-identical whatever the other rows (the module docstring). Another `cfg` gives
    other bits (benchmarks/invariant_gemm.py times them)."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    n_tiles = triton.cdiv(n, cfg.block_n)
    split = min(deterministic_splits(k, n, cfg.block_k), max(1, cfg.programs // n_tiles))

    def launch(part: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        tiles = triton.cdiv(part.shape[0], cfg.block_m) * n_tiles
        out, partials, locks = split_outputs(part.shape[0], n, split, tiles, x, into)
        _linear_kernel[(tiles, split)](
            part, weight, bias if bias is not None else weight, out, partials, locks,
            part.shape[0], n, k, part.stride(0), weight.stride(0), out.stride(0), part.shape[0] * n, n_tiles,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.warps, num_stages=cfg.stages, **launch_options(x.device))
        return out

    return by_row_slices(x, n, DET_SLICE, launch)
