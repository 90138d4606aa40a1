"""A candidate for the int4 GEMM at a tree's rows: one slice of a run an iteration, so that one
slice's dequantization runs while the previous slice's tensor-core work is in flight, against the
engine's GEMM (kernels/triton_quant.py) on the same tiled codes.

Why: compiled for sm_90 (Triton 3.6), the engine's loop over a run of 128 codes issues one wgmma
group a slice of 32 and waits for each (`wgmma.wait_group 0`) before it dequantizes the next, so
at 16 rows or more its dequantization and its tensor cores take turns. Triton pipelines a loop
whose only dot takes its left operand from registers with a wait of 1 across iterations; a loop
of runs with four dots, or a run's four slices in an inner loop, does not get it, while a loop
of slices does. Its costs: each run's words are loaded once for each of its four slices (from L2
after the first), each slice's nibble is taken by a shift of a runtime amount before the lop3
that makes two codes two 16-bit values (NIBBLE_PTX) and the packed fmas that scale them
(triton_int4.scaled_codes, as the engine's), and a loop iteration's own work (addresses, the
scale and minimum, barriers) comes four times a run: compiled for sm_90 at 23 rows its loop is
about 7 SASS instructions a code against the engine's 3.1 (benchmarks/quant_sass.py's count).
Whether the overlap pays for them is what this measures.

    python benchmarks/int4_slice_loop.py [--iters 20] [--models qwen3.5-27b,qwen3-8b] [--rows 1,23,46,64]

Tiled int4 in groups of 128 as the engine places it on CUDA, the engine's launch (tile, warps,
stages, split along K) for the same rows; each call replayed in a CUDA graph over more weight bytes
than L2 holds (quant_gemv.py's per_call_us). Rows past 64 are the engine's further launches and
are not timed here. Writes benchmarks/results/int4_slice_loop_<device>.json."""

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
from flashtree.kernels.triton_int4 import MAGIC_BITS, MAGIC_KINDS, SCALE_PTX, scaled_codes, tiled_at  # noqa: E402
from flashtree.kernels.triton_pdl import launch_options, pdl_start  # noqa: E402
from flashtree.kernels.triton_quant import gemm, gemm_launch, gemm_split  # noqa: E402
from flashtree.kernels.triton_split import split_outputs, split_range, store_split  # noqa: E402

GROUP = 128
# two int16 words ($1) and a shift of 4r in each half of $2 -> nibble r of each word as a 16-bit
# value magic + h under the kind's exponent: one shift of the pair, then triton_int4._quad_ptx's lop3
NIBBLE_PTX = {kind: "{\n.reg .b32 t, n;\nand.b32 n, $2, 0xFF;\nshr.u32 t, $1, n;\n"
              f"lop3.b32 $0, t, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA;\n}}"
              for kind, magic in MAGIC_BITS.items()}


@triton.jit
def _slice_loop_kernel(X, C, S, MN, OUT, P, LOCKS, M, N, K, stride_xm, stride_c, stride_s, stride_om, stride_p,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr, ASM: tl.constexpr,
                       PTX: tl.constexpr, SPTX: tl.constexpr, PDL: tl.constexpr = False):
    """OUT^T tile = W X^T for rows rn of W, over this program's runs along K (split_range), one
    slice of RUN/4 columns an iteration: iteration u is nibble u % 4 of run u // 4's words (the
    stored layout: nibble r of a run's words holds its columns r*RUN/4 ...), in a group of a run
    (one scale and minimum a row and run), tiled (reference.tile_rows)."""
    SLICE: tl.constexpr = RUN // 4
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    t_lo, t_hi = split_range(K // RUN)
    pdl_start(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for u in range(4 * t_lo, 4 * t_hi):
        t = u // 4
        r = u % 4
        at = tiled_at(rn, N, stride_s, t, 1, True)
        s = tl.load(S + at, mask=n_ok, other=0.0).to(tl.float32)
        m = tl.load(MN + at, mask=n_ok, other=0.0).to(tl.float32)
        w = tl.load(C + tiled_at(rn, N, stride_c, t, SLICE, True)[:, None] + tl.arange(0, SLICE)[None, :],
                    mask=n_ok[:, None], other=0)
        if ASM:
            shift = tl.full([BLOCK_N, SLICE], 4 * r, tl.int16)
            v = tl.inline_asm_elementwise(PTX, "=r,r,r", [w, shift], dtype=X.dtype.element_ty, is_pure=True, pack=2)
        else:
            v = ((w.to(tl.int32) >> (4 * r)) & 15).to(X.dtype.element_ty)
        wr = scaled_codes(v, s, m, ASM, SPTX)
        xt = tl.load(X + rm[None, :] * stride_xm + (t * RUN + r * SLICE + tl.arange(0, SLICE))[:, None],
                     mask=m_ok[None, :], other=0.0)
        acc = tl.dot(wr, xt, acc)
    store_split(acc, OUT, P, LOCKS, rm[None, :] * stride_om + rn[:, None], m_ok[None, :] & n_ok[:, None], stride_p)


def slice_loop_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    asm: Optional[bool] = None, split: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (rows contiguous, M <= 64) -> [M, N] for tiled int4 codes in groups of a run,
    with the engine's launch for M rows (GEMM_LAUNCH) and `split` along K (default: the engine's);
    `asm` (CUDA's default): the PTX dequantization, 16-bit x only."""
    rows, n, k = x.shape[0], scale.shape[0], x.shape[1]
    if rows > 64 or k % INT4_RUN or scale.shape[1] != k // GROUP:
        raise ValueError("the candidate takes at most 64 rows, whole runs, groups of a run")
    launch = gemm_launch(4, rows)
    kind = MAGIC_KINDS[x.dtype]
    asm = (x.is_cuda if asm is None else asm) and kind != 0
    programs = triton.cdiv(n, launch["block_n"])
    split = gemm_split(4, rows, n, k, GROUP, x.device, launch["block_n"], split)
    out, partials, locks = split_outputs(rows, n, split, programs, x)
    words = codes.view(torch.int16)
    _slice_loop_kernel[(programs, split)](
        x, words, scale, minimum, out, partials, locks, rows, n, k, x.stride(0), words.stride(0), scale.stride(0),
        out.stride(0), rows * n, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=launch["block_n"],
        RUN=INT4_RUN, ASM=asm, PTX=NIBBLE_PTX.get(kind, ""), SPTX=SCALE_PTX.get(kind, ""),
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **launch_options(x.device))
    return out


def bench(n: int, k: int, rows: list[int], bw: float, iters: int) -> dict:
    """One shape: per row count, the engine's GEMM and the candidate, the floor, and each one's
    error against the float32 definition."""
    plain, weights = tiled_int4_copies(n, k)
    out: dict = {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ dequantize(*plain[0], 4, GROUP, torch.float32).T
        engine_us, _ = per_call_us([lambda w=w: gemm(x, *w, None, 4, GROUP, tiled=True) for w in weights], iters)
        slices_us, _ = per_call_us([lambda w=w: slice_loop_gemm(x, *w) for w in weights], iters)
        out[f"M{m}"] = {"floor_us": quant_bytes(n, k, 4) / bw / 1e3, "engine_us": engine_us,
                        "slice_loop_us": slices_us,
                        "engine_rel_err": rel_err(gemm(x, *weights[0], None, 4, GROUP, tiled=True), ref),
                        "slice_loop_rel_err": rel_err(slice_loop_gemm(x, *weights[0]), ref)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from flashtree.bench.measure import ceilings
    from flashtree.bench.provenance import provenance

    args = shape_args(__doc__, "1,23,46,64", argv)
    ceil = ceilings()
    result: dict = {**provenance(), "triton": triton.__version__, "ceilings": ceil, "group": GROUP, "rows": {},
                    "totals_ms": {}}
    rows = [int(r) for r in args.rows.split(",")]
    path = args.out / f"int4_slice_loop_{device_slug()}.json"
    bench_shapes(args.models, lambda n, k: bench(n, k, rows, ceil["copy_bandwidth_GBps"], args.iters),
                 ("floor_us", "engine_us", "slice_loop_us"), result, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
