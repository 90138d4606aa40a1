"""The quantized linear op: Triton's GEMV (one row: the AR step; triton_gemv.py) or small-M GEMM
(a verified tree, a draft block; triton_quant.py) on CUDA; for prefill chunks, where M is large enough for the dense matmul to be
worth one dequantized copy, Triton's dequantization then cuBLAS; else (the CPU) the definition
(dequantize the layer, then matmul)."""

from __future__ import annotations

from typing import Optional

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
        from .triton_gemv import gemv
        from .triton_quant import gemm

        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:  # the kernels take a row stride, not a column one
            flat = flat.contiguous()
        run = gemv if rows == 1 else gemm
        return run(flat, codes, scale, minimum, bias, bits, group).view(*x.shape[:-1], scale.shape[0])
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
    return rows == 1 or bits == 8 or group >= 32
