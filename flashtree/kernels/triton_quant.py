"""Triton kernels for group-wise quantized linears (kernels/reference.py `quant_linear` is what
they compute): a GEMV for one row (the AR step) and a small-M GEMM on tensor cores (a verified
tree, M up to 64).

Both read the packed codes once and dequantize in registers, never materialising a dense weight.
Over one group the scale and minimum are constants, so x . w = scale * (x . codes) + minimum *
sum(x): one multiply-add per group instead of one per weight. A code becomes a float by integer
bit operations and at most one float subtraction, its bits placed under a suitable exponent
(code_value, nibble_value): the int-to-float conversion this replaces runs at a quarter of the
float rate, and integer ops at half of it, which bounds an int4 GEMV well below the memory
bandwidth on an H100/H200 unless each code costs about one integer op. Int4 codes hold the
even index in the low nibble: the GEMV reads 32-bit words and takes x regrouped by position in
a word, the GEMM dots the low nibbles with x's even entries and the high ones with its odd ones.

The launchers read no device value on the host and allocate with torch only (the output, x
regrouped, and float32 partial sums when K is split), so a forward that calls them can be
captured in a CUDA graph."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


MAGIC_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def nibble_value(b, SHIFT: tl.constexpr, KIND: tl.constexpr):
    """1 + h/16 for the 4-bit field h at bit SHIFT of each byte b, exactly, in float32 (KIND 0),
    bfloat16 (1) or float16 (2): one shift and one masked or move h under 1.0's exponent, as
    the top four bits of the mantissa (its bit TOP)."""
    TOP: tl.constexpr = 19 if KIND == 0 else (3 if KIND == 1 else 6)
    ONE: tl.constexpr = 0x3F800000 if KIND == 0 else (0x3F80 if KIND == 1 else 0x3C00)
    h = b.to(tl.int32)
    if TOP >= SHIFT:
        h = h << (TOP - SHIFT)
    else:
        h = h >> (SHIFT - TOP)
    h = (h & (15 << TOP)) | ONE
    if KIND == 0:
        return h.to(tl.float32, bitcast=True)
    elif KIND == 1:
        return h.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return h.to(tl.int16).to(tl.float16, bitcast=True)


def _nibble_pairs_ptx(low_shift: int, high_op: str, high_shift: int, mask: int, one: int) -> str:
    """The PTX of nibble_pairs for one 16-bit kind: each byte pair of the input word spread to the
    two halves of a word (prmt), then per output one shift that brings a nibble under the kind's
    top mantissa bits and one lop3 (mask, then or 1.0's bits) that makes it 1 + h/16."""
    ops = [f"shl.b32 $0, t0, {low_shift};", f"shl.b32 $1, t1, {low_shift};",
           f"{high_op} $2, t0, {high_shift};", f"{high_op} $3, t1, {high_shift};"]
    body = "\n".join(f"{op}\nlop3.b32 ${i}, ${i}, 0x{mask:08X}, 0x{one:08X}, 0xEA;" for i, op in enumerate(ops))
    return "{\n.reg .b32 t0, t1;\nprmt.b32 t0, $4, 0, 0x4140;\nprmt.b32 t1, $4, 0, 0x4342;\n" + body + "\n}"


# bfloat16 keeps h at mantissa bits 3-6 (the low nibble moves up 3, the high one down 1), float16
# at bits 6-9 (up 6 and up 2).
NIBBLE_PAIRS_PTX = {1: _nibble_pairs_ptx(3, "shr.u32", 1, 0x00780078, 0x3F803F80),
                    2: _nibble_pairs_ptx(6, "shl.b32", 2, 0x03C003C0, 0x3C003C00)}


@triton.jit
def nibble_pairs(b, PTX: tl.constexpr, DTYPE: tl.constexpr):
    """nibble_value(b, 0) and nibble_value(b, 4) in DTYPE (bfloat16 or float16) by PTX on four
    bytes at a time (PTX is NIBBLE_PAIRS_PTX of the kind), about a third of the integer ops of
    nibble_value."""
    lo, hi = tl.inline_asm_elementwise(PTX, "=r,=r,=r,=r,r", [b], dtype=(DTYPE.value, DTYPE.value),
                                       is_pure=True, pack=4)
    return lo, hi


@triton.jit
def code_value(lo, hi, J: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr = False):
    """Code J of each int32 word as a float32, exactly, by one masked or and one subtraction:
    the first half of a word's codes are read in place from `lo` (the word), the second half
    from `hi` (the word >> 16), so a code sits at bits P = BITS * (J mod half) <= 15 and under
    the exponent of 2**(23 - P) it is worth exactly its value: v = 2**(23 - P) + code. A shift
    per code would cost an integer op, which runs at half the float rate. ASM writes the masked
    or as one lop3 (truth table 0xEA), which Triton 3.6 builds as two (benchmarks/quant_sass.py);
    CUDA only, as the interpreter runs no PTX."""
    HALF: tl.constexpr = 16 // BITS
    P: tl.constexpr = BITS * (J % HALF)
    MAGIC: tl.constexpr = (127 + 23 - P) << 23
    MASK: tl.constexpr = ((1 << BITS) - 1) << P
    BASE: tl.constexpr = float(2 ** (23 - P))
    w = lo if J < HALF else hi
    if ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [w, tl.full(w.shape, MASK, tl.int32), tl.full(w.shape, MAGIC, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (w & MASK) | MAGIC
    return bits.to(tl.float32, bitcast=True) - BASE


@triton.jit
def _group_dot(XP, c, s, m, g, K, wi, BITS: tl.constexpr, GW: tl.constexpr, REGROUPED: tl.constexpr,
               ASM: tl.constexpr):
    """One group's contribution to the GEMV's [rows, words] accumulator: scale * (x . codes) +
    minimum * sum(x), per code position j a 2-D pass over the [rows, words] tile of codes c."""
    PER: tl.constexpr = 32 // BITS
    part = tl.zeros(c.shape, dtype=tl.float32)
    xs = tl.zeros([GW], dtype=tl.float32)
    hi = c >> 16
    for j in tl.static_range(PER):
        if REGROUPED:
            x = tl.load(XP + j * (K // PER) + g * GW + wi)
        else:  # x itself: a strided gather, but no copy before the kernel
            x = tl.load(XP + (g * GW + wi) * PER + j).to(tl.float32)
        part += code_value(c, hi, j, BITS, ASM) * x[None, :]
        xs += x
    return s[:, None] * part + m[:, None] * xs[None, :]


@triton.jit
def _gemv_kernel(XP, C, S, MN, B, OUT, N, K, stride_c, stride_s, stride_p,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, REGROUPED: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr):
    """OUT[split, n] = sum over this split's K range of X[k] W[n, k], for BLOCK_N rows n. Codes are
    read as int32 words (8 int4 or 4 int8 codes, code j of a word at bits BITS*j, k = word*PER + j),
    a [BLOCK_N, words of a group] tile at a time, and each code position j is a 2-D pass over
    that tile with x's entries j of each word, XP[j, word] (x regrouped by code position, so a
    thread reads its words' entries as one vector): no tensor wider than the tile, so every
    thread keeps its own words' codes and no lanes are spent on layouts. code_value gives each
    code as a float in two float-rate ops and one integer op. Per-word partial sums
    stay in a [BLOCK_N, words] accumulator, reduced across threads once at the end; GROUPS groups
    are unrolled per iteration so that their loads are in flight together, and a group past the
    end re-reads the last one (no mask along K, so the loads stay 16-byte vectors) at weight 0.
    PREFETCH (with GROUPS 1) loads the next group's codes, scales and minima before the current
    group's arithmetic, so that they are in flight while it runs (Triton does not pipeline this
    loop: its SASS has no asynchronous copies); ASM is code_value's."""
    PER: tl.constexpr = 32 // BITS
    GW: tl.constexpr = GROUP // PER
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    wi = tl.arange(0, GW)
    n_groups = K // GROUP
    per_split = tl.cdiv(tl.cdiv(n_groups, tl.num_programs(1)), GROUPS) * GROUPS
    g_lo = tl.program_id(1) * per_split
    g_hi = tl.minimum(g_lo + per_split, n_groups)
    acc = tl.zeros([BLOCK_N, GW], dtype=tl.float32)
    codes = C + rows[:, None] * stride_c + wi[None, :]
    if PREFETCH:
        g_first = tl.minimum(g_lo, n_groups - 1)  # an empty split loads a valid group, unused
        c_next = tl.load(codes + g_first * GW, mask=row_ok[:, None], other=0)
        s_next = tl.load(S + rows * stride_s + g_first, mask=row_ok, other=0.0)
        m_next = tl.load(MN + rows * stride_s + g_first, mask=row_ok, other=0.0)
        for g in range(g_lo, g_hi):
            c, s, m = c_next, s_next.to(tl.float32), m_next.to(tl.float32)
            g_next = tl.minimum(g + 1, g_hi - 1)
            c_next = tl.load(codes + g_next * GW, mask=row_ok[:, None], other=0)
            s_next = tl.load(S + rows * stride_s + g_next, mask=row_ok, other=0.0)
            m_next = tl.load(MN + rows * stride_s + g_next, mask=row_ok, other=0.0)
            acc += _group_dot(XP, c, s, m, g, K, wi, BITS, GW, REGROUPED, ASM)
    else:
        for g0 in range(g_lo, g_hi, GROUPS):
            for gg in tl.static_range(GROUPS):
                g = tl.minimum(g0 + gg, g_hi - 1)
                live = (g0 + gg < g_hi).to(tl.float32)
                c = tl.load(codes + g * GW, mask=row_ok[:, None], other=0)
                s = tl.load(S + rows * stride_s + g, mask=row_ok, other=0.0).to(tl.float32) * live
                m = tl.load(MN + rows * stride_s + g, mask=row_ok, other=0.0).to(tl.float32) * live
                acc += _group_dot(XP, c, s, m, g, K, wi, BITS, GW, REGROUPED, ASM)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            out += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(1) * stride_p + rows, out.to(OUT.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm_kernel(X, C, S, MN, B, OUT, M, N, K, stride_xm, stride_om, stride_c, stride_s, stride_p,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KIND: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr):
    """OUT[split, m, n] for a BLOCK_N x BLOCK_M tile of OUT^T = W X^T over this split's K range,
    one group per iteration on tensor cores. The weight is the dot's left operand, so its codes
    travel to the dot's register layout as bytes and are dequantized there (a right operand
    would be staged through shared memory at 16 bits a value). Each 4-bit half of a code enters
    tl.dot as 1 + h/16 in x's dtype (nibble_value), so x . h = 16 * (the dot - sum(x)); an 8-bit
    code is its two nibbles, c = 16 * hi + lo. sum(x) comes from a dot with ones, which lands
    in the accumulator's layout. For int4, X is x split into its even and odd entries, [2, M,
    K/2] (so both halves load as contiguous rows, which the pipeliner can copy asynchronously).
    The next group's scale and minimum are loaded one iteration ahead. ASM dequantizes 16-bit
    kinds by nibble_pairs (PTX: its code for KIND)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    n_groups = K // GROUP
    per_split = tl.cdiv(n_groups, tl.num_programs(1))
    g_lo = tl.program_id(1) * per_split
    g_hi = tl.minimum(g_lo + per_split, n_groups)
    KX: tl.constexpr = GROUP if BITS == 8 else GROUP // 2     # the K of one dot
    ones = tl.full([BLOCK_N, KX], 1.0, X.dtype.element_ty)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    s_next = tl.load(S + rn * stride_s + g_lo, mask=n_ok & (rn * 0 + g_lo < g_hi), other=0.0)
    m_next = tl.load(MN + rn * stride_s + g_lo, mask=n_ok & (rn * 0 + g_lo < g_hi), other=0.0)
    for g in range(g_lo, g_hi):
        s = s_next.to(tl.float32) * 16.0
        m = m_next.to(tl.float32)
        s_next = tl.load(S + rn * stride_s + g + 1, mask=n_ok & (rn * 0 + g + 1 < g_hi), other=0.0)
        m_next = tl.load(MN + rn * stride_s + g + 1, mask=n_ok & (rn * 0 + g + 1 < g_hi), other=0.0)
        kk = g * KX + tl.arange(0, KX)
        b = tl.load(C + rn[:, None] * stride_c + kk[None, :], mask=n_ok[:, None], other=0)
        if BITS == 8:
            xt = tl.load(X + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :], other=0.0)
            xs = tl.dot(ones, xt)
            if ASM and KIND != 0:
                lo, hi = nibble_pairs(b, PTX, X.dtype.element_ty)
            else:
                lo, hi = nibble_value(b, 0, KIND), nibble_value(b, 4, KIND)
            dots = 16.0 * (tl.dot(hi, xt) - xs) + tl.dot(lo, xt)
        else:
            xe = tl.load(X + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :], other=0.0)
            xo = tl.load(X + (M + rm[None, :]) * stride_xm + kk[:, None], mask=m_ok[None, :], other=0.0)
            xs = tl.dot(ones, xe)
            xs = tl.dot(ones, xo, xs)
            if ASM and KIND != 0:
                lo, hi = nibble_pairs(b, PTX, X.dtype.element_ty)
            else:
                lo, hi = nibble_value(b, 0, KIND), nibble_value(b, 4, KIND)
            dots = tl.dot(lo, xe)
            dots = tl.dot(hi, xo, dots)
        acc += (dots - xs) * s[:, None] + xs * m[:, None]
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(OUT + tl.program_id(1) * stride_p + rm[None, :] * stride_om + rn[:, None],
             acc.to(OUT.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def _outputs(rows: int, n: int, split: int, like: torch.Tensor) -> torch.Tensor:
    """The kernels' output: [rows, n] in x's dtype, or float32 partial sums [split, rows, n] that
    `_reduce` adds up (allocated by torch, so from the graph's pool under capture)."""
    if split == 1:
        return torch.empty(1, rows, n, dtype=like.dtype, device=like.device)
    return torch.empty(split, rows, n, dtype=torch.float32, device=like.device)


def _split(split: Optional[int], programs: int, groups: int, device: torch.device) -> int:
    """Programs along K: as asked, else enough for about two programs an SM (one when the rows
    alone give that many), at most 8 and never more than the groups of K."""
    if split is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        split = min(8, -(-2 * sms // programs))
    return max(1, min(split, groups))


@triton.jit
def _sum_kernel(P, OUT, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """OUT = the sum of SPLIT float32 partials [SPLIT, total], in OUT's dtype: one small kernel
    (torch's sum and cast would be two launches)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * total + i, mask=ok, other=0.0)
    tl.store(OUT + i, acc.to(OUT.dtype.element_ty), mask=ok)


def _reduce(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out.shape[0] == 1:
        return out[0]
    total = out[0].numel()
    summed = torch.empty(out.shape[1:], dtype=dtype, device=out.device)
    _sum_kernel[(triton.cdiv(total, 1024),)](out, summed, total, SPLIT=out.shape[0], BLOCK=1024)
    return summed


def gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: int = 128, groups: int = 2,
         split: Optional[int] = None, num_warps: int = 4, regroup: bool = False, prefetch: bool = False,
         asm: bool = False) -> torch.Tensor:
    """x [1, K] (contiguous) -> [1, N]. `block_n` output rows a program, `groups` groups of K
    unrolled per iteration and `split` programs along K (float32 partials, then one sum) are
    the benchmark's knobs (benchmarks/quant_gemv.py): a GEMV is bound by the bytes in flight,
    and a few hundred programs of long rows keep the most of them outstanding. `regroup` copies
    x by code position first (one small kernel) so that the kernel reads it as vectors. `prefetch`
    loads each group one iteration ahead (one group an iteration, so it sets `groups` to 1) and
    `asm` builds each code's float with one lop3 (code_value's ASM; CUDA only)."""
    if prefetch:
        groups = 1
    if asm and not x.is_cuda:
        raise ValueError("asm=True runs inline PTX, which needs CUDA")
    n, k = scale.shape[0], x.shape[-1]
    words = codes.view(torch.int32)
    per = 32 // bits
    xp = x
    if regroup:
        xp = torch.empty(per, k // per, dtype=torch.float32, device=x.device)
        xp.copy_(x.view(k // per, per).t())
    split = _split(split, triton.cdiv(n, block_n), k // group, x.device)
    out = _outputs(1, n, split, x)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        xp, words, scale, minimum, bias if bias is not None else scale, out, n, k,
        words.stride(0), scale.stride(0), out.stride(0), BITS=bits, GROUP=group, GROUPS=groups,
        BLOCK_N=block_n, HAS_BIAS=bias is not None, REGROUPED=regroup, PREFETCH=prefetch, ASM=asm,
        num_warps=num_warps)
    return _reduce(out, x.dtype)


def gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
         bias: Optional[torch.Tensor], bits: int, group: int, block_n: int = 64,
         split: Optional[int] = None, num_warps: int = 4, num_stages: int = 4,
         asm: bool = False) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> [M, N], M <= 64 rows in one tile of 16, 32 or 64 (tl.dot's
    smallest is 16); int4 needs group >= 32 (a half group is tl.dot's K, at least 16). `split`
    programs along K (float32 partials, then one sum) fill the SMs when N / block_n is few;
    `asm` dequantizes by inline PTX (nibble_pairs; CUDA 16-bit activations only)."""
    rows, n, k = x.shape[0], scale.shape[0], x.shape[-1]
    block_m = max(16, triton.next_power_of_2(rows))
    split = _split(split, triton.cdiv(n, block_n), k // group, x.device)
    out = _outputs(rows, n, split, x)
    if bits == 4:
        halves = torch.empty(2, rows, k // 2, dtype=x.dtype, device=x.device)
        halves.copy_(x.unflatten(1, (k // 2, 2)).permute(2, 0, 1))
        x = halves.view(2 * rows, k // 2)
    _gemm_kernel[(triton.cdiv(n, block_n), split)](
        x, codes, scale, minimum, bias if bias is not None else scale, out, rows, n, k,
        x.stride(0), out.stride(1), codes.stride(0), scale.stride(0), out.stride(0), BITS=bits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, KIND=MAGIC_KINDS[x.dtype],
        HAS_BIAS=bias is not None, ASM=asm, PTX=NIBBLE_PAIRS_PTX.get(MAGIC_KINDS[x.dtype], ""),
        num_warps=num_warps, num_stages=num_stages)
    return _reduce(out, x.dtype)
