"""Kernels of the CUDA execution path, each with a plain-PyTorch fallback that defines what it
computes (the tests compare the two).

Triton runs on CUDA tensors. Under Triton's own CPU interpreter (TRITON_INTERPRET=1) it also runs
on CPU tensors, which lets a machine without a GPU check the kernels' indexing, slowly.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: every op falls back to PyTorch
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    """True where the Triton version of an op should run for tensors like `x`."""
    return HAVE_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
