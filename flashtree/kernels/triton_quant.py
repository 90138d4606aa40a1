"""The small-M GEMM of group-wise quantized linears on tensor cores (a verified tree or a draft
block, the AR step's int4 row, M up to 64; kernels/reference.py `quant_linear` is what it
computes).

Like the GEMV it reads the packed codes once and dequantizes in registers, never materialising a
dense weight. Int8: over one group the scale and minimum are constants, so x . w = scale *
(x . codes) + minimum * sum(x), one multiply-add per group instead of one per weight, and the
codes go into the dot converted to x's dtype as they are (integers to 256 are exact in it): one
dot a group, faster over a 27B's int8 lm_head at 23 rows than two, one a nibble, each nibble
placed under 1.0's exponent by bit operations (bfloat16's 7 stored mantissa bits hold a nibble
and not a byte). In groups under 128 (GGUF's Q8_0, Q5_K and Q6_K) that epilogue comes too
often, and int8 scales its codes into weights instead, a step's codes, scales and minima loaded
as whole tiles (INT8_SCALED_BELOW: several times faster than the epilogue over a 27B's Q6_K
lm_head at 23 rows). Int4 instead scales its codes into weights in x's 16-bit dtype with packed
fmas (scaled_codes), so that the dots accumulate across groups and need neither sum(x) nor a
per-group epilogue: faster over a 27B's linears at one row and at 23 than with int8's epilogue
(`python benchmarks/quant_gemv.py --sweep scaled` compares them). Int4's stored layout is
made for this kernel (triton_int4.py turns its words into weights by inline PTX), and what
nibble r of a run's words holds is 32 consecutive columns, so x is dotted as it is loaded. On
CUDA the engine tiles int4 (models/quant.py tile_for_kernels; reference.tile_rows): a program's
step of 64 rows then reads one contiguous 4 KB of codes instead of 64 pieces of 64 bytes
(triton_int4.tiled_at), which shortens a 27B's AR step (`python benchmarks/int4_layout.py`
compares the layouts). The table layout (GGUF's IQ4_NL / IQ4_XS: int4 codes in the same runs,
indices into a 16-entry table, and a scale alone; models/quant_format.py) takes int4's path
with its dequantization replaced by a lookup of each code in the table (a 64-byte global tensor,
read through the cache) times the group's scale, in float32, rounded once to x's dtype: the
definition's weights exactly. IQ4_XS's scale
has two levels, an int8 sub-scale per group times a float16 super-scale per few groups (row
major, never tiled: a row's few are read from the same cache lines step after step); their
product, exact in float32, is the group's scale, so both IQ4 types share the one path.

The launcher reads no device value on the host and allocates with torch only (the output, int8's
group sums of x, and float32 partial sums when K is split; triton_split.py), so a forward that
calls it can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant import gemm_applies, prefetch_supported
from .reference import INT4_RUN
from .triton_int4 import MAGIC_KINDS, QUAD_PTX, SCALE_PTX, run_dot, tiled_at
from .triton_pdl import launch_options, pdl_start
from .triton_prefetch import prefetch_share
from .triton_split import split_for, split_outputs, split_range, store_split


SUM_GROUPS = 16  # groups of one row of x a program of _sums_kernel sums
# The GEMM's default launches: int4 for one row (the AR step) and for more (a tree, a draft block),
# int8 for any (its one row goes to the GEMV); `split` holds triton_split.split_for's arguments,
# which pick the split along K where the caller does not. int4's are the fastest over all of a
# 27B's int4 linears in the sweep (`python benchmarks/quant_gemv.py --sweep gemm`): a tree's rows
# faster on 128 rows a program and 4 warps, one row slower there; one row's split a power of two
# for about 7.5 programs an SM, where 10 fit (faster over a 27B's and an 8B's one-row linears
# than about 4 programs an SM, whose odd splits of 7 ran slower than 4: `python
# benchmarks/gemm_splits.py`); int8's the fastest of its sweep's launches
GEMM_LAUNCH = {"int4 one row": dict(block_n=64, num_warps=2, num_stages=3,
                                    split=dict(per_sm=7.5, least=4, power_of_two=True, most=16)),
               "int4 rows": dict(block_n=128, num_warps=4, num_stages=3, split=dict(per_sm=4, least=4)),
               "int8": dict(block_n=64, num_warps=4, num_stages=3, split=dict(per_sm=2, least=1))}


def gemm_launch(bits: int, rows: int) -> dict:
    """The GEMM's default launch for `rows` rows of x of `bits`-bit codes (GEMM_LAUNCH)."""
    return GEMM_LAUNCH["int8" if bits == 8 else "int4 one row" if rows == 1 else "int4 rows"]


# int8 groups below this scale their codes into weights in x's dtype before the dots (SCALE8),
# several groups an iteration; from it on, one group an iteration and a per-group epilogue.
# Compiled for sm_90 at 23 rows the epilogue costs 24.9 SASS instructions a code in groups of 16
# (GGUF's Q6_K) and 13.8 in 32 (Q8_0, Q5_K), scaling 5.9 and 5.7 over steps of 128; in groups of
# 128 the epilogue's 5.6 is the fewer. Timed, scaling is the faster in groups of 16 and 32
# (`python benchmarks/quant_gemv.py --sweep scaled --group 32`)
INT8_SCALED_BELOW = 128
INT8_SCALED_STEP = 128  # the most K a scaling iteration takes


def int8_scales(group: int, asked: Optional[bool] = None) -> bool:
    """Whether the int8 GEMM scales its codes into weights: as `asked`, else in groups under
    INT8_SCALED_BELOW."""
    return group < INT8_SCALED_BELOW if asked is None else asked


def int8_step(group: int, k: int, scaled: Optional[bool] = None) -> int:
    """The K of one iteration of the int8 GEMM over an input of width k: the group, or where
    the codes are scaled (int8_scales) the largest multiple of the group up to
    INT8_SCALED_STEP that divides k."""
    step = group
    while int8_scales(group, scaled) and 2 * step <= INT8_SCALED_STEP and k % (2 * step) == 0:
        step *= 2
    return step


def gemm_split(bits: int, rows: int, n: int, k: int, group: int, device: torch.device,
               block_n: Optional[int] = None, split: Optional[int] = None, scaled: Optional[bool] = None) -> int:
    """Programs along K of the GEMM of `rows` rows of x and an [n, k] weight of `bits`-bit codes
    in groups of `group`, `block_n` rows a program (the launch's by default): `split` if given,
    else the launch's rule (GEMM_LAUNCH's `split`, triton_split.split_for), at most K's steps
    (int8_step's with `scaled`)."""
    chosen = gemm_launch(bits, rows)
    step = int8_step(group, k, scaled) if bits == 8 else INT4_RUN
    return split_for(split, triton.cdiv(n, block_n or chosen["block_n"]), k // step, device, **chosen["split"])


@triton.jit
def _gemm_kernel(X, GS, C, S, MN, B, T, OUT, P, LOCKS, M, N, K, stride_xm, stride_om, stride_c, stride_s, stride_p,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
                 SPTX: tl.constexpr, RUN: tl.constexpr, TILED: tl.constexpr, SCALE8: tl.constexpr = False,
                 STEP8: tl.constexpr = 0, TABLE: tl.constexpr = False, SUPER: tl.constexpr = 0,
                 PDL: tl.constexpr = False, NEXT=0, NEXT_BYTES=0, PREFETCH: tl.constexpr = 0):
    """OUT[m, n] for a BLOCK_N x BLOCK_M tile of OUT^T = W X^T on tensor cores, over this
    program's part of K when K is split (float32 partials P, added by store_split). The weight
    is the dot's left operand, so its codes travel to the dot's register layout as they are
    stored and are dequantized there (a right operand would be staged through shared memory at
    16 bits a value). Where a step is one group, the next one's scale and minimum are loaded
    an iteration ahead.
    - int8, one group a step: the codes converted to x's dtype (exact) are dotted with x, and
      the scale and minimum applied in a per-group epilogue, scale * dot + minimum * sum(x);
      sum(x) over each group of each row of x is GS [M, K/GROUP] (float32, from _sums_kernel: a
      dot with ones would double the tensor-core work).
    - int8 with SCALE8 (small groups, INT8_SCALED_BELOW), STEP8 codes a step, several groups:
      the step's codes, scales and minima are loaded as whole tiles (rows of 128 and 16 bytes,
      which the pipeliner stages with cp.async; loaded a group at a time they were synchronous
      and the path no faster than the epilogue), each group's codes become weights code * scale
      + minimum in float32, rounded to x's dtype (what the definition's dequantization gives),
      and one dot a step accumulates across groups.
    - int4, C as int16 words of four codes, one run of RUN codes (reference.INT4_RUN, 128) a
      step: word i of a run holds its codes i, RUN/4 + i, RUN/2 + i, 3RUN/4 + i (models/
      quant_format.py), so nibble r of the run's words is the weight of a slice of RUN/4 consecutive
      columns, dotted with x's columns as loaded, no permutation of x (slices of 16, a dot of
      K 16 each, were slower at 23 rows than slices of 32). A slice lies in one group (GROUP >=
      32); in groups under a run the run's scales and minima are loaded as one [BLOCK_N, RUN /
      GROUP] tile (contiguous a row: reference.int4_scale_unit; pipelined, where a group at a
      time, 2 bytes a row, was not) and each slice takes its column (run_column). Each slice's
      weights themselves, in x's dtype
      (quad_values with ASM, PTX QUAD_PTX; scaled_codes, SPTX SCALE_PTX), go into the dots,
      which accumulate across groups: no sums of x, no per-group epilogue (which at a tree's 32
      rows cost more instructions than the dequantization; benchmarks/quant_sass.py). With TILED
      (int4) C, S and MN lie in blocks of TILE rows (reference.tile_rows), found by tiled_at.
      With TABLE (the table layout; no ASM) there is no minimum: a slice's weights are T[code] *
      scale, and with SUPER (groups under a super-scale, IQ4_XS) MN holds the super-scales [N,
      K/GROUP/SUPER], row major, and a group's scale is its S (an integer) times its MN.
    With PDL (triton_pdl.py) the program waits for the kernel before it first."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    n_groups = K // GROUP
    STEP: tl.constexpr = (STEP8 if SCALE8 else GROUP) if BITS == 8 else RUN  # the K of an iteration
    GROUPS8: tl.constexpr = STEP // GROUP  # the groups of a scaling step
    n_steps = K // STEP
    t_lo, t_hi = split_range(n_steps)
    pdl_start(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    at = tiled_at(rn, N, stride_s, t_lo, 1, TILED)
    s_next = tl.load(S + at, mask=n_ok & (rn * 0 + t_lo < t_hi), other=0.0)
    if TABLE:  # no minimum (MN, super-scales if any, is read with each run's scales)
        m_next = s_next
    else:
        m_next = tl.load(MN + at, mask=n_ok & (rn * 0 + t_lo < t_hi), other=0.0)
    for t in range(t_lo, t_hi):
        s = s_next.to(tl.float32)
        m = m_next.to(tl.float32)
        if STEP == GROUP and not SCALE8:
            at = tiled_at(rn, N, stride_s, t + 1, 1, TILED)
            s_next = tl.load(S + at, mask=n_ok & (rn * 0 + t + 1 < t_hi), other=0.0)
            if not TABLE:
                m_next = tl.load(MN + at, mask=n_ok & (rn * 0 + t + 1 < t_hi), other=0.0)
        if SCALE8:  # the step's codes, scales and minima as whole tiles; each group's codes scaled
            kk = t * STEP + tl.arange(0, STEP)
            b = tl.load(C + rn[:, None] * stride_c + kk[None, :], mask=n_ok[:, None], other=0)
            xt = tl.load(X + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :], other=0.0)
            ga = rn[:, None] * stride_s + t * GROUPS8 + tl.arange(0, GROUPS8)[None, :]
            sg = tl.load(S + ga, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
            mg = tl.load(MN + ga, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
            w = tl.reshape(tl.reshape(b, [BLOCK_N, GROUPS8, GROUP]).to(tl.float32) * sg + mg, [BLOCK_N, STEP])
            acc = tl.dot(w.to(X.dtype.element_ty), xt, acc)
        elif BITS == 8:
            kk = t * GROUP + tl.arange(0, GROUP)
            b = tl.load(C + rn[:, None] * stride_c + kk[None, :], mask=n_ok[:, None], other=0)
            xt = tl.load(X + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :], other=0.0)
            xs = tl.load(GS + rm * n_groups + t, mask=m_ok, other=0.0)[None, :]
            dots = tl.dot(b.to(X.dtype.element_ty), xt)
            acc += dots * s[:, None] + xs * m[:, None]
        else:
            acc = run_dot(acc, X, C, S, MN, T, rn, N, n_ok, rm, m_ok, t, s, m, n_groups, stride_xm, stride_c,
                          stride_s, GROUP, RUN, TILED, ASM, PTX, SPTX, TABLE, SUPER)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    store_split(acc, OUT, P, LOCKS, rm[None, :] * stride_om + rn[:, None], m_ok[None, :] & n_ok[:, None], stride_p)
    if PREFETCH > 0:  # the next linear's first NEXT_BYTES into L2, PREFETCH lanes a program
        prefetch_share(NEXT, NEXT_BYTES, PREFETCH)


@triton.jit
def _sums_kernel(X, GS, K, stride_xm, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    """For row program_id(0) of x [M, K] and BLOCK_G of its groups: each group's sum in float32
    (GS [M, K/GROUP]), what the int8 GEMM reads besides the codes."""
    pdl_start(PDL)
    m = tl.program_id(0)
    groups = K // GROUP
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < groups
    at = X + m * stride_xm + g[:, None] * GROUP + 2 * tl.arange(0, GROUP // 2)[None, :]
    xe = tl.load(at, mask=g_ok[:, None], other=0.0)
    xo = tl.load(at + 1, mask=g_ok[:, None], other=0.0)
    tl.store(GS + m * groups + g, tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1), mask=g_ok)


def gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: Optional[int] = None,
         split: Optional[int] = None, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
         asm: Optional[bool] = None, tiled: bool = False, scale_codes: Optional[bool] = None,
         table: Optional[torch.Tensor] = None, superscale: Optional[torch.Tensor] = None,
         block_m: Optional[int] = None, prefetch: Optional[tuple[torch.Tensor, int]] = None,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> [M, N] (into `out` where given: split_outputs), M <= 64 rows in
    one tile of 16, 32 or 64 (tl.dot's smallest is 16); int4 needs whole runs of its layout (K a
    multiple of reference.INT4_RUN) and groups of 32 to 128 (a slice of a run in one group, a run
    in one group or whole ones). `split` programs along K
    (triton_split.py) fill the SMs when N / block_n is few; `asm` (CUDA's
    default) dequantizes int4 by inline PTX (quad_values and scaled_codes' fmas; 16-bit
    activations only). `tiled`: int4 codes, scales and minima in reference.tile_rows' order.
    `scale_codes` (int8): scale the codes into weights rather than apply each group's scale after
    its dot; by default in groups under INT8_SCALED_BELOW. `table` (float32 [16], int4): the
    table layout, its codes looked up in it and `minimum` None (no inline PTX); `superscale`
    (float16 [N, K/group/S], rows contiguous, groups under a run): IQ4_XS's super-scales, each
    over S groups, with `scale` its int8 sub-scales. `block_m`: the tile of x's rows (by
    default the smallest of 16, 32, 64 that holds them). `prefetch` (a tensor, bytes): the
    programs end by prefetching that tensor's first bytes into L2 (triton_prefetch.py; where the
    device has bulk prefetches).
    What is not given comes from GEMM_LAUNCH (gemm_launch)."""
    rows, n, k = x.shape[0], scale.shape[0], x.shape[-1]
    if rows > 64:
        raise ValueError(f"the GEMM takes at most 64 rows a launch, got {rows}")
    if not gemm_applies(k, bits, group):
        raise ValueError(f"the int4 GEMM needs in_features a multiple of {INT4_RUN} and groups of "
                         f"{INT4_RUN // 4} to {INT4_RUN}, got {k} and {group}")
    if (tiled or table is not None) and bits != 4:
        raise ValueError("only int4 weights are tiled or looked up in a table")
    if superscale is not None and (table is None or group >= INT4_RUN or not superscale.is_contiguous()):
        raise ValueError("super-scales go with a table, in groups under a run, and are contiguous")
    chosen = gemm_launch(bits, rows)
    block_n = block_n or chosen["block_n"]
    num_warps = num_warps or chosen["num_warps"]
    num_stages = num_stages or chosen["num_stages"]
    kind = MAGIC_KINDS[x.dtype]
    asm = (x.is_cuda if asm is None else asm) and kind != 0 and table is None
    block_m = block_m or max(16, triton.next_power_of_2(rows))
    programs = triton.cdiv(n, block_n)
    scaled = bits == 8 and int8_scales(group, scale_codes)
    split = gemm_split(bits, rows, n, k, group, x.device, block_n, split, scaled)
    out, partials, locks = split_outputs(rows, n, split, programs, x, out)
    sums = x  # int4 and scaled int8 read none
    if bits == 4:
        codes = codes.view(torch.int16)  # words of four codes
    elif not scaled:
        sums = torch.empty(rows, k // group, dtype=torch.float32, device=x.device)
        _sums_kernel[(rows, triton.cdiv(k // group, SUM_GROUPS))](
            x, sums, k, x.stride(0), GROUP=group, BLOCK_G=SUM_GROUPS, **launch_options(x.device))
    second = superscale if superscale is not None else scale if minimum is None else minimum
    after = {}
    if prefetch is not None and prefetch[1] >= 16 and prefetch_supported(x.device):
        ahead, nbytes = prefetch
        after = dict(NEXT=ahead.data_ptr(), NEXT_BYTES=min(nbytes, ahead.numel() * ahead.element_size()) // 16 * 16,
                     PREFETCH=32 * num_warps)
    _gemm_kernel[(programs, split)](
        x, sums, codes, scale, second, bias if bias is not None else scale,
        scale if table is None else table, out, partials, locks, rows, n, k,
        x.stride(0), out.stride(0), codes.stride(0), scale.stride(0), rows * n,
        **gemm_constants(bits, group, block_m, block_n, kind, bias is not None, asm, tiled, k, scaled,
                         table is not None, 0 if superscale is None else k // group // superscale.shape[1]),
        num_warps=num_warps, num_stages=num_stages, **after, **launch_options(x.device))
    return out


def gemm_constants(bits: int, group: int, block_m: int, block_n: int, kind: int, has_bias: bool,
                   asm: bool, tiled: bool = False, k: int = INT8_SCALED_STEP, scaled: Optional[bool] = None,
                   table: bool = False, super_groups: int = 0) -> dict:
    """_gemm_kernel's compile-time arguments (the launcher's, and benchmarks/quant_sass.py's and
    the PTX test's compiles for sm_90) for an input of width `k`: `kind` is MAGIC_KINDS' of x's
    dtype; with `asm` int4's dequantization PTX for that kind (int8 has none); int8 `scaled`
    (by default in groups under INT8_SCALED_BELOW) scales its codes, int8_step's K an iteration;
    `table`: int4 codes looked up in a table (no `asm`), with `super_groups` (IQ4_XS) groups a
    super-scale, 0 for none."""
    scaled = bits == 8 and int8_scales(group, scaled)
    return dict(BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias, ASM=asm,
                PTX=QUAD_PTX.get(kind, "") if bits == 4 else "", SPTX=SCALE_PTX.get(kind, ""),
                RUN=INT4_RUN, TILED=tiled, SCALE8=scaled, STEP8=int8_step(group, k, scaled) if bits == 8 else 0,
                TABLE=table, SUPER=super_groups)
