"""The quantized linear op: on CUDA, Triton's small-M GEMM on tensor cores (a verified tree, a draft
block, and the AR step's one row of int4; triton_quant.py) or its GEMV (one row of int8, or of
int4 in groups of 16; triton_gemv.py); for prefill chunks, where M is large enough for the dense
matmul to be worth one dequantized copy, Triton's dequantization then cuBLAS; else (the CPU) the
definition (dequantize the layer, then matmul)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import use_triton
from .reference import quant_linear as reference_quant_linear

GEMM_MAX_ROWS = 64  # above it a prefill chunk: dequantize once, then the dense matmul


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: Optional[torch.Tensor], bits: int, group: int) -> torch.Tensor:
    """x [..., in] -> [..., out]: x @ W^T + bias, W given by its packed codes [out, in or in/2],
    float16 scale and minimum [out, in/group] (models/quant.py describes the format)."""
    rows = x.numel() // x.shape[-1]
    if kernel_applies(x, rows, bits, group):
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:  # the kernels take a row stride, not a column one
            flat = flat.contiguous()
        out = kernel_for(rows, bits, group)(flat, codes, scale, minimum, bias, bits, group)
        return out.view(*x.shape[:-1], scale.shape[0])
    if x.is_cuda and rows > GEMM_MAX_ROWS and use_triton(x):
        from .triton_dequant import dequantized_linear

        return dequantized_linear(x, codes, scale, minimum, bias, bits, group)
    return reference_quant_linear(x, codes, scale, minimum, bias, bits, group)


def kernel_applies(x: torch.Tensor, rows: int, bits: int, group: int) -> bool:
    """Where the Triton kernels run: Triton's devices, 16-bit activations on CUDA (the GEMM's
    tensor cores; the interpreter also runs float32), at most GEMM_MAX_ROWS rows, and for the
    GEMM's int4 a half group of at least 16."""
    if not use_triton(x) or not 1 <= rows <= GEMM_MAX_ROWS:
        return False
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return rows == 1 or gemm_applies(bits, group)


def kernel_for(rows: int, bits: int, group: int) -> Callable[..., torch.Tensor]:
    """The Triton launcher for `rows` rows of x where kernel_applies: the GEMM, except for one
    row of int8 or of int4 in groups of 16, where the GEMV is faster or the only one that runs
    (one row of int4: the GEMM 5% faster over a 27B's linears, 3% slower over an 8B's; of int8:
    the GEMV 1.2x faster; benchmarks/results/quant_gemv_h200.json)."""
    from .triton_gemv import gemv
    from .triton_quant import gemm

    return gemm if rows > 1 or bits == 4 and gemm_applies(bits, group) else gemv


def gemm_applies(bits: int, group: int) -> bool:
    """The GEMM's int4 dots take a half group as their K, which tl.dot needs to be at least 16."""
    return bits == 8 or group >= 32
