"""Bytes per stored value, per weight type and per KV type: what the memory plan multiplies.

Weights are counted on a meta-device instance of the model (shapes without memory), so the count
is exact for every architecture and layer mix without a formula per model. A quantized weight
costs its codes plus a float16 scale and a float16 minimum per group (docs: the shared quantized
format); a GGUF file's tensors are counted as the loader keeps them in memory, which is not the
file's own size (a Q4_K block is 4.5 bits a value on disk and 5 in memory, int4 g32).
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..errors import CheckpointError

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
QUANTIZE_GROUPS = (128, 64, 32, 16)  # --quantize takes the largest dividing in_features (models/quant.py)
QUANTIZE_BITS = {"int8": 8, "int4": 4}
# GGUF tensor type -> (bits, group) as the loader keeps it (docs: the shared quantized format)
GGUF_QUANT = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}
GGUF_DENSE = ("F32", "F16", "BF16")  # kept in the model's dtype
GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")
# KV cache types with blocks of 32 values along head_dim: codes + one float16 scale per block
KV_BLOCK_BYTES = {"q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32)}
KV_FIXED_BYTES = {"bf16": 2, "fp8": 1}


def kv_value_bytes(kv_type: str, model_dtype: torch.dtype) -> Fraction:
    """Bytes one cached K or V value takes under `kv_type` (auto: the model's dtype)."""
    if kv_type == "auto":
        return Fraction(DTYPE_BYTES[model_dtype])
    if kv_type in KV_FIXED_BYTES:
        return Fraction(KV_FIXED_BYTES[kv_type])
    if kv_type in KV_BLOCK_BYTES:
        return KV_BLOCK_BYTES[kv_type]
    raise ValueError(f"unknown KV type {kv_type!r}")


def quantized_bytes(numel: int, bits: int, group: int) -> int:
    """Codes (two int4 per byte, or one int8) + float16 scale and minimum per group."""
    return numel * bits // 8 + numel // group * 4


def quant_label(bits: int, group: int) -> str:
    """int4 g128: codes of 4 bits, a float16 scale and minimum per 128 values."""
    return f"int{bits} g{group}"


def module_weight_bytes(model: nn.Module, dtype: torch.dtype, quantize: Optional[str]) -> dict[str, int]:
    """Bytes per storage type of a model's parameters (tied ones once): a meta instance is fine.
    --quantize replaces the linears of the decoder layers (`model.model.layers`), each in the
    largest group that divides its input width; the embedding, the lm_head and biases stay dense."""
    out: dict[str, int] = {}
    quantized: set[int] = set()
    if quantize is not None:
        bits = QUANTIZE_BITS[quantize]
        for module in model.model.layers.modules():
            group = next((g for g in QUANTIZE_GROUPS if getattr(module, "in_features", 1) % g == 0), None)
            if isinstance(module, nn.Linear) and group is not None:
                label = quant_label(bits, group)
                out[label] = out.get(label, 0) + quantized_bytes(module.weight.numel(), bits, group)
                quantized.add(id(module.weight))
    dense = sum(p.numel() for p in model.parameters() if id(p) not in quantized)
    out = {f"{dtype_name(dtype)} (dense)": dense * DTYPE_BYTES[dtype], **out}
    return {k: v for k, v in out.items() if v}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_weight_bytes(path: Path, dtype: torch.dtype, num_layers: int) -> dict[str, int]:
    """Bytes per in-memory type of a GGUF file's tensors, from its header alone (GGUFReader maps
    the file and reads no tensor data): quantized types as the loader converts them, float
    tensors in the model's dtype. Blocks from `num_layers` on (a multi-token-prediction head
    that newer converters append) are not loaded, so not counted."""
    from gguf import GGUFReader  # only GGUF targets need it

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the GGUF header of {path}: {e}") from None
    out: dict[str, int] = {}
    for t in reader.tensors:
        block = GGUF_BLOCK.match(t.name)
        if block and int(block.group(1)) >= num_layers:
            continue
        kind, numel = t.tensor_type.name, int(t.n_elements)
        if kind in GGUF_DENSE:
            label, nbytes = f"{dtype_name(dtype)} (dense)", numel * DTYPE_BYTES[dtype]
        elif kind in GGUF_QUANT:
            bits, group = GGUF_QUANT[kind]
            label, nbytes = f"{quant_label(bits, group)} from {kind}", quantized_bytes(numel, bits, group)
        else:
            raise CheckpointError(f"{path}: tensor {t.name} has GGUF type {kind}; supported: "
                                  f"{', '.join(GGUF_DENSE + tuple(GGUF_QUANT))}")
        out[label] = out.get(label, 0) + nbytes
    return out
