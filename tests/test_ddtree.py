"""DDTree construction and the accept walk."""

import itertools
import math

import pytest
import torch

from flashtree.runtime.ddtree import build_tree, chain_tree, root_only


def draft_logprobs(depth, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)
    return logp


def topk(logp, k):
    return logp.topk(min(k, logp.shape[-1]), dim=-1)


def prefix_scores(logp):
    """Every rank prefix of every depth, by brute force: {(ranks...): score}."""
    depth, vocab = logp.shape
    order = logp.argsort(dim=-1, descending=True)
    out = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(vocab), repeat=d):
            out[ranks] = sum(logp[i, order[i, r]].item() for i, r in enumerate(ranks))
    return out


def node_prefixes(tree, logp):
    order = logp.argsort(dim=-1, descending=True)
    prefixes = []
    for node in range(1, tree.size):
        ranks, cur = [], node
        while cur:
            d = tree.depths[cur]
            ranks.append((order[d - 1] == tree.tokens[cur]).nonzero().item())
            cur = tree.parents[cur]
        prefixes.append(tuple(reversed(ranks)))
    return prefixes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 5, 9, 14])
def test_without_chain_seed_nodes_are_the_top_budget_prefixes(seed, budget):
    logp = draft_logprobs(3, 4, seed)
    vals, ids = topk(logp, budget)
    tree = build_tree(99, vals, ids, budget, chain_seed=False)
    scores = prefix_scores(logp)
    best = sorted(scores.values(), reverse=True)[:budget]
    got = sorted((scores[p] for p in node_prefixes(tree, logp)), reverse=True)
    assert tree.size - 1 == budget
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(got, best))


@pytest.mark.parametrize("chain_seed", [True, False])
@pytest.mark.parametrize("budget", [1, 3, 8, 22, 40])
def test_structure_invariants(chain_seed, budget):
    logp = draft_logprobs(7, 50, budget)
    vals, ids = topk(logp, budget)
    tree = build_tree(1, vals, ids, budget, chain_seed=chain_seed)
    assert tree.size - 1 <= budget
    assert tree.parents[0] == -1 and tree.tokens[0] == 1
    for node in range(1, tree.size):
        parent = tree.parents[node]
        assert parent < node
        assert tree.depths[node] == tree.depths[parent] + 1
    for kids in tree.children():  # sibling tokens are distinct
        assert len(kids) == len(set(kids))
    sibling_tokens = {}
    for node in range(1, tree.size):
        sibling_tokens.setdefault(tree.parents[node], []).append(tree.tokens[node])
    assert all(len(v) == len(set(v)) for v in sibling_tokens.values())


@pytest.mark.parametrize("budget", [3, 7, 22])
def test_chain_seed_contains_top1_chain(budget):
    logp = draft_logprobs(7, 30, 3)
    # make the top-1 chain unlikely as a whole so plain best-first would not pick it entirely
    vals, ids = topk(logp, budget)
    tree = build_tree(0, vals, ids, budget, chain_seed=True)
    top1 = logp.argmax(-1).tolist()
    node = 0
    for d in range(min(7, budget)):
        node = tree.children()[node][top1[d]]
        assert tree.depths[node] == d + 1


def test_max_depth_caps_the_tree():
    logp = draft_logprobs(7, 30, 4)
    vals, ids = topk(logp, 22)
    for cap in (0, 1, 3):
        tree = build_tree(0, vals, ids, 22, chain_seed=True, max_depth=cap)
        assert max(tree.depths) <= cap


@pytest.mark.parametrize("budget", [1, 22, 64, 200])
def test_ancestor_mask_marks_exactly_each_nodes_ancestors(budget):
    gen = torch.Generator().manual_seed(budget)
    logp = torch.log_softmax(torch.randn(15, 300, generator=gen) * 3, -1)
    vals, ids = logp.topk(min(budget, 300), dim=-1)
    tree = build_tree(0, vals, ids, budget, chain_seed=True)
    expected = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    for node in range(tree.size):
        a = node
        while a != -1:  # the definition: walk up the parents to the root
            expected[node, a] = True
            a = tree.parents[a]
    assert torch.equal(tree.ancestor_mask(), expected)


def test_ancestor_mask_and_walk():
    # root(5) -> a(1) -> c(3); root -> b(2)
    from flashtree.runtime.ddtree import Tree
    tree = Tree([5, 1, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2])
    mask = tree.ancestor_mask()
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, False, True, False], [True, True, False, True]]
    # drawn token at each node: root draws 1 (-> a), a draws 3 (-> c), c draws 9 (bonus)
    assert tree.walk([1, 3, 0, 9]) == ([0, 1, 3], 9)
    assert tree.walk([2, 0, 0, 0]) == ([0, 2], 0)
    assert tree.walk([7, 3, 0, 9]) == ([0], 7)
    assert root_only(4).walk([8]) == ([0], 8)
    chain = chain_tree(4, [6, 7])
    assert chain.is_chain() and chain.walk([6, 7, 1]) == ([0, 1, 2], 1)


def test_admit_refuses_candidates_without_spending_budget():
    """A grammar's `admit` keeps refused tokens out; their next siblings take their place, and
    the tree still spends its whole budget when enough candidates are admitted."""
    g = torch.Generator().manual_seed(3)
    vals, ids = torch.randn(6, 8, generator=g).log_softmax(-1).sort(dim=-1, descending=True)
    ids = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(6)])
    odd = lambda tree, parent, tok: tok % 2 == 1  # noqa: E731
    for chain_seed in (True, False):
        tree = build_tree(1, vals, ids, 10, chain_seed=chain_seed, admit=odd)
        assert tree.size == 11
        assert all(t % 2 == 1 for t in tree.tokens[1:])
        unconstrained = build_tree(1, vals, ids, 10, chain_seed=chain_seed)
        assert any(t % 2 == 0 for t in unconstrained.tokens[1:])
        for node in range(tree.size):
            kids = [tree.tokens[c] for c in range(1, tree.size) if tree.parents[c] == node]
            assert len(kids) == len(set(kids))  # siblings stay unique
    assert build_tree(1, vals, ids, 10, admit=lambda tree, parent, tok: False).size == 1
