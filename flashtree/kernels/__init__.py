"""Kernels of the execution path, each with a plain-PyTorch definition (reference.py) of what it
computes, which also runs wherever Triton does not (the tests compare the two). This package
imports nothing else of flashtree.

Triton runs on CUDA tensors. Under Triton's own CPU interpreter (TRITON_INTERPRET=1) it also runs
on CPU tensors, which lets a machine without a GPU check the kernels' indexing, slowly.
"""

from __future__ import annotations

import os

import torch

# The kernels were written, tuned and checked against their definitions with Triton fusing a * b + c
# into one fma (its default through 3.9, which warns that 3.10 turns it off). Saying so here, before
# any kernel compiles, keeps their rounding when the default moves and silences that warning; a
# value the user set is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: every op falls back to PyTorch
    HAVE_TRITON = False


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


def deterministic() -> bool:
    """Whether the kernels run in the deterministic mode (set_deterministic)."""
    return _DETERMINISTIC


def set_deterministic(on: bool) -> None:
    """Switch the deterministic mode on or off for every kernel launched from now on."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(on)
