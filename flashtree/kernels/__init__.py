"""Kernels of the execution path, each with a plain-PyTorch definition (reference.py) of what it
computes, which also runs wherever Triton does not (the tests compare the two). This package
imports nothing else of flashtree.

Triton runs on CUDA tensors. Under Triton's own CPU interpreter (TRITON_INTERPRET=1) it also runs
on CPU tensors, which lets a machine without a GPU check the kernels' indexing, slowly.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

# The kernels were written, tuned and checked against their definitions with Triton fusing a * b + c
# into one fma (its default through 3.9, which warns that 3.10 turns it off). Saying so here, before
# any kernel compiles, keeps their rounding when the default moves and silences that warning; a
# value the user set is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton
except ImportError:  # CPU-only installs: every op falls back to PyTorch
    triton = None
HAVE_TRITON = triton is not None


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as [rows, in] with its columns contiguous: the kernels take a row stride, not a
    column one."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def by_row_slices(x: torch.Tensor, out_features: int, rows: int,
                  launch: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    """x [..., in] -> [..., out_features]: `launch(part, out)` over `rows` rows of x's kernel_rows
    at a time, each writing its rows of one output in x's dtype (`out`, rows contiguous; None for
    a single launch, which makes its own), so no copy joins them. The deterministic mode's
    linears launch a fixed number of rows, so that a row's sums do not follow how many rows came
    with it."""
    flat = kernel_rows(x)
    if flat.shape[0] <= rows:
        return launch(flat, None).view(*x.shape[:-1], out_features)
    out = torch.empty(flat.shape[0], out_features, dtype=x.dtype, device=x.device)
    for first in range(0, flat.shape[0], rows):
        launch(flat[first:first + rows], out[first:first + rows])
    return out.view(*x.shape[:-1], out_features)


def use_triton(x: torch.Tensor) -> bool:
    """True where the Triton version of an op should run for tensors like `x`: on CUDA (or under
    the interpreter), and not where autograd needs gradients (the kernels have no backward;
    training runs the differentiable definitions in reference.py)."""
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return HAVE_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# The deterministic mode (`--deterministic`): every kernel of the target's forward then reduces in
# an order that depends on neither the rows in a launch nor how the work is split (fixed tiles,
# fixed split sizes), so a row's logits are the same whether it came from a prefill chunk of any
# size, a tree or one AR row. Process-wide because a process serves one engine and the launchers
# are free functions; the engine sets it before it loads.
_DETERMINISTIC = False
# Its launches (triton_invariant.py, triton_split.fixed_split): K split into runs of DET_SPLIT_K
# where a linear has fewer than DET_WIDE outputs (a wider one fills the GPU with its tiles alone),
# dense linears DET_SLICE rows a launch at most: all functions of a linear's shape alone.
DET_SPLIT_K = 1024
DET_WIDE = 16384
DET_SLICE = 128


def deterministic_splits(in_features: int, out_features: int, step: int) -> int:
    """Programs along K of a linear in the deterministic mode (whole steps of `step` a program)."""
    if out_features >= DET_WIDE:
        return 1
    return max(1, -(-in_features // max(step, DET_SPLIT_K // step * step)))


def deterministic_scratch_bytes(shapes: list[tuple[int, int]], rows: int = DET_SLICE) -> int:
    """The float32 split-K partials of the largest of a model's dense linears `shapes` ((in, out)
    each) in one launch of `rows` rows in the deterministic mode: what the memory plan adds."""
    return max(rows * out * deterministic_splits(inp, out, 64) * 4 for inp, out in shapes)


def deterministic() -> bool:
    """Whether the kernels run in the deterministic mode (set_deterministic)."""
    return _DETERMINISTIC


def set_deterministic(on: bool) -> None:
    """Switch the deterministic mode on or off for every kernel launched from now on."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(on)
