"""The dense linear of the deterministic mode: x @ W^T + bias whose every output row is computed
the same way whatever the rows beside it.

cuBLAS picks its algorithm, tiles and split of K from the shape, so one row's result depends on
how many rows came with it: a prefill chunk, a 23-row tree and one AR row round differently. Here
the launch is fixed: tiles of DET_BLOCK_M x DET_BLOCK_N over steps of DET_BLOCK_K, 4 warps, and K
split into runs of kernels.DET_SPLIT_K below kernels.DET_WIDE outputs (a function of the shape
alone, kernels.deterministic_splits) whose float32 partials are added in split order
(triton_split.store_split). Rows only ever share a tile, where each output element is its own
dot, so a row's bits follow from its own values. Launches take at most kernels.DET_SLICE rows,
which bounds the partials (the memory plan counts them) and keeps a launch's tiles within the
split-K counters.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import DET_SLICE, by_row_slices, deterministic_splits
from .triton_pdl import launch_options, pdl_start
from .triton_split import split_outputs, split_range, store_split

DET_BLOCK_M = 64
DET_BLOCK_N = 64
DET_BLOCK_K = 64


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


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T + bias in x's dtype (16-bit, on CUDA or the interpreter),
    each row bit-identical whatever the other rows (the module docstring)."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    split = deterministic_splits(k, n, DET_BLOCK_K)
    n_tiles = triton.cdiv(n, DET_BLOCK_N)

    def launch(part: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
        tiles = triton.cdiv(part.shape[0], DET_BLOCK_M) * n_tiles
        out, partials, locks = split_outputs(part.shape[0], n, split, tiles, x, into)
        _linear_kernel[(tiles, split)](
            part, weight, bias if bias is not None else weight, out, partials, locks,
            part.shape[0], n, k, part.stride(0), weight.stride(0), out.stride(0), part.shape[0] * n, n_tiles,
            HAS_BIAS=bias is not None, BLOCK_M=DET_BLOCK_M, BLOCK_N=DET_BLOCK_N, BLOCK_K=DET_BLOCK_K,
            num_warps=4, num_stages=3, **launch_options(x.device))
        return out

    return by_row_slices(x, n, DET_SLICE, launch)
