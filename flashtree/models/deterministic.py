"""The deterministic mode (`--deterministic`) applied to a loaded target.

A greedy token is the argmax of its row's logits, and the engine computes a row in many
company: a prefill chunk of any size (smaller ones after an out-of-memory), a verified tree, one
AR row, a prompt whose prefix came from the cache. Default kernels pick their tiles and splits
from the rows they are given, so near-ties can flip between those paths. In this mode every
kernel of the target's forward reduces in one order whatever the rows (kernels.deterministic):
the dense linears (a MoE's experts too) through kernels/triton_invariant.py, the quantized ones
through one launch of their GEMM (kernels/quant.py), attention through one launch with splits at
fixed key positions (triton_attention.deterministic_plan). The rest already works row by row or
in one order: the norms, RoPE, the KV store and the gates; a hybrid's Gated DeltaNet scan, whose
prefill chunks, tree and fold take the same steps (the opt-in fla-core chunked prefill, which
reduces otherwise, is off in the mode); a MoE's expert outputs, added in expert order. The
draft's dense linears keep cuBLAS: it only proposes, and the target decides every token.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels import set_deterministic, use_triton
from ..kernels.fused import linear
from .registry import TargetModel


class InvariantLinear(nn.Linear):
    """nn.Linear through kernels.fused.linear: in the deterministic mode its rows are computed
    alike whatever rows come with them (triton_invariant), where the Triton kernels run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def check_deterministic(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what the mode cannot promise: it needs the Triton kernels, on CUDA in bfloat16 or
    float16 (the CPU's definitions reduce as torch's CPU matmul does; Triton's CPU interpreter,
    which the tests use, runs them in float32 too)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    sixteen = dtype in (torch.bfloat16, torch.float16)
    if not use_triton(probe) or (device.type == "cuda" and not sixteen):
        raise ConfigError("--deterministic runs the Triton kernels: it needs a CUDA device and bfloat16 or "
                          f"float16 weights (got {device.type}, {str(dtype).removeprefix('torch.')})")


def make_deterministic(target: TargetModel, device: torch.device, dtype: torch.dtype, on: bool = True) -> int:
    """Set the kernels' mode for a freshly loaded `target` (off, unless `on`: a process's earlier
    engine may have switched it on); on, also every dense nn.Linear of `target` (the lm_head
    included) to InvariantLinear, in place (the class changes; parameters, tying and state-dict
    hooks stay). Returns how many linears changed. Raises ConfigError where check_deterministic
    does."""
    set_deterministic(False)
    if not on:
        return 0
    check_deterministic(device, dtype)
    set_deterministic(True)
    changed = 0
    for module in target.modules():
        if type(module) is nn.Linear:
            module.__class__ = InvariantLinear
            changed += 1
    return changed
