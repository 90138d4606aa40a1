"""How the attention kernels (triton_attention.py) read a KV cache's rows in registers: through
a page table (pool_rows), and dequantized from how a side is stored (load_rows; kv_storage.py
defines the kinds), q8_0's and q4_0's codes as int32 words (code_words).

The dequantizing is most of what a decode step's attention over a long quantized cache
executes (its few query rows make the dots small), so a code becomes a float without a byte
extraction, shift or int-to-float conversion (code_value's masked or and subtraction)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_storage import PAGE_ROWS as _PAGE_ROWS
from .kv_storage import Q4, Q8
from .triton_gemv import code_value

PAGE_ROWS = tl.constexpr(_PAGE_ROWS)  # rows of a KV page, as the kernels read a page table
SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: the sign bit of each of a word's bytes


def code_words(codes: torch.Tensor, kind: int) -> torch.Tensor:
    """A side's codes in the unit load_rows reads them in: q8_0's and q4_0's as int32 words (of
    four and eight codes; strides then count words), any other kind's as they are."""
    return codes.view(torch.int32) if kind in (Q8, Q4) else codes


@triton.jit
def pool_rows(PAGES, rows, ok, PAGED: tl.constexpr):
    """The pool rows of a key block's logical `rows` through the page table (read where `ok`:
    rows past a sequence's table are never read), or the rows themselves when not PAGED. One
    return: the compiler wants every return of a function to agree in type."""
    at = rows
    if PAGED:  # int64: a pool's rows times the row stride pass 2^31
        at = tl.load(PAGES + rows // PAGE_ROWS, mask=ok, other=0).to(tl.int64) * PAGE_ROWS + rows % PAGE_ROWS
    return at


@triton.jit
def load_rows(codes, scales, cols, stride_n, stride_sn, d, first, ok, DT: tl.constexpr, KIND: tl.constexpr,
               MASKED: tl.constexpr, ASM: tl.constexpr = False):
    """Rows `cols` of one KV head as DT values [BLOCK_N, D], dims first..first + D (D = d's
    length), dequantized from how they are stored (`ok`: which rows exist, read only when
    MASKED). Each block's scale loads once, broadcast over its 32 values by a reshape: one load
    an element would be a gather of a scale. `first` is a multiple of 32 (whole blocks).

    q8_0 and q4_0 codes come as int32 words (the launcher's view, code_words: code r of word j
    is dim PER * j + r, at bits 32 / PER * r) and become floats by code_value's masked or and
    subtraction (q8_0's signed bytes first offset by 128, one xor a word), each code position
    one tensor, joined back into dim order: no byte extraction, shift or int-to-float
    conversion an element, which made the dequantizing, not the loads, what a decode step's
    attention over a long quantized cache spent its instructions on. A value is code * scale
    (q4_0: (code - 8) * scale) in float32, exact, rounded once to DT, as
    kv_storage.dequantize_kv defines it. q4_0 with bfloat16 scales in a bfloat16 kernel (a
    bfloat16 model's cache, kv_storage.scale_dtype) compiled for CUDA (ASM) takes _q4_packed
    instead: the same values from packed bfloat16 arithmetic, two a register, about half the
    instructions a value."""
    D: tl.constexpr = d.shape[0]
    BN: tl.constexpr = cols.shape[0]
    PER: tl.constexpr = 8 if KIND == 3 else 4 if KIND == 2 else 1  # values a loaded code element holds
    at = cols[:, None] * stride_n + first // PER + tl.arange(0, D // PER)[None, :]
    if MASKED:
        raw = tl.load(codes + at, mask=ok[:, None], other=0)
    else:
        raw = tl.load(codes + at)
    if KIND == 0:
        values = raw.to(DT)
    elif KIND == 1:
        values = raw.to(tl.float8e4nv, bitcast=True).to(DT)
    else:
        s_at = cols[:, None] * stride_sn + first // 32 + tl.arange(0, D // 32)[None, :]
        if MASKED:
            scale = tl.load(scales + s_at, mask=ok[:, None], other=0.0)
        else:
            scale = tl.load(scales + s_at)
        # joins append an axis: [BN, D / PER, a, b(, c)] holds code 2a + b (4a + 2b + c), dim PER * j + that
        s = tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BN, D // 32, 32 // PER)).reshape(BN, D // PER)
        if KIND == 3 and ASM and scales.dtype.element_ty == DT and DT == tl.bfloat16:
            values = _q4_packed(raw, scale, BN, D)
        elif KIND == 3:
            hi = raw >> 16
            v0 = code_value(raw, hi, 0, ASM, 4, 8) * s
            v1 = code_value(raw, hi, 1, ASM, 4, 8) * s
            v2 = code_value(raw, hi, 2, ASM, 4, 8) * s
            v3 = code_value(raw, hi, 3, ASM, 4, 8) * s
            v4 = code_value(raw, hi, 4, ASM, 4, 8) * s
            v5 = code_value(raw, hi, 5, ASM, 4, 8) * s
            v6 = code_value(raw, hi, 6, ASM, 4, 8) * s
            v7 = code_value(raw, hi, 7, ASM, 4, 8) * s
            values = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        else:
            lo = raw ^ SIGN_BITS  # each signed byte + 128, as an unsigned byte
            hi = lo >> 16
            v0 = code_value(lo, hi, 0, ASM, 8, 128) * s
            v1 = code_value(lo, hi, 1, ASM, 8, 128) * s
            v2 = code_value(lo, hi, 2, ASM, 8, 128) * s
            v3 = code_value(lo, hi, 3, ASM, 8, 128) * s
            values = tl.join(tl.join(v0, v2), tl.join(v1, v3))
        values = values.reshape(BN, D).to(DT)
    return values


@triton.jit
def _q4_pair(raw, raw4, sel, s2):
    """Codes 2i and 2i + 1 of each int32 word of q4_0 codes (byte i's low and high nibble; `sel`
    the byte permutation that puts byte i of the word and of the word >> 4 in bytes 0 and 2) as
    two bfloat16 values, (code - 8) * scale, by packed bfloat16 ops: each nibble placed under the
    exponent of 128 by one lop3, 136 taken away exactly, then one multiply by the block's scale
    pair s2 (its bits twice), which rounds the exact product once, as the float32 definition
    rounds it. (A float16 model keeps the float32 path: no packed float16 path is tested on a
    GPU.)"""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, one, base, nz; mov.b32 one, 0x3F803F80; mov.b32 base, 0xC308C308; mov.b32 nz, 0x80008000; "
        "prmt.b32 t, $2, $3, $4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, base; "
        "fma.rn.bf16x2 t, t, $5, nz; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r,r", [raw, raw4, sel, s2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _q4_packed(raw, scale, BN: tl.constexpr, D: tl.constexpr):
    """q4_0 words [BN, D / 8] with their bfloat16 scales [BN, D / 32] as bfloat16 values [BN, D] in dim
    order (code r of word j is dim 8 j + r): each pair of neighbouring dims comes out of one
    packed register, already in the order the dots read them."""
    bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = bits | (bits << 16)
    s2 = tl.broadcast_to(s2[:, :, None], (BN, D // 32, 4)).reshape(BN, D // 8)
    raw4 = raw >> 4
    a0, b0 = _q4_pair(raw, raw4, tl.full(raw.shape, 0x4400, tl.int32), s2)
    a1, b1 = _q4_pair(raw, raw4, tl.full(raw.shape, 0x5511, tl.int32), s2)
    a2, b2 = _q4_pair(raw, raw4, tl.full(raw.shape, 0x6622, tl.int32), s2)
    a3, b3 = _q4_pair(raw, raw4, tl.full(raw.shape, 0x7733, tl.int32), s2)
    # dims 8 j + (4 i1 + 2 i0 + h) of pair i = 2 i1 + i0, h its half: the outermost join is the fastest axis
    values = tl.join(tl.join(tl.join(a0, a2), tl.join(a1, a3)), tl.join(tl.join(b0, b2), tl.join(b1, b3)))
    return values.reshape(BN, D)
