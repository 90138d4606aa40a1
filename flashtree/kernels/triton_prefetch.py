"""L2 prefetch of the weights a decode forward reads next (sm_90 and later).

A decode step's linears stream their weights from memory; between two of them run small kernels
(norms, the DeltaNet scan, attention, SiLU) that read almost nothing, so the memory idles while
they run. A bulk prefetch (`cp.async.bulk.prefetch.L2.global`, one instruction a range, no
registers, no completion to wait for) issued as the previous linear ends brings the next
linear's first bytes into L2 during those kernels, and the next linear reads them from there.

`prefetch_share` splits a range over a launch's programs, a few lanes each, so that the GEMM can
issue its successor's prefetch from its own epilogue (no launch of its own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import prefetch_supported

LANES = 32  # lanes of a program that each issue one bulk prefetch
# predicated so that lanes past the range issue nothing; the output is a dummy the asm must have
PREFETCH_PTX = tl.constexpr("{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n"
                "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}")


@triton.jit
def prefetch_share(base, nbytes, LANES: tl.constexpr):
    """This program's share of a bulk L2 prefetch of bytes [0, nbytes) from address `base` (an
    integer; nbytes a multiple of 16): the launch's programs split the range evenly, LANES lanes
    a program, each lane one run of whole 16-byte units."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    per_lane = tl.cdiv(tl.cdiv(nbytes, 16), programs * LANES) * 16
    start = (program * LANES + tl.arange(0, LANES)).to(tl.int64) * per_lane
    size = tl.minimum(nbytes - start, per_lane).to(tl.int32)
    tl.inline_asm_elementwise(PREFETCH_PTX, "=r,l,r", [base + start, size], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(base, nbytes, LANES: tl.constexpr):
    """prefetch_share over a launch of its own (prefetch_l2)."""
    prefetch_share(base, nbytes, LANES)


def prefetch_l2(t: torch.Tensor, nbytes: int, lane_bytes: int = 1 << 14) -> None:
    """Prefetch the first `nbytes` of `t` into L2 in a launch of its own, about `lane_bytes` a
    lane (a no-op where quant.prefetch_supported is false)."""
    if not prefetch_supported(t.device):
        return
    nbytes = min(nbytes, t.numel() * t.element_size()) // 16 * 16
    _prefetch_kernel[(triton.cdiv(nbytes, LANES * lane_bytes),)](t.data_ptr(), nbytes, LANES=LANES, num_warps=1)
