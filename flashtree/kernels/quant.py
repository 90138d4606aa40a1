"""The quantized linear op: on CUDA, Triton's small-M GEMM on tensor cores (a verified tree, a draft
block, and the AR step's one row of int4; triton_quant.py), in launches of GEMM_MAX_ROWS rows for
several sequences' trees, or its GEMV (one row of int8; triton_gemv.py); for prefill chunks,
where M is large enough for the dense matmul to be worth one dequantized copy, Triton's
dequantization then cuBLAS; else (the CPU) the definition (dequantize the layer, then matmul)."""

from __future__ import annotations

import os
from functools import partial
from typing import Callable, Optional

import torch

from . import HAVE_TRITON, by_row_slices, deterministic, deterministic_splits, kernel_rows, use_triton
from .reference import INT4_RUN, tile_int4
from .reference import quant_linear as reference_quant_linear

GEMM_MAX_ROWS = 64  # the rows of one GEMM launch
# Up to this many rows (a shared verify of up to 8 trees of 23 rows) the GEMM runs in launches of
# GEMM_MAX_ROWS; above it (a prefill chunk) the layer is dequantized once, then the dense matmul.
# Each launch reads the codes again, while the dequantized copy writes and reads four bf16 bytes a
# 4-bit weight, so a few launches cost less and many cost more: at 92 rows the launches win by far
# (`flashtree bench --sessions` on an int4 target); where the two cross is not measured
SLICED_MAX_ROWS = 192
L2_PREFETCH_MB = 0  # MB a linear prefetches of the next one's weights (FLASHTREE_L2_PREFETCH_MB): off by default


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], bits: int, group: int, tiled: bool = False,
                 table: Optional[torch.Tensor] = None, superscale: Optional[torch.Tensor] = None,
                 prefetch: Optional[tuple[torch.Tensor, int]] = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: x @ W^T + bias, W given by its packed codes [out, in or in/2],
    float16 scale and minimum [out, in/group], or for the table layout int4 codes indexing
    `table` (float32 [16]) and a scale alone, times a `superscale` per few groups for IQ4_XS
    (models/quant.py describes the formats); `tiled`: int4 codes, scales and minima in
    reference.tile_rows' order (only where gemm_applies; super-scales stay row major).
    `prefetch` (a tensor, bytes): what the tiled GEMM sends to L2 as it ends (the next linear's
    weights); a hint that changes no result."""
    rows = x.numel() // x.shape[-1]
    if deterministic() and kernel_applies(x, 1, bits, group):
        return invariant_quant_linear(x, codes, scale, minimum, bias, bits, group, tiled, table, superscale)
    if kernel_applies(x, rows, bits, group):
        out = kernel_for(rows, bits, tiled, table, superscale, prefetch)(kernel_rows(x), codes, scale, minimum, bias,
                                                                         bits, group)
        return out.view(*x.shape[:-1], scale.shape[0])
    if rows <= SLICED_MAX_ROWS and kernel_applies(x, GEMM_MAX_ROWS, bits, group):
        launch = kernel_for(GEMM_MAX_ROWS, bits, tiled, table, superscale, prefetch)
        return by_row_slices(x, scale.shape[0], GEMM_MAX_ROWS,
                             lambda part, into: launch(part, codes, scale, minimum, bias, bits, group, out=into))
    if x.is_cuda and rows > GEMM_MAX_ROWS and use_triton(x) and layout_applies(x.shape[-1], bits):
        from .triton_dequant import dequantized_linear

        return dequantized_linear(x, codes, scale, minimum, bias, bits, group, tiled, table, superscale)
    if tiled:  # the definition reads rows in order (float32 activations on CUDA, a tiled layer on the CPU)
        codes, scale, minimum = tile_int4(codes, scale, minimum, inverse=True)
    return reference_quant_linear(x, codes, scale, minimum, bias, bits, group, table, superscale)


def invariant_quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                           minimum: Optional[torch.Tensor], bias: Optional[torch.Tensor], bits: int, group: int,
                           tiled: bool = False, table: Optional[torch.Tensor] = None,
                           superscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """quant_linear in the deterministic mode: every row, whatever the rows beside it, through
    the same launch of the GEMM (tiles of GEMM_MAX_ROWS rows, the int4-rows launch, K split as
    kernels.deterministic_splits says), rows beyond a tile in further launches: no GEMV for one row and
    no dequantized copy for a prefill chunk, whose reductions differ."""
    from .triton_quant import GEMM_LAUNCH, gemm, int8_step

    k = x.shape[-1]
    launch = GEMM_LAUNCH["int4 rows"]
    split = deterministic_splits(k, scale.shape[0], INT4_RUN if bits == 4 else int8_step(group, k))
    run = partial(gemm, codes=codes, scale=scale, minimum=minimum, bias=bias, bits=bits, group=group,
                  block_n=launch["block_n"], split=split, num_warps=launch["num_warps"],
                  num_stages=launch["num_stages"], tiled=tiled, table=table, superscale=superscale,
                  block_m=GEMM_MAX_ROWS)
    return by_row_slices(x, scale.shape[0], GEMM_MAX_ROWS, lambda part, into: run(part, out=into))


def kernel_applies(x: torch.Tensor, rows: int, bits: int, group: int) -> bool:
    """Where the Triton kernels run: Triton's devices, 16-bit activations on CUDA (the GEMM's
    tensor cores; the interpreter also runs float32), at most GEMM_MAX_ROWS rows, and for int4
    what the GEMM reads (gemm_applies)."""
    if not use_triton(x) or not 1 <= rows <= GEMM_MAX_ROWS or not gemm_applies(x.shape[-1], bits, group):
        return False
    return not x.is_cuda or x.dtype in (torch.bfloat16, torch.float16)


def kernel_for(rows: int, bits: int, tiled: bool = False, table: Optional[torch.Tensor] = None,
               superscale: Optional[torch.Tensor] = None,
               prefetch: Optional[tuple[torch.Tensor, int]] = None) -> Callable[..., torch.Tensor]:
    """The Triton launcher for `rows` rows of x where kernel_applies: the GEMM, except for one
    row of int8, where the GEMV is faster over a 27B's and an 8B's int8 linears (`python
    benchmarks/quant_gemv.py` measures both). `tiled` (int4): the GEMM reading tiles; `table`:
    the GEMM looking its int4 codes up in it (and scaling by `superscale` too, where given);
    `prefetch`: what a tiled GEMM prefetches as it ends (gemm's)."""
    from .triton_gemv import gemv
    from .triton_quant import gemm

    if tiled or table is not None:
        return partial(gemm, tiled=tiled, table=table, superscale=superscale, prefetch=prefetch if tiled else None)
    return gemv if rows == 1 and bits == 8 else gemm


def prefetch_supported(device: torch.device) -> bool:
    """Whether the device has bulk L2 prefetches (CUDA, compute capability 9.0 or later) for the
    GEMM's prefetch of the next linear (triton_prefetch.py)."""
    return HAVE_TRITON and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch_bytes(device: torch.device) -> int:
    """What a linear prefetches of the next one's weights on `device`: FLASHTREE_L2_PREFETCH_MB
    megabytes (L2_PREFETCH_MB; 0 turns it off), none where prefetch_supported is false."""
    if not prefetch_supported(device):
        return 0
    return int(float(os.environ.get("FLASHTREE_L2_PREFETCH_MB", L2_PREFETCH_MB)) * 2**20) // 16 * 16


def layout_applies(in_features: int, bits: int) -> bool:
    """The kernels read int4 as whole runs of its layout (reference.INT4_RUN codes); a shorter
    last run (in_features no multiple of it) is the definition's alone."""
    return bits == 8 or in_features % INT4_RUN == 0


def gemm_applies(in_features: int, bits: int, group: int) -> bool:
    """The GEMM reads int4 as whole runs (layout_applies) in groups of a quarter run to a run:
    each slice of a run that it dots lies in one group, and a run in one group or whole ones."""
    return layout_applies(in_features, bits) and (bits == 8 or INT4_RUN // 4 <= group <= INT4_RUN)
