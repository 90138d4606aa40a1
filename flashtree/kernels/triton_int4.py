"""Int4's layout read in registers, for the quantized GEMM (triton_quant.py) and prefill's
dequantization (triton_dequant.py): where a unit of a tiled or row-major matrix lies (tiled_at,
group_at), a run's column of scales (run_column), a 16-bit word's four codes as 16-bit
weights by inline PTX (quad_values, scaled_codes), and a run's dot with x (run_dot, the GEMM's
int4 step).

The stored layout (runs of 128 codes as 32 words, word i holding codes i, 32 + i, 64 + i, 96 +
i; models/quant_format.py) is made for the PTX: one lop3 turns two words' nibble r into two
packed 16-bit values under an exponent, cheaper than converting each code, and packed fmas scale
those into weights in x's dtype. On CUDA the engine tiles int4 (models/quant.py
tile_for_kernels; reference.tile_rows) in blocks of TILE rows, which tiled_at addresses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import TILE_ROWS

MAGIC_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # x's dtype: its PTX (0: none)
TILE = tl.constexpr(TILE_ROWS)


def _quad_ptx(magic: int) -> str:
    """The PTX of quad_values for one 16-bit kind: two 16-bit words of four int4 codes (models/
    quant_format.py's layout) in $4, and per nibble position r one lop3 that keeps nibble r of both words
    (after a shift by 4r) under the kind's `magic` exponent, so that each half of output $r is
    magic + h exactly: 3 shifts and 4 lop3 for 8 codes."""
    shifts = "".join(f"shr.u32 t{r}, $4, {4 * r};\n" for r in (1, 2, 3))
    masks = "".join(f"lop3.b32 ${r}, {'$4' if r == 0 else f't{r}'}, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA;\n"
                    for r in range(4))
    return "{\n.reg .b32 t1, t2, t3;\n" + shifts + masks + "}"


# the 16-bit pattern whose low nibble h makes the value magic + h, per kind: bfloat16 128 + h (128
# has a unit step in bfloat16's 8-bit significand), float16 1024 + h
MAGIC_BITS = {1: 0x4300, 2: 0x6400}
QUAD_PTX = {kind: _quad_ptx(bits) for kind, bits in MAGIC_BITS.items()}


@triton.jit
def quad_values(w, PTX: tl.constexpr, DTYPE: tl.constexpr):
    """The four codes of each int16 word w (nibble r at bits 4r) as four tensors in DTYPE
    (bfloat16 or float16), magic + h (QUAD_PTX of the kind), two words a PTX instance."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,=r,=r,r", [w], dtype=(DTYPE.value,) * 4,
                                     is_pure=True, pack=2)


# the packed 16-bit fmas of scaled_codes, per kind (1 bfloat16, 2 float16): $1 the values magic + h,
# $2 the scale, $3 the offset; the first fma centres the values (h - 8, exact)
SCALE_PTX = {kind: "{\n.reg .b32 t, one, neg;\n"
             f"mov.b32 one, 0x{one:04X}{one:04X};\nmov.b32 neg, 0x{neg:04X}{neg:04X};\n"
             f"fma.rn.{t}x2 t, $1, one, neg;\nfma.rn.{t}x2 $0, t, $2, $3;\n}}"
             for kind, t, one, neg in ((1, "bf16", 0x3F80, 0xC308), (2, "f16", 0x3C00, 0xE408))}


@triton.jit
def scaled_codes(v, s, m, ASM: tl.constexpr, PTX: tl.constexpr):
    """A slice's weights h * scale + minimum from its codes v (quad_values' magic + h with ASM,
    else h itself), the scale s and minimum m per row ([BLOCK_N] float32), in v's dtype. With
    ASM two packed 16-bit fmas per two weights (PTX: SCALE_PTX of the kind), (h - 8) * scale +
    (minimum + 8 * scale), scale and offset rounded to that dtype first: centring the codes makes
    the offset about the group's centre, small, so that its rounding costs little (one fma with
    the offset minimum - magic * scale has several times the definition's error in bfloat16,
    this under twice it: `python benchmarks/quant_gemv.py --sweep scaled` records each's error).
    Else in float32, rounded once (the interpreter's path)."""
    if ASM:
        sv = tl.broadcast_to(s.to(v.dtype)[:, None], v.shape)
        cv = tl.broadcast_to((m + 8.0 * s).to(v.dtype)[:, None], v.shape)
        return tl.inline_asm_elementwise(PTX, "=r,r,r,r", [v, sv, cv], dtype=v.dtype, is_pure=True, pack=2)
    return (v.to(tl.float32) * s[:, None] + m[:, None]).to(v.dtype)


@triton.jit
def tiled_at(rn, N, stride, unit, UNIT: tl.constexpr, TILED: tl.constexpr):
    """Where unit `unit` (UNIT elements) of rows rn of a matrix [N, stride] begins: row major,
    or with TILED in blocks of TILE rows stored unit-major (reference.tile_rows; the last block
    has N mod TILE rows)."""
    if TILED:
        first = rn - rn % TILE
        return first * stride + unit * (tl.minimum(N - first, TILE) * UNIT) + (rn % TILE) * UNIT
    return rn * stride + unit * UNIT


@triton.jit
def group_at(rn, N, stride, g, GROUP: tl.constexpr, RUN: tl.constexpr, TILED: tl.constexpr):
    """Where group g's scale (or minimum) of rows rn lies in a matrix [N, stride] of them: row
    major, or with TILED in tiled_at's order in units of a run's groups (reference.int4_scale_unit)."""
    UNIT: tl.constexpr = RUN // GROUP if GROUP < RUN else 1
    return tiled_at(rn, N, stride, g // UNIT, UNIT, TILED) + g % UNIT


@triton.jit
def run_column(x, C: tl.constexpr, COLS: tl.constexpr):
    """Column C of x [rows, COLS] (COLS 2 or 4: a run's groups) as [rows], split in registers."""
    if COLS == 2:
        first, second = tl.split(x)
        out = first if C == 0 else second
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], 2, 2]))  # columns 0, 2 and 1, 3
        low, high = tl.split(even if C % 2 == 0 else odd)
        out = low if C < 2 else high
    return out


@triton.jit
def _slice_dot(acc, w, X, rm, m_ok, stride_xm, k0, SLICE: tl.constexpr):
    """acc + the dot of one int4 slice's SLICE weights a row (w, in x's dtype) with x's columns
    k0..k0+SLICE-1."""
    xt = tl.load(X + rm[None, :] * stride_xm + (k0 + tl.arange(0, SLICE))[:, None], mask=m_ok[None, :], other=0.0)
    return tl.dot(w, xt, acc)


@triton.jit
def run_dot(acc, X, C, S, MN, T, rn, N, n_ok, rm, m_ok, t, s, m, n_groups, stride_xm, stride_c, stride_s,
            GROUP: tl.constexpr, RUN: tl.constexpr, TILED: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
            SPTX: tl.constexpr, TABLE: tl.constexpr, SUPER: tl.constexpr):
    """acc [rows rn, rows rm of x] + the dot of run t of rows rn's int4 codes C (int16 words;
    tiled_at's layout with TILED) with x's columns of that run: the run's four slices, nibble r of
    its words holding slice r (RUN/4 consecutive columns), each made into weights in x's dtype
    and dotted as x is loaded (the int4 step of triton_quant._gemm_kernel, which says why the
    layout and the dequantization are these). In a group of a run the scale and minimum are
    s and m (float32 [rows], the caller's); in groups under a run, the run's are loaded here as one
    [rows, RUN/GROUP] tile. With TABLE a weight is T[code] * scale (no minimum; SUPER: IQ4_XS's
    super-scales in MN, row major, SUPER groups each)."""
    SLICE: tl.constexpr = RUN // 4
    w = tl.load(C + tiled_at(rn, N, stride_c, t, SLICE, TILED)[:, None] + tl.arange(0, SLICE)[None, :],
                mask=n_ok[:, None], other=0)
    if GROUP < RUN:  # the run's groups' scales and minima, one contiguous piece a row
        ga = tiled_at(rn, N, stride_s, t, RUN // GROUP, TILED)[:, None] + tl.arange(0, RUN // GROUP)[None, :]
        s_run = tl.load(S + ga, mask=n_ok[:, None], other=0.0).to(tl.float32)
        if SUPER > 0:  # each group's super-scale times its sub-scale: exact in float32
            sg = (t * (RUN // GROUP) + tl.arange(0, RUN // GROUP)) // SUPER
            da = rn[:, None] * (n_groups // SUPER) + sg[None, :]
            s_run = s_run * tl.load(MN + da, mask=n_ok[:, None], other=0.0).to(tl.float32)
        if not TABLE:
            m_run = tl.load(MN + ga, mask=n_ok[:, None], other=0.0).to(tl.float32)
    if ASM:
        quads = quad_values(w, PTX, X.dtype.element_ty)
    else:
        w = w.to(tl.int32)
    for r in tl.static_range(4):  # slice r: nibble r of the run's words
        if GROUP < RUN:  # slice r's group's column of the run's
            s_r = run_column(s_run, r * SLICE // GROUP, RUN // GROUP)
            if not TABLE:
                m_r = run_column(m_run, r * SLICE // GROUP, RUN // GROUP)
        else:
            s_r = s
            m_r = m
        if TABLE:  # the codes' table values times the scale, in float32, rounded once
            wr = (tl.load(T + ((w >> (4 * r)) & 15)) * s_r[:, None]).to(X.dtype.element_ty)
        else:
            if ASM:
                v = quads[r]
            else:  # the codes themselves, exact in any float dtype
                v = ((w >> (4 * r)) & 15).to(X.dtype.element_ty)
            wr = scaled_codes(v, s_r, m_r, ASM, SPTX)
        acc = _slice_dot(acc, wr, X, rm, m_ok, stride_xm, t * RUN + r * SLICE, SLICE)
    return acc
