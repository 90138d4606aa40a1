"""GGUF quantized blocks -> the shared group-wise formats of quantized linear weights
(models/quant.py: W[o, i] = codes[o, i] * scale[o, i // group] + minimum[o, i // group], or in the
table layout W[o, i] = IQ4_VALUES[codes[o, i]] * scale[o, i // group], IQ4_XS's times a
super-scale), exactly.

Every supported GGUF type is affine per group of 16 or 32 weights, or (the IQ4 types) a
16-entry table of integers times a scale per group, so a file's weights can stay quantized in
memory instead of being dequantized at load: only the block layout differs. Each type's blocks
are unpacked here into unsigned codes and one float scale and minimum per group (the IQ4 types:
table indices and a scale), exactly:

  Q8_0   32 int8 q, scale d                    -> bits 8, group 32: codes q + 128, minimum -128 d
  Q4_0   32 4-bit q, scale d, value d (q - 8)  -> bits 4, group 32: minimum -8 d
  Q4_1   32 4-bit q, scale d, minimum m        -> bits 4, group 32
  Q5_0   32 5-bit q, value d (q - 16)          -> bits 8 (codes 0..31), group 32
  Q5_1   32 5-bit q, scale d, minimum m        -> bits 8 (codes 0..31), group 32
  IQ4_NL 32 4-bit q, value d T[q] (T: IQ4_VALUES, integers in [-127, 113]) -> the table layout,
         bits 4, group 32, scale d
  IQ4_XS 256 = 8 x 32 as IQ4_NL, a 6-bit scale ls per 32 under a super-scale d -> the same in
         two levels: scale ls - 32 per group, `superscale` d per 8 groups (TWO_LEVEL)
  Q4_K   256 = 8 x 32 4-bit q, 6-bit sc and m per 32, super-scales d, dmin: d sc q - dmin m
  Q5_K   as Q4_K with a fifth bit per code     -> bits 8 (codes 0..31), group 32
  Q6_K   256 = 16 x 16 6-bit q, int8 sc per 16, d: d sc (q - 32) -> bits 8, group 16
  Q3_K   256 = 16 x 16 3-bit q, 6-bit sc per 16, d: d (sc - 32) (q - 4) -> bits 8, group 16
  Q2_K   256 = 16 x 16 2-bit q, 4-bit sc and m per 16, d, dmin: d sc q - dmin m -> bits 8, group 16

The kernels take 4-bit codes in groups of 32 to 128, the table layout's, and 8-bit codes in any
group, so the types whose codes are none of these (the 5-bit codes, the 16-wide groups of Q2_K
and Q3_K) are held as 8-bit codes: exact, at more bytes than the file (WIDENED; the loader says
so). So is an IQ4 tensor packed into one linear with a part of another type (`widen`: codes
T[q] + 128, minimum -128 scale).

IQ4_XS keeps its two levels (d times a 6-bit integer has up to 16 significant bits, more than
float16's 11): a super-scale per super-block of 8 groups and an integer sub-scale per group.
A column order (qwen35's out_proj) that brings groups of different super-blocks together narrows
the super-blocks to the most groups that still share one d (`super_groups`); each reordered
super-block takes its stored super-block's d.

Torch-free (numpy); models/quant.py packs the result for its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import CheckpointError
from .gguf_tensors import QuantizedTensor

QK_K = 256
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "IQ4_NL": 18, "IQ4_XS": 136,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84}
BLOCK_ELEMS = {t: 32 if t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL") else QK_K for t in BLOCK_BYTES}
# the IQ4 types' 16 values (a code is an index into them), as ggml defines them
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)


@dataclass
class GroupCodes:
    """codes uint8 [out, in] (unpacked); scale, minimum float32 [out, in // group]; `lookup` (the
    table layout, an IQ4 type's name): codes index IQ4_VALUES, and minimum is None; `superscale`
    (TWO_LEVEL): float32 [out, in // group // s], each the d of s groups, whose `scale` is then
    their integer sub-scales (group_scales multiplies them out)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: Optional[np.ndarray]
    group: int
    bits: int
    lookup: Optional[str] = None
    superscale: Optional[np.ndarray] = None


def group_scales(c: GroupCodes) -> np.ndarray:
    """Each group's whole scale [out, in // group], float32: a two-level one's d times its
    sub-scale (exact: 11 and 6 significant bits)."""
    if c.superscale is None:
        return c.scale
    return c.scale * np.repeat(c.superscale, c.scale.shape[1] // c.superscale.shape[1], axis=1)


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


def _halves(qs: np.ndarray) -> np.ndarray:
    """A 32-weight block's 16 bytes of 4-bit codes: elements 0..15 low nibbles, 16..31 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """The fifth bit of each of a block's 32 codes, bit j of the little-endian word qh (4 bytes)."""
    return (qh[..., :, None] >> np.arange(8, dtype=np.uint8)).reshape(*qh.shape[:-1], 32) & 1


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _halves(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4])


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b[..., :2])
    return _halves(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _halves(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4), _f16(b[..., :2]), _f16(b[..., 2:4])


def _iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return _halves(b[..., 2:]), _f16(b[..., :2]), None


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """8 sub-blocks of 32: sub-block i's 6-bit scale is nibble i of scales_l (bytes 4-7) under bits
    2i, 2i+1 of scales_h (bytes 2-3, little-endian), less 32; its codes are bytes 8 + 16i.. as
    IQ4_NL's. The scales returned are those sub-scales; d (bytes 0-1) is the super-scale."""
    high = b[..., 2:4].copy().view(np.uint16)[..., 0]
    i = np.arange(8)
    low = (b[..., 4 + i // 2] >> (4 * (i % 2)).astype(np.uint8)) & 0x0F
    ls = (low | (((high[..., None] >> (2 * i)) & 3) << 4)).astype(np.float32) - 32
    codes = _halves(b[..., 8:].reshape(*b.shape[:-1], 8, 16))
    return codes.reshape(*b.shape[:-1], QK_K), ls, None


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 groups of 16: group g = 8 h + 2 j + p takes bits 2j of qs bytes 32 h + 16 p + l (l < 16)
    and, as its third bit, bit 4 h + j of hmask bytes 16 p + l; its 6-bit scale is nibble g // 8
    of byte g % 8 under bits 2 (g // 4) of byte 8 + g % 4, less 32; value d sc (q - 4)."""
    hmask, qs, packed, d = b[..., :32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    g = np.arange(16)
    low = (packed[..., g % 8] >> (4 * (g // 8)).astype(np.uint8)) & 0x0F
    high = (packed[..., 8 + g % 4] >> (2 * (g // 4)).astype(np.uint8)) & 3
    scale = d[..., None] * ((low | (high << 4)).astype(np.float32) - 32)
    h, j, p = g // 8, (g % 8) // 2, g % 2
    l = np.arange(16)
    q = (qs[..., (32 * h + 16 * p)[:, None] + l] >> (2 * j)[:, None].astype(np.uint8)) & 3
    third = (hmask[..., (16 * p)[:, None] + l] >> (4 * h + j)[:, None].astype(np.uint8)) & 1
    return (q | (third << 2)).reshape(*b.shape[:-1], QK_K), scale, -4 * scale


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 groups of 16: group g = 8 h + 2 j + p takes bits 2j of qs bytes 32 h + 16 p + l; byte g
    of the scales holds its scale (low nibble, times d) and minimum (high nibble, times -dmin)."""
    sc, qs, d, dmin = b[..., :16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    g = np.arange(16)
    h, j, p = g // 8, (g % 8) // 2, g % 2
    q = (qs[..., (32 * h + 16 * p)[:, None] + np.arange(16)] >> (2 * j)[:, None].astype(np.uint8)) & 3
    return (q.reshape(*b.shape[:-1], QK_K), d[..., None] * (sc & 0x0F).astype(np.float32),
            -dmin[..., None] * (sc >> 4).astype(np.float32))


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


UNPACK = {"Q8_0": (_q8_0, 32, 8), "Q4_0": (_q4_0, 32, 4), "Q4_1": (_q4_1, 32, 4), "Q5_0": (_q5_0, 32, 8),
          "Q5_1": (_q5_1, 32, 8), "IQ4_NL": (_iq4_nl, 32, 4), "IQ4_XS": (_iq4_xs, 32, 4),
          "Q4_K": (_q4_k, 32, 4), "Q5_K": (_q5_k, 32, 8), "Q6_K": (_q6_k, 16, 8), "Q3_K": (_q3_k, 16, 8),
          "Q2_K": (_q2_k, 16, 8)}
LOOKUP_TYPES = ("IQ4_NL", "IQ4_XS")  # unpacked into the table layout
TWO_LEVEL = {"IQ4_XS": QK_K // 32}  # the types held as super-scale times sub-scale: groups per super-block
# each type's (bits, group, lookup, super_groups) as decompose gives it, which the loader and the
# memory plan start from (part_format: a column order may narrow super_groups)
FORMATS = {t: (bits, group, t if t in LOOKUP_TYPES else None, TWO_LEVEL.get(t))
           for t, (_, group, bits) in UNPACK.items()}
# the types held in more bits than the file stores them (see above): the loader names them
WIDENED = ("Q5_0", "Q5_1", "Q3_K", "Q2_K")


def decompose(qtype: str, blocks: np.ndarray, shape: tuple[int, int]) -> GroupCodes:
    """The GGUF blocks (uint8 [rows, bytes per row]) of a [rows, cols] weight as group codes."""
    if qtype not in UNPACK:
        raise CheckpointError(f"GGUF type {qtype} has no group-wise form; supported: {', '.join(UNPACK)}")
    rows, cols = shape
    if cols % BLOCK_ELEMS[qtype] or blocks.shape != (rows, cols // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]):
        raise CheckpointError(f"{qtype} blocks of shape {blocks.shape} do not hold a {rows}x{cols} weight")
    unpack, group, bits = UNPACK[qtype]
    raw = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    codes, scale, minimum = unpack(raw)
    groups = cols // group
    return GroupCodes(np.ascontiguousarray(codes.reshape(rows, cols), dtype=np.uint8),
                      scale.reshape(rows, groups).astype(np.float32),
                      None if minimum is None else minimum.reshape(rows, groups).astype(np.float32), group, bits,
                      FORMATS[qtype][2], _f16(raw[..., :2]) if qtype in TWO_LEVEL else None)


def super_groups(qtype: str, order: Optional[np.ndarray]) -> Optional[int]:
    """The groups under one super-scale of a TWO_LEVEL tensor of `qtype` whose HF column j is
    stored column `order[j]` (None: in order): its stored super-blocks', or where the order brings
    groups of different ones together the most (a power of two) whose every run of reordered
    groups lies in one stored super-block. None: not TWO_LEVEL."""
    most = TWO_LEVEL.get(qtype)
    if most is None or order is None:
        return most
    width = most * UNPACK[qtype][1]  # a stored super-block's columns
    kept = most
    while kept > 1:
        block = order.reshape(-1, kept * UNPACK[qtype][1]) // width
        if np.all(block == block[:, :1]):
            break
        kept //= 2
    return kept


def part_format(qtype: str, order: Optional[np.ndarray]) -> tuple[int, int, Optional[str], Optional[int]]:
    """FORMATS' entry of a tensor of `qtype` stored in column order `order` (super_groups)."""
    bits, group, lookup, _ = FORMATS[qtype]
    return bits, group, lookup, super_groups(qtype, order)


def widen(c: GroupCodes) -> GroupCodes:
    """Table-layout codes as the affine 8-bit ones of the same weights (codes T[q] + 128,
    minimum -128 scale); other codes as they are."""
    if c.lookup is None:
        return c
    scale = group_scales(c)
    return GroupCodes((IQ4_VALUES[c.codes] + 128).astype(np.uint8), scale, -128 * scale, c.group, 8)


def group_codes(t: QuantizedTensor) -> GroupCodes:
    """decompose, then the tensor's column order (qwen35's out_proj): it moves whole groups, so
    the codes' columns and the groups' scales and minimums move with them, and each reordered
    super-block (super_groups) takes the super-scale of the stored one its groups come from."""
    out = decompose(t.qtype, t.blocks, t.shape)
    order: Optional[np.ndarray] = t.column_order
    if order is None:
        return out
    starts = order.reshape(-1, out.group)
    if np.any(starts[:, 0] % out.group) or np.any(starts - starts[:, :1] != np.arange(out.group)):
        raise CheckpointError(f"{t.name}: its column order splits the {out.group}-wide groups of {t.qtype}")
    moved = starts[:, 0] // out.group
    superscale = out.superscale
    if superscale is not None:
        most, kept = TWO_LEVEL[t.qtype], super_groups(t.qtype, order)
        superscale = superscale[:, moved[::kept] // most]
    return GroupCodes(np.ascontiguousarray(out.codes[:, order]), out.scale[:, moved],
                      None if out.minimum is None else out.minimum[:, moved], out.group, out.bits, out.lookup,
                      superscale)
