"""The device tree build's test cases and their check against runtime/ddtree.build_tree, shared by
tests/test_tree_device.py and the child process that runs the Triton kernel under the interpreter
(which imports this light module, not the test module and its fixtures' imports).

The tie cases draw log-probs from a few values, some inexact in binary, so that many prefixes
tie or nearly tie: a float32 scoring builds other trees from them (test_tree_device checks it)."""

from __future__ import annotations

from typing import Callable

import torch

from flashtree.kernels.tree import tree_size
from flashtree.runtime.ddtree import build_tree

# name: (B, D, K, budget, chain_seed, depth caps, kind of log-probs); the interpreted kernel's
# fast test runs CASES, its slow test the rest (seconds together); the definition and CUDA run all
CASES = {
    "random": (1, 7, 5, 22, True, [7], "random"),
    "random best-first, caps": (3, 7, 5, 22, False, [7, 3, 0], "random"),
    "ties": (3, 6, 6, 30, True, [6, 6, 2], "ties"),
    "signed zeros": (3, 4, 3, 12, False, [4, 4, 2], "zeros"),
    "k=1": (3, 4, 1, 10, True, [4, 2, 0], "random"),
    "k=1 best-first": (3, 4, 1, 10, False, [4, 1, 3], "random"),
    "budget 0": (3, 5, 3, 0, True, [5, 5, 5], "random"),
    "budget 1": (3, 5, 3, 1, False, [5, 1, 0], "ties"),
    "budget 2 under the cap": (3, 6, 4, 2, True, [6, 1, 6], "random"),
    "budget above the tree": (3, 3, 2, 40, True, [3, 2, 3], "ties"),
}
SLOW_CASES = {
    "ties best-first": (3, 6, 6, 30, False, [6, 5, 4], "ties"),
    "budget above the tree best-first": (3, 3, 2, 40, False, [3, 1, 3], "random"),
    "equal best-first": (3, 5, 4, 25, False, [5, 4, 5], "equal"),
    "equal log-probs": (3, 5, 4, 25, True, [5, 5, 3], "equal"),
    "draft shaped": (3, 15, 22, 22, True, [15, 15, 6], "ties"),
    "budget 64": (3, 15, 64, 64, True, [15, 9, 15], "ties"),
    "budget 128 best-first": (2, 15, 32, 128, False, [15, 15], "equal"),
}
ALL_CASES = {**CASES, **SLOW_CASES}
VALUES = {"ties": [-0.1, -0.2, -0.3, -0.6, -0.7, -1.1], "equal": [-0.7], "zeros": [0.0, -0.0]}


def inputs(case: tuple, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [B, D, K] sorted descending, ids [B, D, K] distinct per depth, bonus [B], caps [B])."""
    b, d, k, _, _, caps, kind = case
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        logp = torch.log_softmax(torch.randn(b, d, 100, generator=g) * 2, -1).topk(k, -1).values
    else:
        values = torch.tensor(VALUES[kind])
        logp = values[torch.randint(0, len(values), (b, d, k), generator=g)].sort(-1, descending=True).values
    ids = torch.stack([torch.randperm(1000, generator=g)[:k] for _ in range(b * d)]).view(b, d, k)
    return logp, ids, torch.randint(0, 1000, (b,), generator=g), torch.tensor(caps, dtype=torch.int32)


def mismatches(build: Callable, case: tuple, device: str = "cpu") -> list[str]:
    """Where `build`'s trees (built on `device`) differ from build_tree's, row by row; padding
    rows must be copies of the root and n_nodes what tree_size says."""
    logp, ids, bonus, caps = inputs(case)
    b, d, k, budget, chain, _, _ = case
    got = build(logp.to(device), ids.to(device), bonus.to(device), budget, chain, caps.to(device))
    if got.tokens.shape != (b, budget + 1) or got.n_nodes.dtype != torch.int32:
        return [f"shapes {tuple(got.tokens.shape)} {got.n_nodes.dtype}"]
    tokens, parents, depths, n_nodes = (t.cpu() for t in (got.tokens, got.parents, got.depths, got.n_nodes))
    bad = []
    for row in range(b):
        want = build_tree(int(bonus[row]), logp[row], ids[row], budget, chain, int(caps[row]))
        n = int(n_nodes[row])
        if n != want.size or n != tree_size(budget, k, min(d, int(caps[row]))):
            bad.append(f"row {row}: {n} nodes, build_tree {want.size}")
            continue
        if (tokens[row, :n].tolist(), parents[row, :n].tolist(), depths[row, :n].tolist()) != (
                want.tokens, want.parents, want.depths):
            bad.append(f"row {row}: nodes differ")
        if not ((tokens[row, n:] == int(bonus[row])).all() and (parents[row, n:] == -1).all()
                and (depths[row, n:] == 0).all()):
            bad.append(f"row {row}: padding is not the root's copy")
    return bad
