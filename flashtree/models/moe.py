"""The sparse mixture-of-experts MLP of Qwen3.5-MoE: a softmax top-k router over routed experts,
plus one shared expert scaled by a sigmoid gate.

The experts' weights are held stacked, `gate_up` [E, 2I, H] and `down` [E, H, I], so the forward
picks an expert's matrices by index; checkpoints keep transformers' per-expert names both ways
(`experts.N.gate_proj.weight`, ... on load and in `state_dict()`), as the packed layers of
models/common.py do.

The forward groups the rows by expert and runs each hit expert once over its rows, so one decode
step reads only the k experts a token chose. Grouping needs the counts on the host, which makes
the forward uncapturable: a MoE target runs without CUDA graphs (`capturable` is False).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels.fused import linear, silu_mul
from .common import SwiGLU

STACKS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}  # each stacked parameter's parts


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.register_load_state_dict_pre_hook(_stack_on_load)
        self.register_state_dict_post_hook(_split_on_save)

    def checkpoint_names(self, stack: str) -> list[str]:
        """The checkpoint weights (names below this module) stacked into parameter `stack`: its
        parts of every expert, for errors that name what a file holds (models/checks.py)."""
        return [f"{e}.{part}.weight" for e in range(self.num_experts) for part in STACKS[stack]]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k] (each row's chosen experts and their mixing weights)."""
        k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k                      # the token of each (token, slot) pair, grouped by expert
        scale = weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            take = rows[start:start + n]
            h = silu_mul(linear(x.index_select(0, take), self.gate_up[e]))
            y = linear(h, self.down[e]) * scale[start:start + n]
            out.index_add_(0, take, y)
            start += n
        return out


def _stack_on_load(module: Experts, state: dict, prefix: str, *_: Any) -> None:
    """The checkpoint's weights of every expert (Experts.checkpoint_names) stacked into each
    parameter of STACKS, its parts concatenated along the rows (gate over up)."""
    if all(prefix + name in state for stack in STACKS for name in module.checkpoint_names(stack)):
        for stack, parts in STACKS.items():
            state[prefix + stack] = torch.stack([torch.cat([state.pop(f"{prefix}{e}.{part}.weight") for part in parts])
                                                 for e in range(module.num_experts)])


def _split_on_save(module: Experts, state: dict, prefix: str, *_: Any) -> None:
    """The stacked parameters back into the checkpoint's weights of every expert."""
    if prefix + "gate_up" not in state:
        return
    for stack, parts in STACKS.items():
        stacked = state.pop(prefix + stack)
        for e in range(module.num_experts):
            for part, weight in zip(parts, stacked[e].chunk(len(parts))):
                state[f"{prefix}{e}.{part}.weight"] = weight


class SparseMoE(nn.Module):
    """transformers' Qwen3_5MoeSparseMoeBlock, weight for weight (`mlp.gate`, `mlp.experts.*`,
    `mlp.shared_expert.*`, `mlp.shared_expert_gate`)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter)
        self.shared_expert = SwiGLU(hidden, shared_inter)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        routed = self.experts(x, experts, weights)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
