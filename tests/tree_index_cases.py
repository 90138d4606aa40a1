"""The device tree index's test cases and their check against TreeIndex.build + fill_, shared by
tests/test_tree_index_device.py and the child process that runs the Triton kernel under the
interpreter (which imports this light module, not the test module and its fixtures' imports).

A case is trees of parents [B, N] with n_nodes [B], laid out in `rows` >= N rows, and a conv
kernel width: chains, stars and broom-like paths (the most replayed steps), random trees, the
decoder's own best-first trees with their padding rows (kernels/tree.py's build on the tree
build's cases), and parents a tree never has (roots inside, a parent at or after its child)."""

from __future__ import annotations

from typing import Callable

import torch

from flashtree.kernels.gated_delta import TreeIndex
from flashtree.kernels.tree import reference_build_trees
from tree_cases import ALL_CASES, inputs

Case = tuple[torch.Tensor, torch.Tensor, int, int]  # parents [B, N], n_nodes [B], rows, conv kernel


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def broom(n: int) -> list[int]:
    """A path with a leaf hung on each of its nodes: every leaf after the first restarts and
    replays its path, about n^2 / 8 steps."""
    parents, spine = [-1], 0
    while len(parents) < n:
        parents.append(spine)  # the leaf
        if len(parents) < n:
            parents.append(spine)
            spine = len(parents) - 1
    return parents


def random_tree(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def given(trees: list[list[int]], n_nodes: list[int], rows: int, conv: int = 4) -> Case:
    """Parents lists of one length as a case."""
    return (torch.tensor(trees, dtype=torch.long), torch.tensor(n_nodes, dtype=torch.int32), rows, conv)


def best_first(name: str, extra_rows: int = 0, conv: int = 4) -> Case:
    """The trees kernels/tree.py builds for a tree_cases.py case, padding rows included."""
    b, d, k, budget, chain_seed, caps, _ = spec = ALL_CASES[name]
    logp, ids, bonus, caps = inputs(spec)
    trees = reference_build_trees(logp, ids, bonus, budget, chain_seed, caps)
    return trees.parents, trees.n_nodes, budget + 1 + extra_rows, conv


def odd_parents() -> Case:
    """Roots inside the rows, and parents at or after their child (a row of such is a root)."""
    return given([[-1, 0, -1, 2, 9, 1, 5, 6, 6, -7], [-1, 0, 1, 3, 1, 4, -1, 6, 0, 2]], [10, 8], 12)


CASES: dict[str, Callable[[], Case]] = {
    "root only": lambda: given([[-1]], [1], 1),
    "root in larger buffers": lambda: given([[-1]], [1], 6),
    "chain of 23": lambda: given([chain(23)], [23], 23),
    "star of 23": lambda: given([star(23)], [23], 23),
    "broom of 23": lambda: given([broom(23)], [23], 23),
    "random trees, padding rows": lambda: given([random_tree(17, s) for s in range(3)], [17, 12, 1], 20),
    "best-first": lambda: best_first("random"),
    "best-first with caps (padding rows) in larger buffers": lambda: best_first("random best-first, caps", 5),
    "best-first ties": lambda: best_first("ties"),
    "conv kernel 1": lambda: given([random_tree(9, 3)], [9], 9, 1),
    "conv kernel 2": lambda: given([broom(9)], [9], 11, 2),
    "conv kernel 5": lambda: given([random_tree(12, 4)], [12], 12, 5),
    "odd parents": odd_parents,
}
SLOW_CASES: dict[str, Callable[[], Case]] = {
    "chain of 129": lambda: given([chain(129)], [129], 129),
    "star of 129": lambda: given([star(129)], [129], 129),
    "broom of 129": lambda: given([broom(129)], [129], 129),
    "random trees of 129": lambda: given([random_tree(129, s) for s in range(3)], [129, 100, 64], 129),
    "best-first, budget 64": lambda: best_first("budget 64", 3),
    "best-first, budget 128": lambda: best_first("budget 128 best-first"),
}
ALL: dict[str, Callable[[], Case]] = {**CASES, **SLOW_CASES}


def host_parents(parents: torch.Tensor, n_nodes: int) -> list[int]:
    """One tree's parents as the host build takes them: rows at or past n_nodes, and rows whose
    parent is not an earlier row, roots."""
    return [p if t < n_nodes and 0 <= p < t else -1 for t, p in enumerate(parents.tolist())]


def expected(parents: torch.Tensor, n_nodes: int, rows: int, conv: int) -> TreeIndex:
    """TreeIndex.build of the tree, filled into static buffers of `rows` rows."""
    static = TreeIndex.static(rows, conv, "cpu")
    static.fill_(TreeIndex.build(host_parents(parents, n_nodes), conv, "cpu"))
    return static


def mismatches(build: Callable, case: Case, device: str = "cpu") -> list[str]:
    """Where `build(parents, n_nodes, conv_kernel, rows)` (tree_index.tree_indexes' signature,
    run on `device`) differs from TreeIndex.build + fill_, tree by tree: the step codes up to the
    step count, the segment bounds up to the count, n_segments and conv_rows."""
    parents, n_nodes, rows, conv = case
    got = build(parents.to(device), n_nodes.to(device), conv, rows)
    b = parents.shape[0]
    shapes = [tuple(t.shape) for t in (got.steps, got.bounds, got.n_segments, got.conv_rows)]
    if shapes != [(b, rows * (rows + 1) // 2), (b, rows + 1), (b,), (b, rows, conv)]:
        return [f"shapes {shapes}"]
    steps, bounds, segments, conv_rows = (t.cpu() for t in (got.steps, got.bounds, got.n_segments, got.conv_rows))
    bad = []
    for row in range(b):
        want = expected(parents[row], int(n_nodes[row]), rows, conv)
        n, s = want.n_host, want.segments_host
        if int(segments[row]) != s or bounds[row, :s + 1].tolist() != want.bounds[:s + 1].tolist():
            bad.append(f"tree {row}: segments {bounds[row, :int(segments[row]) + 1].tolist()}, "
                       f"build {want.bounds[:s + 1].tolist()}")
        if steps[row, :n].tolist() != want.steps[:n].tolist():
            bad.append(f"tree {row}: steps {steps[row, :n].tolist()}, build {want.steps[:n].tolist()}")
        if not torch.equal(conv_rows[row], want.conv_rows):
            bad.append(f"tree {row}: conv rows differ")
    return bad
