"""A candidate for the int4 linears' GEMM: x quantized to int8 and the dots on integer tensor cores
(W4A8), against the engine's GEMM (W4A16: kernels/triton_quant.py) on the same tiled codes.

Why: Nsight Compute on the engine's one-row int4 GEMM found the big linears issue-bound while
their SMs are busy (docs/PERFORMANCE.md, "One row's split along K"): about 3 SASS instructions a
code, most of them turning a code into a bfloat16 weight (one lop3 per two codes, then two packed
fmas that scale them). With x in int8 the codes go into integer dots as they are: per four words
of a run two byte permutes and six shifts/ands give the 16 codes as int8 (A8_PTX), about half an
instruction a code, and the weight's scale and minimum move to one epilogue a group:
    sum_k w_k x_k = scale * xscale * sum_k h_k q_k + minimum * sum_k x_k
with h the codes, q = round(x / xscale) in [-127, 127] (xscale = max|x| / 127 over each run of
128 columns of each row of x) and sum_k x_k over each group of the weight (float32, exact x).
The integer dot is exact; the cost is x's rounding, about 0.5% of a dot against 0.17% for the
engine's kernel (both measured here against the float32 definition).

The launcher quantizes x in its own small launch (_quantize_kernel), as a first version; a real
one would take int8 x from the kernel that makes x (the RMSNorm, the SiLU-and-multiply, the
attention's output). Both are timed: "w4a8" with the quantizing launch in the graph, "w4a8 dots
alone" without it.

    python benchmarks/w4a8_gemm.py [--iters 20] [--models qwen3.5-27b,qwen3-8b] [--rows 1,23]

Each call is replayed in a CUDA graph over more weight bytes than L2 holds (quant_gemv.py's
per_call_us), tiled int4 in groups of 128 as the engine places it, the same split along K as the
engine's launcher picks. Writes benchmarks/results/w4a8_gemm_<device>.json."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import bench_shapes, per_call_us, quant_bytes, rel_err, shape_args, tiled_int4_copies  # noqa: E402

from flashtree.bench.provenance import device_slug  # noqa: E402
from flashtree.kernels.reference import INT4_RUN, dequantize  # noqa: E402
from flashtree.kernels.triton_pdl import launch_options, pdl_start  # noqa: E402
from flashtree.kernels.triton_int4 import group_at, tiled_at  # noqa: E402
from flashtree.kernels.triton_quant import gemm, gemm_launch, gemm_split  # noqa: E402
from flashtree.kernels.triton_split import split_outputs, split_range, store_split  # noqa: E402

GROUP = 128
# four int16 words of a run ($4: words j, j + 1; $5: j + 2, j + 3) -> nibble r of each as four
# int8 in output $r: the words' low bytes (nibbles 0 and 1) and high bytes gathered by two
# permutes, then each nibble masked (after a shift for the odd ones)
A8_PTX = ("{\n.reg .b32 lo, hi, t;\nprmt.b32 lo, $4, $5, 0x6420;\nprmt.b32 hi, $4, $5, 0x7531;\n"
          "and.b32 $0, lo, 0x0F0F0F0F;\nshr.u32 t, lo, 4;\nand.b32 $1, t, 0x0F0F0F0F;\n"
          "and.b32 $2, hi, 0x0F0F0F0F;\nshr.u32 t, hi, 4;\nand.b32 $3, t, 0x0F0F0F0F;\n}")


@triton.jit
def _quantize_kernel(X, XQ, XS, XSUM, K, stride_x, GROUP: tl.constexpr, RUN: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Row program_id(0) of x, run program_id(1): q = round(x / s) as int8 with s = max|x| / 127
    (XS [M, K / RUN]), and the float32 sum of x over each group (XSUM [M, K / GROUP])."""
    pdl_start(PDL)
    m = tl.program_id(0)
    t = tl.program_id(1)
    k = t * RUN + tl.arange(0, RUN)
    x = tl.load(X + m * stride_x + k).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    v = x * inv
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(XQ + m * K + k, q.to(tl.int8))
    tl.store(XS + m * (K // RUN) + t, amax / 127.0)
    sums = tl.sum(tl.reshape(x, [RUN // GROUP, GROUP]), axis=1)
    tl.store(XSUM + m * (K // GROUP) + t * (RUN // GROUP) + tl.arange(0, RUN // GROUP), sums)


@triton.jit
def _w4a8_kernel(XQ, XS, XSUM, C, S, MN, OUT, P, LOCKS, M, N, K, stride_c, stride_s, stride_om, stride_p,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
                 TILED: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr = False):
    """OUT^T = W XQ^T as _gemm_kernel tiles it (W the dot's left operand, one run a step, K split
    over program_id(1)), the dots in int32 over one group, then scale * xscale * dot + minimum *
    sum(x) per group in float32."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    SLICE: tl.constexpr = RUN // 4
    n_steps = K // RUN
    t_lo, t_hi = split_range(n_steps)
    pdl_start(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        w = tl.load(C + tiled_at(rn, N, stride_c, t, SLICE, TILED)[:, None] + tl.arange(0, SLICE)[None, :],
                    mask=n_ok[:, None], other=0)
        if ASM:
            quads = tl.inline_asm_elementwise(PTX, "=r,=r,=r,=r,r,r", [w], dtype=(tl.int8,) * 4,
                                              is_pure=True, pack=4)
        else:
            wi = w.to(tl.int32)
        xs = tl.load(XS + rm * n_steps + t, mask=m_ok, other=0.0)
        idot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        for r in tl.static_range(4):
            if ASM:
                v = quads[r]
            else:
                v = ((wi >> (4 * r)) & 15).to(tl.int8)
            k0 = t * RUN + r * SLICE
            xq = tl.load(XQ + rm[None, :] * K + (k0 + tl.arange(0, SLICE))[:, None], mask=m_ok[None, :], other=0)
            idot = tl.dot(v, xq, idot, out_dtype=tl.int32)
            if (r + 1) * SLICE % GROUP == 0:  # the end of a group: its epilogue
                g = (k0 + SLICE - 1) // GROUP
                at = group_at(rn, N, stride_s, g, GROUP, RUN, TILED)
                s = tl.load(S + at, mask=n_ok, other=0.0).to(tl.float32)
                mn = tl.load(MN + at, mask=n_ok, other=0.0).to(tl.float32)
                xsum = tl.load(XSUM + rm * (K // GROUP) + g, mask=m_ok, other=0.0)
                acc = tl.fma(idot.to(tl.float32), s[:, None] * xs[None, :], acc)
                acc = tl.fma(mn[:, None], xsum[None, :], acc)
                idot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    store_split(acc, OUT, P, LOCKS, rm[None, :] * stride_om + rn[:, None], m_ok[None, :] & n_ok[:, None], stride_p)


def quantize_x(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], float32 scale a run [M, K / INT4_RUN], float32 sums a
    group [M, K / group])."""
    rows, k = x.shape
    xq = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    xs = torch.empty(rows, k // INT4_RUN, dtype=torch.float32, device=x.device)
    xsum = torch.empty(rows, k // group, dtype=torch.float32, device=x.device)
    _quantize_kernel[(rows, k // INT4_RUN)](x, xq, xs, xsum, k, x.stride(0), GROUP=group, RUN=INT4_RUN,
                                             num_warps=1, **launch_options(x.device))
    return xq, xs, xsum


def w4a8_dots(quantized: tuple[torch.Tensor, ...], out_dtype: torch.dtype, codes: torch.Tensor,
              scale: torch.Tensor, minimum: torch.Tensor, group: int, tiled: bool = True,
              asm: Optional[bool] = None, split: Optional[int] = None) -> torch.Tensor:
    """The GEMM over x already quantized (quantize_x), at the engine's int4 launch and its split
    along K (or `split`)."""
    xq, xs, xsum = quantized
    rows, k = xq.shape
    n = scale.shape[0]
    launch = gemm_launch(4, rows)
    programs = triton.cdiv(n, launch["block_n"])
    split = gemm_split(4, rows, n, k, group, xq.device, split=split)
    out, partials, locks = split_outputs(rows, n, split, programs, torch.empty(0, dtype=out_dtype, device=xq.device))
    asm = xq.is_cuda if asm is None else asm
    _w4a8_kernel[(programs, split)](
        xq, xs, xsum, codes.view(torch.int16), scale, minimum, out, partials, locks, rows, n, k,
        codes.stride(0) // 2, scale.stride(0), out.stride(0), rows * n,
        GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=launch["block_n"], RUN=INT4_RUN,
        TILED=tiled, ASM=asm, PTX=A8_PTX, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        **launch_options(xq.device))
    return out


def w4a8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
         tiled: bool = True, asm: Optional[bool] = None, split: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (16-bit, rows contiguous) -> [M, N]: quantize_x, then w4a8_dots."""
    return w4a8_dots(quantize_x(x, group), x.dtype, codes, scale, minimum, group, tiled, asm, split)


def definition(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
               group: int, quantized: bool) -> torch.Tensor:
    """float32 x @ W^T for row-major codes; `quantized`: what w4a8 computes, x rounded as it
    rounds it (xscale * q) against the codes times the scales, and exact x against the minima."""
    xf = x.float()
    if not quantized:
        return xf @ dequantize(codes, scale, minimum, 4, group, torch.float32).T
    runs = xf.view(xf.shape[0], -1, INT4_RUN)
    s = runs.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, runs / torch.where(s > 0, s, 1), 0)
    rounded = (torch.sign(q) * torch.floor(q.abs() + 0.5) * s).view_as(xf)
    scaled = dequantize(codes, scale, torch.zeros_like(minimum), 4, group, torch.float32)
    return rounded @ scaled.T + xf @ minimum.float().repeat_interleave(group, dim=1).T


def bench(n: int, k: int, rows: list[int], bw: float, iters: int) -> dict:
    """One shape: per row count, the engine's GEMM, w4a8 with and without its quantizing launch,
    the floor, and each one's error against the float32 definition."""
    plain, weights = tiled_int4_copies(n, k)
    out: dict = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = definition(x, *plain[0], GROUP, quantized=False)
        engine_us, _ = per_call_us([lambda w=w: gemm(x, *w, None, 4, GROUP, tiled=True) for w in weights], iters)
        a8_us, _ = per_call_us([lambda w=w: w4a8(x, *w, GROUP) for w in weights], iters)
        q = quantize_x(x, GROUP)
        dots_us, _ = per_call_us([lambda w=w: w4a8_dots(q, x.dtype, *w, GROUP) for w in weights], iters)
        out[f"M{m}"] = {
            "floor_us": quant_bytes(n, k, 4) / bw / 1e3, "engine_us": engine_us, "w4a8_us": a8_us,
            "w4a8_dots_alone_us": dots_us,
            "engine_rel_err": rel_err(gemm(x, *weights[0], None, 4, GROUP, tiled=True), ref),
            "w4a8_rel_err": rel_err(w4a8(x, *weights[0], GROUP), ref),
            "w4a8_rel_err_vs_its_definition": rel_err(w4a8(x, *weights[0], GROUP),
                                                      definition(x, *plain[0], GROUP, quantized=True))}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from flashtree.bench.measure import ceilings
    from flashtree.bench.provenance import provenance

    args = shape_args(__doc__, "1,23", argv)
    ceil = ceilings()
    result: dict = {**provenance(), "ceilings": ceil, "group": GROUP, "rows": {}, "totals_ms": {}}
    rows = [int(r) for r in args.rows.split(",")]
    path = args.out / f"w4a8_gemm_{device_slug()}.json"
    bench_shapes(args.models, lambda n, k: bench(n, k, rows, ceil["copy_bandwidth_GBps"], args.iters),
                 ("floor_us", "engine_us", "w4a8_us", "w4a8_dots_alone_us"), result, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
