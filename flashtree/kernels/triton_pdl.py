"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A decode forward is about 620 short kernels (a 27B hybrid's AR step: 256 GEMMs, 129 norms, the
scans, the attention's split and merge, ...), many of them a few microseconds long. Launched with
PDL, a kernel's programs may be placed on the SMs as soon as every program of the kernel before
it has started (each calls `griddepcontrol.launch_dependents` first thing), so the launch and
the programs' setup overlap the previous kernel's tail; they then wait (`griddepcontrol.wait`)
until that kernel has finished and its writes are visible. Nothing a kernel reads or writes
comes before that wait, so the results are the same as with ordinary launches, bit for bit.
It shortens a tree's verify graph and leaves the AR step's about as it was; a GEMM that also sent
its first weights to L2 before the wait was slower, so none does (`flashtree bench` with and
without FLASHTREE_PDL=0 compares them).

Only kernels that call `pdl_start` are launched with PDL (`launch_options`): a kernel without the
wait would race its predecessor. CUDA graphs keep the dependency as a programmatic edge.
`FLASHTREE_PDL=0` turns it off (launches as before), and so does `pdl_off()` for the launches made
inside it: a profiler times a PDL kernel from when its programs are placed, so its time would
count the wait for its predecessor (flashtree bench's kernel profiles launch without it)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

import torch
import triton
import triton.language as tl

from . import deterministic

try:  # Triton's grid dependency control and its launch option (3.4 and later)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # pragma: no cover - older Triton: launches stay ordinary
    _HAS_GDC = False


_OFF = [0]  # pdl_off() blocks entered and not yet left


@lru_cache(maxsize=None)
def _pdl_on(index: int) -> bool:
    return (_HAS_GDC and os.environ.get("FLASHTREE_PDL", "1") != "0"
            and torch.cuda.get_device_capability(index) >= (9, 0))


def launch_options(device: torch.device) -> dict:
    """The launch arguments of a kernel that calls `pdl_start` (its constexpr PDL and Triton's
    launch_pdl): PDL on a CUDA device of compute capability 9.0 or later outside pdl_off(), else
    off.

    In the deterministic mode a CUDA kernel is also compiled without fused multiply-adds. The
    compiler fuses `a * b + c` where it sees both in one expression, and which ones it sees
    depends on the code around them: attention's unmasked key blocks scale the scores and
    subtract the row's max in one fused operation, its masked blocks (a `where` between the
    two) in two roundings. A row's block is masked in one launch and not in another (a chunk
    that starts later has committed more of its context), so its bits would follow the launch.
    Plain multiplies and adds round alike everywhere, as the interpreter does."""
    options: dict = dict(PDL=False)
    if device.type != "cuda":
        return options
    if deterministic():
        options["enable_fp_fusion"] = False
    if not _OFF[0] and _pdl_on(device.index if device.index is not None else torch.cuda.current_device()):
        options.update(PDL=True, launch_pdl=True)
    return options


@contextmanager
def pdl_off() -> Iterator[None]:
    """Kernels launched inside run without PDL (their PDL=False variants, compiled on first use)."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


if _HAS_GDC:
    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Let the next kernel's programs be placed, then wait for the previous kernel's writes:
        what a PDL kernel calls before it reads an earlier kernel's output or writes anything."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
else:  # pragma: no cover
    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Nothing to wait for: launch_options never turns PDL on without Triton's GDC."""
        pass

