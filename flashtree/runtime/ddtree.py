"""DDTree: a best-first draft tree from the draft's per-depth log-probs, its attention mask, and
the accept walk.

A node is a rank prefix (r1, ..., rd): its token at depth d is the draft's r_d-th choice for
depth d, its score the sum of the chosen log-probs. Because the log-probs of a depth are sorted
and all <= 0, a node never scores above its parent or its previous sibling, so popping the best
frontier node and pushing its next sibling and first child enumerates prefixes in score order.
Nodes are numbered in insertion order, so a parent always precedes its children.

kernels/tree.py builds the same trees on the device (the decode step's ddtree path without a
grammar), its masks and its walk: a change to the rule here (the score's additions and their
order, the tie-break by insertion order, the chain seed) must be made there too, and
tests/test_tree_device.py holds the two equal node for node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch


@dataclass
class Tree:
    tokens: list[int]          # node 0 is the root: the pending bonus token
    parents: list[int]         # parents[0] == -1
    depths: list[int]
    _children: Optional[list[dict[int, int]]] = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """Per node: child token -> child node (tokens are unique among siblings)."""
        if self._children is None:
            kids: list[dict[int, int]] = [{} for _ in self.tokens]
            for node in range(1, self.size):
                kids[self.parents[node]][self.tokens[node]] = node
            self._children = kids
        return self._children

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: row i is True at i's ancestors and i itself (the verify attention mask)."""
        n = self.size
        rows = []  # built as bytes, then one tensor: a tensor op per row costs far more a node
        for node in range(n):
            row = bytearray(rows[self.parents[node]]) if node else bytearray(n)
            row[node] = 1
            rows.append(row)
        mask = torch.frombuffer(bytearray().join(rows), dtype=torch.bool).view(n, n)
        return mask.to(device)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def walk(self, drawn: Sequence[int]) -> tuple[list[int], int]:
        """Follow the target's own draws from the root: descend while the token drawn at a node
        is one of its children. Returns the accepted nodes (root first) and the next bonus."""
        kids = self.children()
        path = [0]
        while True:
            nxt = kids[path[-1]].get(int(drawn[path[-1]]))
            if nxt is None:
                return path, int(drawn[path[-1]])
            path.append(nxt)


def root_only(bonus: int) -> Tree:
    """The 'tree' of autoregressive decoding: just the pending token."""
    return Tree([bonus], [-1], [0])


def chain_tree(bonus: int, tokens: Sequence[int]) -> Tree:
    n = len(tokens)
    return Tree([bonus, *map(int, tokens)], list(range(-1, n)), list(range(n + 1)))


Admit = Callable[[Tree, int, int], bool]  # (tree so far, parent node, token) -> may it be a child


def build_tree(bonus: int, logp: torch.Tensor, ids: torch.Tensor, budget: int,
               chain_seed: bool = True, max_depth: Optional[int] = None,
               admit: Optional[Admit] = None) -> Tree:
    """Best-first tree of at most `budget` nodes (plus the root).

    logp, ids: [D, K] per-depth top-K log-probs (descending) and their token ids, on the host.
    `max_depth` caps the depth (the context or max_tokens may not leave room for D). `admit`
    (a grammar's) refuses candidates that could never be accepted: a refused one takes no budget
    and has no children, and its next sibling is tried in its place."""
    lp = logp.tolist()
    tok = ids.tolist()
    depth_cap = min(len(lp), max_depth if max_depth is not None else len(lp))
    k = len(lp[0]) if lp else 0
    tree = Tree([bonus], [-1], [0])
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, order, depth, rank, parent)
    order = 0

    def push(score: float, depth: int, rank: int, parent: int) -> None:
        nonlocal order
        heapq.heappush(frontier, (-score, order, depth, rank, parent))
        order += 1

    def add(depth: int, rank: int, parent: int) -> int:
        tree.tokens.append(tok[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        return tree.size - 1

    if depth_cap == 0 or budget <= 0 or k == 0:
        return tree
    if chain_seed:
        parent, score, whole = 0, 0.0, True
        for depth in range(1, min(depth_cap, budget) + 1):
            if k > 1:
                push(score + lp[depth - 1][1], depth, 1, parent)
            if admit is not None and not admit(tree, parent, tok[depth - 1][0]):
                whole = False  # the chain ends at its first refused token
                break
            score += lp[depth - 1][0]
            parent = add(depth, 0, parent)
        if whole and parent and tree.depths[parent] < depth_cap:
            push(score + lp[tree.depths[parent]][0], tree.depths[parent] + 1, 0, parent)
    else:
        push(lp[0][0], 1, 0, 0)
    while frontier and tree.size - 1 < budget:
        neg, _, depth, rank, parent = heapq.heappop(frontier)
        score = -neg
        if rank + 1 < k:
            push(score - lp[depth - 1][rank] + lp[depth - 1][rank + 1], depth, rank + 1, parent)
        if admit is not None and not admit(tree, parent, tok[depth - 1][rank]):
            continue
        node = add(depth, rank, parent)
        if depth < depth_cap:
            push(score + lp[depth][0], depth + 1, 0, node)
    return tree
