"""GGUF quantized blocks -> the shared group-wise format of quantized linear weights
(/work docs: W[o, i] = codes[o, i] * scale[o, i // group] + minimum[o, i // group]), exactly.

Every supported GGUF type is affine per group of 16 or 32 weights, so a file's weights can stay
quantized in memory instead of being dequantized at load: only the block layout differs. Each
type's blocks are unpacked here into unsigned codes and one float scale and minimum per group:

  Q8_0  32 int8 q, scale d                    -> bits 8, group 32: codes q + 128, minimum -128 d
  Q4_0  32 4-bit q, scale d, value d (q - 8)  -> bits 4, group 32: minimum -8 d
  Q4_K  256 = 8 x 32 4-bit q, 6-bit sc and m per 32, super-scales d, dmin: d sc q - dmin m
  Q5_K  as Q4_K with a fifth bit per code     -> bits 8 (codes 0..31), group 32
  Q6_K  256 = 16 x 16 6-bit q, int8 sc per 16, d: d sc (q - 32) -> bits 8, group 16

Torch-free (numpy); models/quant.py packs the result for its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import CheckpointError
from .gguf_tensors import QuantizedTensor

QK_K = 256
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_ELEMS = {"Q8_0": 32, "Q4_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}


@dataclass
class GroupCodes:
    """codes uint8 [out, in] (unpacked); scale, minimum float32 [out, in // group]."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    group: int
    bits: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from the last axis's 2 bytes, as float32 with that axis dropped."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[..., :2])
    codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[..., :2])
    qs = b[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    return codes, d, -8 * d


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 bytes: the first
    four pairs are the low 6 bits of bytes 0-3 and 4-7; the last four take 4 bits from bytes 8-11
    and their top 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit codes: each 32 bytes hold two sub-blocks of 32, low nibbles first."""
    chunks = qs.reshape(*qs.shape[:-1], QK_K // 64, 1, 32)
    return (chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # [..., 4, 2, 32]


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    codes = _nibble_pairs(b[..., 16:]).reshape(*b.shape[:-1], QK_K)
    return codes, d[..., None] * sc, -(dmin[..., None] * m)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    low = _nibble_pairs(b[..., 48:])                                   # [..., 4, 2, 32]
    qh = b[..., 16:48]                                                 # bit j of byte l: sub-block j, element l
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = low | (high.reshape(low.shape) << 4)
    return codes.reshape(*b.shape[:-1], QK_K), d[..., None] * sc, -(dmin[..., None] * m)


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ql, qh = b[..., :128], b[..., 128:192]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # each half of 128: ql's 64 bytes give elements 0..63 (low nibbles) and 64..127 (high);
    # qh's 32 bytes give the top two bits of elements l, l+32, l+64, l+96 at bits 0, 2, 4, 6
    ql = ql.reshape(*ql.shape[:-1], 2, 1, 64)
    low = (ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F      # [..., 2, 2, 64]
    qh = qh.reshape(*qh.shape[:-1], 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [..., 2, 4, 32]
    codes = low.reshape(*low.shape[:-3], 2, 128) | (high.reshape(*high.shape[:-3], 2, 128) << 4)
    scale = d[..., None] * sc
    return codes.reshape(*b.shape[:-1], QK_K), scale, -32 * scale


UNPACK = {"Q8_0": (_q8_0, 32, 8), "Q4_0": (_q4_0, 32, 4), "Q4_K": (_q4_k, 32, 4),
          "Q5_K": (_q5_k, 32, 8), "Q6_K": (_q6_k, 16, 8)}


def decompose(qtype: str, blocks: np.ndarray, shape: tuple[int, int]) -> GroupCodes:
    """The GGUF blocks (uint8 [rows, bytes per row]) of a [rows, cols] weight as group codes."""
    if qtype not in UNPACK:
        raise CheckpointError(f"GGUF type {qtype} has no group-wise form; supported: {', '.join(UNPACK)}")
    rows, cols = shape
    if cols % BLOCK_ELEMS[qtype] or blocks.shape != (rows, cols // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]):
        raise CheckpointError(f"{qtype} blocks of shape {blocks.shape} do not hold a {rows}x{cols} weight")
    unpack, group, bits = UNPACK[qtype]
    codes, scale, minimum = unpack(blocks.reshape(rows, -1, BLOCK_BYTES[qtype]))
    groups = cols // group
    return GroupCodes(np.ascontiguousarray(codes.reshape(rows, cols), dtype=np.uint8),
                      scale.reshape(rows, groups).astype(np.float32),
                      minimum.reshape(rows, groups).astype(np.float32), group, bits)


def group_codes(t: QuantizedTensor) -> GroupCodes:
    """decompose, then the tensor's column order (qwen35's out_proj): it moves whole groups, so
    the codes' columns and the groups' scales and minimums move with them."""
    out = decompose(t.qtype, t.blocks, t.shape)
    order: Optional[np.ndarray] = t.column_order
    if order is None:
        return out
    starts = order.reshape(-1, out.group)
    if np.any(starts[:, 0] % out.group) or np.any(starts - starts[:, :1] != np.arange(out.group)):
        raise CheckpointError(f"{t.name}: its column order splits the {out.group}-wide groups of {t.qtype}")
    moved = starts[:, 0] // out.group
    return GroupCodes(np.ascontiguousarray(out.codes[:, order]), out.scale[:, moved], out.minimum[:, moved],
                      out.group, out.bits)
