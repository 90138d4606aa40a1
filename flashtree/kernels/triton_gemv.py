"""The int8 GEMV (one row of x: the AR step) as a Triton kernel over wide row tiles: what
kernels/reference.py `quant_linear` computes, for the format of models/quant.py. (Int4's one row
goes to the tensor-core GEMM, kernels/triton_quant.py, which its layout is made for.)

A GEMV is bound by memory: every code is read once and used once. The kernel is laid out so that
a warp reads long contiguous runs of a row (a thread 16 bytes, its lanes 512 bytes of one row,
BLOCK_G groups) and so that every thread holds whole 16-byte pieces of the rows it owns: no data
moves between threads inside the K loop except one small exchange of the scales. x is
regrouped by code position first (XP[j, word] = x[word * PER + j], float32), so that the
entries a thread needs for code j of its words are one vector; the loads of x repeat per row
in the source and the compiler keeps one of each.

A code becomes a float without a conversion instruction (code_value: one masked or puts it in
the mantissa under a fixed exponent, one subtraction removes the exponent's value). Even so the
instructions are not what bounds the kernel but the bytes in flight (`python
benchmarks/quant_sass.py` counts the one, `python benchmarks/quant_gemv.py` times the kernel):
STAGES > 1 has the compiler's pipeliner issue the next iterations' loads ahead (through
shared memory) so that they are in flight while this one computes.

The launcher reads no device value on the host and allocates with torch only, so a forward that
calls it can be captured in a CUDA graph."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_options, pdl_start
from .triton_split import split_for, split_outputs, split_range, store_split


@triton.jit
def code_value(lo, hi, J: tl.constexpr, ASM: tl.constexpr = False, BITS: tl.constexpr = 8,
               OFFSET: tl.constexpr = 0):
    """Code J of each int32 word minus OFFSET as a float32, exactly, by one masked or and one
    subtraction: BITS-bit codes, code J at bits BITS * J (8-bit codes: J 0-3; 4-bit: J 0-7). The
    codes of a word's low half are read in place from `lo` (the word), those of its high half from
    `hi` (the word >> 16), so a code sits at bits P = BITS * (J mod (16 / BITS)) <= 15 and under
    the exponent of 2**(23 - P) it is worth exactly its value: v = 2**(23 - P) + code, and subtracting
    2**(23 - P) + OFFSET (exact in float32) leaves code - OFFSET. A shift per code would cost an
    integer op, which runs at half the float rate. ASM writes the masked or as one lop3 (truth
    table 0xEA), which Triton 3.6 builds as two (benchmarks/quant_sass.py); CUDA only, as the
    interpreter runs no PTX."""
    HALF: tl.constexpr = 16 // BITS  # codes a 16-bit half holds
    P: tl.constexpr = BITS * (J % HALF)
    MAGIC: tl.constexpr = (127 + 23 - P) << 23
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    BASE: tl.constexpr = float(2 ** (23 - P) + OFFSET)
    w = lo if J < HALF else hi
    if ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [w, tl.full(w.shape, MASK, tl.int32), tl.full(w.shape, MAGIC, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (w & MASK) | MAGIC
    return bits.to(tl.float32, bitcast=True) - BASE


@triton.jit
def _gemv_kernel(XP, C, S, MN, B, OUT, P, LOCKS, N, K, stride_c, stride_s, stride_p, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, HAS_BIAS: tl.constexpr, REGROUPED: tl.constexpr,
                 ASM: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """OUT[n] = the sum over k of X[k] W[n, k] for BLOCK_N rows n, over this program's part of K
    when K is split (float32 partials P, added by store_split). The codes
    are read as a [BLOCK_N, BLOCK_G, words of a group] tile of int32 words (code j of a word at
    bits 8j, k = 4 word + j), BLOCK_G whole groups a row an iteration; per word a partial
    dot over its codes, then scale * dot + minimum * sum(x) per word, summed over words once at
    the end. The launcher makes K a whole number of BLOCK_G groups. Without REGROUPED, XP is x
    itself, read per code position with a stride (no copy kernel before this one)."""
    pdl_start(PDL)
    PER: tl.constexpr = 4  # codes a word
    GW: tl.constexpr = GROUP // PER
    words = K // PER
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    gi = tl.arange(0, BLOCK_G)
    word = gi[:, None] * GW + tl.arange(0, GW)[None, :]
    n_blocks = K // (GROUP * BLOCK_G)
    b_lo, b_hi = split_range(n_blocks)
    codes = C + rows[:, None, None] * stride_c + word[None, :, :]
    # Without pipelining x's pointers repeat over rows (stride 0), so that x loads in the codes'
    # own layout; pipelined, x is staged once in shared memory, read from there in that layout
    if STAGES > 1:
        xs_at = XP + (word * (1 if REGROUPED else PER))[None, :, :]
    else:
        xs_at = XP + (word[None, :, :] + rows[:, None, None] * 0) * (1 if REGROUPED else PER)
    scales = rows[:, None] * stride_s + gi[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_G, GW], dtype=tl.float32)
    for blk in tl.range(b_lo, b_hi, num_stages=STAGES):
        c = tl.load(codes + blk * (BLOCK_G * GW), mask=row_ok[:, None, None], other=0)
        s = tl.load(S + scales + blk * BLOCK_G, mask=row_ok[:, None], other=0.0).to(tl.float32)
        m = tl.load(MN + scales + blk * BLOCK_G, mask=row_ok[:, None], other=0.0).to(tl.float32)
        hi = c >> 16
        part = tl.zeros([BLOCK_N, BLOCK_G, GW], dtype=tl.float32)
        xs = tl.zeros([BLOCK_N, BLOCK_G, GW], dtype=tl.float32)
        for j in tl.static_range(PER):
            if REGROUPED:
                x = tl.load(xs_at + j * words + blk * (BLOCK_G * GW))
            else:
                x = tl.load(xs_at + j + blk * (BLOCK_G * GROUP)).to(tl.float32)
            part += code_value(c, hi, j, ASM) * x
            xs += x
        acc += s[:, :, None] * part + m[:, :, None] * xs
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            out += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    store_split(out, OUT, P, LOCKS, rows, row_ok, stride_p)


def gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: int = 16, block_words: int = 128,
         split: Optional[int] = None, num_warps: int = 2, num_stages: int = 3, regroup: bool = True,
         asm: Optional[bool] = None) -> torch.Tensor:
    """x [1, K] (contiguous) -> [1, N] for int8 codes (`bits` 8). `block_n` rows a program, about
    `block_words` int32 words of each row an iteration (whole groups, a power of two of them
    dividing K's groups), `split` programs along K (triton_split.py; by default about two
    programs an SM): the benchmark's knobs (benchmarks/quant_gemv.py). `regroup` copies x by code position first
    (one small kernel) so that the kernel reads it as vectors; `num_stages` loads that many
    iterations ahead; `asm` (CUDA's default) writes each code's masked or as one lop3. The
    defaults are the sweep's fastest over all of a 27B's and an 8B's linears (`python
    benchmarks/quant_gemv.py` sweeps them)."""
    if bits != 8:
        raise ValueError(f"the GEMV reads int8 codes; int{bits} goes to the GEMM (kernels/triton_quant.py)")
    asm = x.is_cuda if asm is None else asm
    if asm and not x.is_cuda:
        raise ValueError("asm=True runs inline PTX, which needs CUDA")
    n, k = scale.shape[0], x.shape[-1]
    per = 4  # codes an int32 word
    groups = k // group
    block_g = 1 << max(0, (block_words * per // group).bit_length() - 1)
    while groups % block_g:
        block_g //= 2
    xp = x
    if regroup:
        xp = torch.empty(per, k // per, dtype=torch.float32, device=x.device)
        xp.copy_(x.view(k // per, per).t())
    programs = triton.cdiv(n, block_n)
    split = split_for(split, programs, groups // block_g, x.device)
    out, partials, locks = split_outputs(1, n, split, programs, x)
    words = codes.view(torch.int32)
    _gemv_kernel[(programs, split)](
        xp, words, scale, minimum, bias if bias is not None else scale, out, partials, locks, n, k,
        words.stride(0), scale.stride(0), n, GROUP=group, BLOCK_N=block_n,
        BLOCK_G=block_g, HAS_BIAS=bias is not None, REGROUPED=regroup, ASM=asm, STAGES=num_stages,
        num_warps=num_warps, **launch_options(x.device))
    return out
