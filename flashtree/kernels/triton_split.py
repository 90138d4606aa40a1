"""Split-K for the quantized GEMV and GEMM (triton_gemv.py, triton_quant.py): when a layer has too
few output rows to fill the SMs, its K range is split over several programs per output tile, and
their float32 partial sums are added in the same launch.

The last program of a tile to finish adds the partials: each program stores its partial, then
counts itself in with one atomic add on the tile's counter (acquire-release at GPU scope, after
a barrier so that all its threads' stores come first); the program that counts last reads every
partial (past L1), adds them in split order, stores the sum in x's dtype and sets the counter
back to zero for the next launch. A second kernel that adds the partials cost a launch per
linear, 256 per 27B forward (a visible share of an AR step's device time: `flashtree bench`'s
kernel profiles), and the sum here is the one that kernel made, bit for bit (same order, float32).

The counters are one int32 per output tile, zero between launches, kept per device; launches on
one stream (a decode step, its CUDA graph) never overlap, so they share them. They are allocated
and zeroed on the first launch, which must not be inside a CUDA graph capture (the engine, like
any Triton kernel's first call, warms up before it captures)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

LOCK_SLOTS = 1 << 16  # output tiles a split launch may have (N / rows a program): a vocabulary of 1M at 16
MAX_SPLIT = 16  # the most programs along K a launcher picks (split_for's `most`) or a benchmark asks
_LOCKS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def split_range(steps):
    """This program's steps [lo, hi) of `steps` along K: split program_id(1) of num_programs(1)
    takes an equal run of them (the last may take fewer, or none)."""
    per_split = tl.cdiv(steps, tl.num_programs(1))
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, steps)


@triton.jit
def store_split(acc, OUT, P, LOCKS, offs, mask, stride_p):
    """Store a program's float32 tile `acc` at OUT + offs (x's dtype): as it is when K is not
    split (one program along axis 1), else as its partial at P + split * stride_p + offs, and
    the last program of the tile (axis 0) to finish stores the sum of all partials."""
    splits = tl.num_programs(1)
    if splits == 1:
        tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(P + tl.program_id(1) * stride_p + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count that releases them
        ticket = tl.atomic_add(LOCKS + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(0, splits):
                total += tl.load(P + s * stride_p + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(OUT + offs, total.to(OUT.dtype.element_ty), mask=mask)
            tl.atomic_xchg(LOCKS + tl.program_id(0), 0)


def split_for(split: Optional[int], programs: int, steps: int, device: torch.device, per_sm: float = 2,
              least: int = 1, power_of_two: bool = False, most: int = 8) -> int:
    """Programs along K: as asked, else enough for about `per_sm` programs an SM and at least
    `least` (with `power_of_two`, rounded up to a power of two), at most `most` (MAX_SPLIT at the
    most), and never more than the steps of K."""
    if split is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        split = max(least, math.ceil(per_sm * sms / programs))
        if power_of_two:
            split = 1 << (split - 1).bit_length()
        split = min(most, MAX_SPLIT, split)
    return max(1, min(split, steps))


def split_outputs(rows: int, n: int, split: int, programs: int, like: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output [rows, n] in x's dtype (`out` where given: rows of n contiguous values, a
    larger output's rows), the float32 partials [split, rows, n] (the output itself when K is
    not split) and the device's tile counters, for a launch of `programs` output tiles. Output
    and partials come from torch (the graph's pool under capture)."""
    if programs > LOCK_SLOTS:
        raise ValueError(f"{programs} output tiles, more than the {LOCK_SLOTS} split-K counters")
    if out is None:
        out = torch.empty(rows, n, dtype=like.dtype, device=like.device)
    elif out.shape != (rows, n) or out.dtype != like.dtype or out.stride() != (n, 1):
        raise ValueError(f"an output of {rows} x {n} contiguous rows in {like.dtype} is needed, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    partials = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=like.device)
    locks = _LOCKS.get(like.device)
    if locks is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first quantized GEMV/GEMM on a device ran inside a CUDA graph capture: "
                               "run it once before capturing (its split-K counters are zeroed then)")
        locks = _LOCKS[like.device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=like.device)
    return out, partials, locks
