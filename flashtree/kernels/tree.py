"""DDTree on the device: the draft's candidates (draft_top_k), the best-first tree build, its
attention mask and positions, and the accept walk, over rows of one or more sequences, so that a
decode step keeps its tree on the device and the host reads only what the step accepted.

The tree rule is runtime/ddtree.build_tree's (without a grammar's `admit`), which this package
cannot import (kernels import nothing above them); the tests hold the two equal node for node.
A node is a rank prefix (r1, ..., rd) of the draft's per-depth top-K: its token is the r_d-th
id of depth d, its score the sum of the chosen log-probs. The frontier pops the best score and,
among equal scores, the earliest pushed entry (the host heap orders (-score, insertion order)).

Scores are float64 and summed in build_tree's order (it adds Python floats): the same additions
in the same order round the same, so exact and near ties break alike. In float32 two prefixes
that tie in float64 can differ by a rounding (and the reverse), and the trees would part.
The log-probs must be finite (log_softmax of finite logits is): a -inf gives NaN scores, whose
heap order is not defined.

Layout of a DeviceTrees row: node 0 is the root (the pending bonus token, parent -1, depth 0),
then the nodes in insertion order (a parent precedes its children), then padding up to
budget + 1 rows. A padding row is a copy of the root: token = the bonus, parent -1, depth 0, a
root of its own. Its token is a valid id, it is nobody's ancestor, its mask row sees only
itself and the accept walk never enters it (it is no node's child).

Definitions (plain PyTorch, the spec) and the dispatch to the Triton kernel of the build
(triton_tree.py) live here; the mask and the walk are vectorised PyTorch on any device and
never read a value back to the host.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import use_triton


@dataclass
class DeviceTrees:
    tokens: torch.Tensor   # [B, budget + 1] long: node tokens, node 0 the bonus
    parents: torch.Tensor  # [B, budget + 1] long: -1 at the root and at padding rows
    depths: torch.Tensor   # [B, budget + 1] long: 0 at the root and at padding rows
    n_nodes: torch.Tensor  # [B] int32: nodes including the root (rows past it are padding)


def tree_size(budget: int, k: int, depth_cap: int) -> int:
    """Nodes (root included) of the tree built from a [D >= depth_cap, k] top-k: every rank
    prefix of length <= depth_cap is reachable (a popped node pushes its next sibling and its
    first child, the chain seed covers its own), so the frontier runs dry only when all
    k + k^2 + ... + k^depth_cap of them are in. Known on the host without reading the tree."""
    if budget <= 0 or k <= 0 or depth_cap <= 0:
        return 1
    total, level = 0, 1
    for _ in range(depth_cap):
        level *= k
        total += level
        if total >= budget:
            return budget + 1
    return total + 1


def draft_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a ddtree is built from: each row's top k of log_softmax(logits [R, V]) as log-probs
    [R, k] float32 and tokens [R, k] long, best first. On the GPU one pass over the logits
    (triton_topk.py), not a log-softmax written over the whole vocabulary and a radix select
    reading it again; elsewhere those two ops. Equal values come in index order on the GPU and
    in torch.topk's order elsewhere: either is a valid proposal, and one device takes one path."""
    if use_triton(logits):
        from .triton_topk import top_k_log_probs

        return top_k_log_probs(logits, k)
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def _check(logp: torch.Tensor, ids: torch.Tensor, bonus: torch.Tensor, budget: int,
           depth_cap: torch.Tensor) -> None:
    if logp.dim() != 3 or ids.shape != logp.shape:
        raise ValueError(f"logp and ids must be [B, D, K] alike, got {tuple(logp.shape)} and {tuple(ids.shape)}")
    if bonus.shape != logp.shape[:1] or depth_cap.shape != logp.shape[:1]:
        raise ValueError(f"bonus and depth_cap must be [B={logp.shape[0]}]")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")


def build_trees(logp: torch.Tensor, ids: torch.Tensor, bonus: torch.Tensor, budget: int,
                chain_seed: bool, depth_cap: torch.Tensor) -> DeviceTrees:
    """One best-first tree per row of at most `budget` nodes plus the root.

    logp [B, D, K] float32, each depth's log-probs sorted descending; ids [B, D, K] long, their
    tokens; bonus [B] long, each root's token; depth_cap [B] int, each row's deepest depth
    (clamped to [0, D]: the room its context and max_tokens leave). With `chain_seed` the top-1
    chain (up to the cap and the budget) goes in first. Runs the Triton kernel where Triton
    runs (one program per row), else the definition; both give build_tree's nodes in its order.
    Nothing is read back to the host."""
    _check(logp, ids, bonus, budget, depth_cap)
    if use_triton(logp) and logp.shape[1] > 0 and logp.shape[2] > 0 and budget > 0:
        from .triton_tree import build_trees as kernel

        return DeviceTrees(*kernel(logp, ids, bonus, budget, chain_seed, depth_cap))
    return reference_build_trees(logp, ids, bonus, budget, chain_seed, depth_cap)


def reference_build_trees(logp: torch.Tensor, ids: torch.Tensor, bonus: torch.Tensor, budget: int,
                          chain_seed: bool, depth_cap: torch.Tensor) -> DeviceTrees:
    """The definition: build_tree's loop (admit None) row by row, on the host, the result moved
    to logp's device. Python floats are float64, as the kernel's scores."""
    _check(logp, ids, bonus, budget, depth_cap)
    rows = [_one_tree(lp, tok, root, budget, chain_seed, cap)
            for lp, tok, root, cap in zip(logp.tolist(), ids.tolist(), bonus.tolist(), depth_cap.tolist())]
    width = budget + 1
    out = torch.empty(3, len(rows), width, dtype=torch.long)
    for b, (tokens, parents, depths) in enumerate(rows):
        n, root = len(tokens), tokens[0]
        out[0, b] = torch.tensor(tokens + [root] * (width - n))
        out[1, b] = torch.tensor(parents + [-1] * (width - n))
        out[2, b] = torch.tensor(depths + [0] * (width - n))
    n_nodes = torch.tensor([len(r[0]) for r in rows], dtype=torch.int32)
    out = out.to(logp.device)
    return DeviceTrees(out[0], out[1], out[2], n_nodes.to(logp.device))


def _one_tree(lp: list[list[float]], tok: list[list[int]], root: int, budget: int, chain_seed: bool,
              cap: int) -> tuple[list[int], list[int], list[int]]:
    """One row's tree as (tokens, parents, depths) lists: the frontier is a heap of
    (-score, insertion order, depth, rank, parent); a popped entry becomes a node, and pushes
    its next sibling (its score less its own log-prob plus the sibling's) and its first child."""
    cap = max(0, min(len(lp), cap))
    k = len(lp[0]) if lp else 0
    tokens, parents, depths = [root], [-1], [0]
    frontier: list[tuple[float, int, int, int, int]] = []
    order = 0

    def push(score: float, depth: int, rank: int, parent: int) -> None:
        nonlocal order
        heapq.heappush(frontier, (-score, order, depth, rank, parent))
        order += 1

    def add(depth: int, rank: int, parent: int) -> int:
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        return len(tokens) - 1

    if cap == 0 or budget <= 0 or k == 0:
        return tokens, parents, depths
    if chain_seed:
        parent, score = 0, 0.0
        for depth in range(1, min(cap, budget) + 1):
            if k > 1:
                push(score + lp[depth - 1][1], depth, 1, parent)
            score += lp[depth - 1][0]
            parent = add(depth, 0, parent)
        if depths[parent] < cap:
            push(score + lp[depths[parent]][0], depths[parent] + 1, 0, parent)
    else:
        push(lp[0][0], 1, 0, 0)
    while frontier and len(tokens) - 1 < budget:
        neg, _, depth, rank, parent = heapq.heappop(frontier)
        score = -neg
        if rank + 1 < k:
            push(score - lp[depth - 1][rank] + lp[depth - 1][rank + 1], depth, rank + 1, parent)
        node = add(depth, rank, parent)
        if depth < cap:
            push(score + lp[depth][0], depth + 1, 0, node)
    return tokens, parents, depths


def ancestor_masks(parents: torch.Tensor, n_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: row i is True at i's ancestors and at i (the verify attention mask); a
    padding row (i >= n_nodes) sees only itself. By pointer doubling: each round a row takes in
    the rows of the ancestor its pointer names and the pointer jumps twice as far, so
    ceil(log2(N - 1)) rounds reach the root from any depth: a count the shape gives, so the
    loop never reads the tree."""
    b, n = parents.shape
    at = torch.arange(n, device=parents.device)
    own = at.expand(b, n)
    real = own < n_nodes.to(parents.device)[:, None]
    jump = torch.where(real & (parents >= 0), parents, own)  # roots and padding point at themselves
    mask = (jump[:, :, None] == at) | (own[:, :, None] == at)  # self and parent
    for _ in range(max(0, n - 2).bit_length()):
        mask = mask | mask.gather(1, jump[:, :, None].expand(b, n, n))
        jump = jump.gather(1, jump)
    return mask


def tree_positions(depths: torch.Tensor, start: Union[int, torch.Tensor]) -> torch.Tensor:
    """Each node's sequence position: its depth past `start` (the committed length; an int, or
    a [B] tensor of the rows' lengths)."""
    if isinstance(start, torch.Tensor) and start.dim() == 1:
        start = start[:, None]
    return depths + start


def accept(tokens: torch.Tensor, parents: torch.Tensor, n_nodes: torch.Tensor, drawn: torch.Tensor,
           ancestors: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accept walk of every row (Tree.walk's): from the root, descend while the token the
    target drew at a node is one of its children's; the draw at the last node is the next bonus.

    A node is on the path iff every node from the root down to it was the draw of its parent:
    (tokens[j] == drawn[parent[j]]) for each ancestor j but the root. Sibling tokens are unique
    (they are distinct top-k ids), so at most one child of a path node qualifies and the
    qualifying nodes form one path; node ids grow with depth along it. drawn [B, N] long: the
    target's draw at each node (padding rows: anything). `ancestors` ([B, N, N], as
    ancestor_masks gives) saves recomputing the mask. Returns path [B, N] long (the path's
    nodes root first, padded with its last node, so that a gather by it stays on real rows),
    path_len [B] long and next_bonus [B] long, all on the device."""
    b, n = tokens.shape
    at = torch.arange(n, device=tokens.device)
    if ancestors is None:
        ancestors = ancestor_masks(parents, n_nodes)
    real = at[None, :] < n_nodes.to(tokens.device)[:, None]
    hit = (tokens == drawn.gather(1, parents.clamp(min=0))) & real & (parents >= 0)
    hit = hit | (at == 0)[None, :]  # the root is always on the path
    on_path = ~(ancestors & ~hit[:, None, :]).any(-1)
    path_len = on_path.sum(1)
    rank = on_path.cumsum(1) - 1  # position of a path node along the path
    pick = on_path[:, None, :] & (rank[:, None, :] == at[None, :, None])  # [B, position, node]
    path = (pick.long() * at).sum(-1)
    last = path.gather(1, (path_len - 1)[:, None])
    path = torch.where(at[None, :] < path_len[:, None], path, last)
    return path, path_len, drawn.gather(1, last).squeeze(1)
