"""The device tree (kernels/tree.py, kernels/triton_tree.py) against the host's rules: the build
equals runtime/ddtree.build_tree node for node, row by row (its definition on the CPU, the Triton
kernel under the interpreter here and compiled for sm_90, and on CUDA in the `gpu` tests), the
masks equal Tree.ancestor_mask, the accept walk equals Tree.walk, and a decode step through them
emits what the host path emits, draw for draw. The build's cases are in tree_cases.py."""

from __future__ import annotations

import heapq
import textwrap
import traceback
import warnings

import numpy as np
import pytest
import torch
from interpreted import run_interpreted
from test_decoding import (N_TOKENS, PROMPT, SAMPLING, chi2_pvalue, exact, reference,  # noqa: F401
                           sample_counts, tiny_vocab_pair)
from tree_cases import ALL_CASES, inputs, mismatches

from flashtree import Engine, SamplingParams
from flashtree.kernels.tree import (accept, ancestor_masks, build_trees, reference_build_trees, tree_positions,
                                    tree_size)
from flashtree.runtime import decoding, device_step
from flashtree.runtime.ddtree import Tree, build_tree

# torch.cuda.set_sync_debug_mode itself makes a synchronizing call (reported from this file)
# as it switches the check on: not the step's
SYNC_MODE_SWITCH = "torch/cuda/__init__.py"


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_the_definition_builds_build_trees_nodes(name):
    assert mismatches(reference_build_trees, ALL_CASES[name]) == []


INTERPRETED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import torch
    from flashtree.kernels import use_triton
    from flashtree.kernels.tree import build_trees
    from tree_cases import CASES, SLOW_CASES, mismatches
    assert use_triton(torch.zeros(1))  # the kernel, not the definition
    cases = SLOW_CASES if sys.argv[1] == "slow" else CASES
    print(json.dumps({name: mismatches(build_trees, case) for name, case in cases.items()}))
""")


@pytest.mark.parametrize("which", ["fast", pytest.param("slow", marks=pytest.mark.slow)])
def test_the_kernel_under_the_interpreter_builds_build_trees_nodes(which):
    pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")
    found = run_interpreted(INTERPRETED, which, threads=1)
    assert found and all(v == [] for v in found.values()), found


def test_the_kernel_compiles_for_sm90():
    """Triton's compiler is stricter than its interpreter (types of loop-carried values, float64
    reductions): both variants compile for the H100/H200 (ptxas included), and the scores stay
    float64 with no fused multiply-add."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashtree.kernels.triton_tree import _build_trees_kernel

    types = ["*fp32", "*i64", "*i64", "*i32", "*i64", "*i64", "*i64", "*i32", "i32", "i32", "i32"]
    for chain in (True, False):
        constants = {"CHAIN": chain, "F": 256, "NP": 128}
        runtime = [n for n in _build_trees_kernel.arg_names if n not in constants]
        signature = dict(zip(runtime, types, strict=True)) | {n: "constexpr" for n in constants}
        compiled = triton.compile(ASTSource(fn=_build_trees_kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "add.f64" in ptx and "sub.f64" in ptx and "fma" not in ptx


def float32_tree(bonus: int, logp: torch.Tensor, ids: torch.Tensor, budget: int, chain: bool,
                 cap: int) -> list[int]:
    """build_tree's tokens with every score rounded to float32 (what a float32 kernel computes)."""
    lp, f32, k = logp.numpy().astype(np.float32), np.float32, logp.shape[1]
    tokens, depths, frontier, order = [bonus], [0], [], [0]

    def push(score, depth, rank, parent):
        heapq.heappush(frontier, (-score, order[0], depth, rank, parent))
        order[0] += 1

    def add(depth, rank):
        tokens.append(int(ids[depth - 1, rank]))
        depths.append(depth)
        return len(tokens) - 1

    if cap <= 0 or budget <= 0 or k == 0:
        return tokens
    if chain:
        parent, score = 0, f32(0)
        for depth in range(1, min(cap, budget) + 1):
            if k > 1:
                push(f32(score + lp[depth - 1, 1]), depth, 1, parent)
            score, parent = f32(score + lp[depth - 1, 0]), add(depth, 0)
        if depths[parent] < cap:
            push(f32(score + lp[depths[parent], 0]), depths[parent] + 1, 0, parent)
    else:
        push(lp[0, 0], 1, 0, 0)
    while frontier and len(tokens) - 1 < budget:
        neg, _, depth, rank, parent = heapq.heappop(frontier)
        if rank + 1 < k:
            push(f32(f32(-neg - lp[depth - 1, rank]) + lp[depth - 1, rank + 1]), depth, rank + 1, parent)
        node = add(depth, rank)
        if depth < cap:
            push(f32(-neg + lp[depth, 0]), depth + 1, 0, node)
    return tokens


def test_float32_scores_would_build_other_trees_from_the_tie_cases():
    """Why the kernel's scores are float64: on the tie cases a float32 build parts from
    build_tree, so those cases would catch a kernel that rounds its scores to float32."""
    for name in ("ties", "ties best-first"):
        b, _, _, budget, chain, caps, _ = case = ALL_CASES[name]
        logp, ids, bonus, _ = inputs(case)
        differ = [float32_tree(int(bonus[r]), logp[r], ids[r], budget, chain, caps[r])
                  != build_tree(int(bonus[r]), logp[r], ids[r], budget, chain, caps[r]).tokens for r in range(b)]
        assert any(differ), name


def test_empty_inputs_give_root_only_trees():
    for d, k in ((0, 3), (4, 0)):
        got = build_trees(torch.zeros(2, d, k), torch.zeros(2, d, k, dtype=torch.long), torch.tensor([5, 6]), 4,
                          True, torch.tensor([4, 4]))
        assert got.n_nodes.tolist() == [1, 1] and got.tokens.tolist() == [[5] * 5, [6] * 5]
    assert tree_size(0, 5, 5) == tree_size(5, 0, 5) == tree_size(5, 5, 0) == 1
    assert tree_size(40, 2, 3) == 15 and tree_size(14, 2, 3) == 15 and tree_size(13, 2, 3) == 14


def random_trees(seed: int, b: int = 3) -> tuple:
    """Trees of several sizes side by side (padding rows after the smaller ones)."""
    g = torch.Generator().manual_seed(seed)
    budget = int(torch.randint(1, 40, (1,), generator=g))
    logp, ids = torch.log_softmax(torch.randn(b, 6, 30, generator=g), -1).topk(5, -1)
    caps = torch.randint(0, 7, (b,), generator=g).int()
    return build_trees(logp, ids, torch.randint(0, 30, (b,), generator=g), budget, bool(seed % 2), caps), g


def host_tree(trees, row: int) -> Tree:
    n = int(trees.n_nodes[row])
    return Tree(trees.tokens[row, :n].tolist(), trees.parents[row, :n].tolist(), trees.depths[row, :n].tolist())


def test_ancestor_masks_and_positions_equal_the_host_trees():
    for seed in range(40):
        trees, _ = random_trees(seed)
        masks, n = ancestor_masks(trees.parents, trees.n_nodes), trees.tokens.shape[1]
        positions = tree_positions(trees.depths, torch.tensor([0, 7, 100]))
        for row in range(3):
            tree = host_tree(trees, row)
            want = torch.eye(n, dtype=torch.bool)  # padding rows see only themselves
            want[:tree.size, :tree.size] = tree.ancestor_mask()
            assert torch.equal(masks[row], want), (seed, row)
            assert positions[row, :tree.size].tolist() == [d + [0, 7, 100][row] for d in tree.depths]
    assert torch.equal(tree_positions(trees.depths, 9), trees.depths + 9)


def test_accept_equals_the_host_walk():
    """Draws mostly follow a child (long paths, side branches), else any token; the path is
    padded with its last node."""
    for seed in range(150):
        trees, g = random_trees(seed)
        n = trees.tokens.shape[1]
        drawn = torch.randint(0, 30, (3, n), generator=g)
        for row in range(3):
            kids = host_tree(trees, row).children()
            for node, children in enumerate(kids):
                if children and torch.rand(1, generator=g) < 0.8:
                    drawn[row, node] = list(children)[int(torch.randint(len(children), (1,), generator=g))]
        with_mask = accept(trees.tokens, trees.parents, trees.n_nodes, drawn,
                           ancestor_masks(trees.parents, trees.n_nodes))
        path, length, nxt = accept(trees.tokens, trees.parents, trees.n_nodes, drawn)
        assert all(torch.equal(a, b) for a, b in zip(with_mask, (path, length, nxt)))
        for row in range(3):
            want, bonus = host_tree(trees, row).walk(drawn[row].tolist())
            m = int(length[row])
            assert path[row, :m].tolist() == want and int(nxt[row]) == bonus, (seed, row)
            assert (path[row, m:] == want[-1]).all()


def test_the_mask_and_the_walk_read_nothing_back(monkeypatch):
    """No value leaves the device inside them (on a GPU each read would be a sync)."""
    trees, _ = random_trees(3)
    drawn = torch.zeros_like(trees.tokens)

    def refuse(*args, **kwargs):
        raise AssertionError("a value was read back to the host")

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    masks = ancestor_masks(trees.parents, trees.n_nodes)
    accept(trees.tokens, trees.parents, trees.n_nodes, drawn, masks)
    accept(trees.tokens, trees.parents, trees.n_nodes, drawn)
    tree_positions(trees.depths, torch.tensor([1, 2, 3]))


# ---- the decode step ------------------------------------------------------------------------

def host_launch(self, bonus, sampler, max_emit, want_trace=False, grammar=None, ahead=None):
    """Every step as a host step: the draft's top-k read, build_tree, Tree.walk, the host commit
    (the ddtree step as it was before the device tree; nothing is ever drafted ahead)."""
    depth_cap = min(self.block_size - 1, max_emit - 1)
    return decoding.Launched(result=self._host_step(bonus, sampler, depth_cap, want_trace, grammar))


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"repetition_penalty": 1.3, "presence_penalty": 0.5}])
def test_the_device_step_emits_what_the_host_step_emits(tiny_vocab_pair, extra, monkeypatch):
    """At temperature > 0, seed by seed: the same trees, draws, paths, logprobs and traces (the
    penalties' per-node history reads the device mask)."""
    target, draft = tiny_vocab_pair
    results = []
    for launch in (None, host_launch):
        if launch is not None:
            monkeypatch.setattr(decoding.Decoder, "launch", launch)
        eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=6, max_ctx=64)
        params = [SamplingParams(**{**SAMPLING.to_dict(), **extra, "seed": s}) for s in range(12)]
        results.append([eng.generate([1, 2, 3], p, max_tokens=10, stop_token_ids=[], trace=True) for p in params])
    for device, host in zip(*results):
        assert device.token_ids == host.token_ids and device.trace == host.trace
        assert device.logprobs == host.logprobs
    assert any(len(t["tree_tokens"]) > 2 for r in results[0] for t in r.trace)  # real trees ran


def test_ddtree_greedy_equals_ar_without_the_host_build(tiny_pair, reference, monkeypatch):  # noqa: F811
    def refuse(*args, **kwargs):
        raise AssertionError("the ddtree step built its tree on the host")

    monkeypatch.setattr(decoding, "build_tree", refuse)
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), mode="ddtree", budget=8, block_size=8,
                                 max_ctx=512)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    assert res.token_ids == reference
    for t in res.trace:  # the trace still reports the tree and its accepted path (root only at the end)
        assert len(t["tree_tokens"]) == len(t["tree_parents"]) in (1, tree_size(8, 8, 7))
        assert len(t["draft_tokens"]) == (7 if len(t["tree_tokens"]) > 1 else 0)
        assert t["accepted"][0] == 0 and all(t["tree_parents"][b] == a for a, b in zip(t["accepted"],
                                                                                       t["accepted"][1:]))


@pytest.mark.slow  # 10-15 s: the distribution test's power on the device walk
def test_a_biased_device_walk_is_detected(tiny_vocab_pair, exact, monkeypatch):  # noqa: F811
    """Taking the root's first child whatever the target drew there biases the output, and the
    distribution test (test_decoding) would catch it on the device path."""
    original = device_step.accept

    def biased(tokens, parents, n_nodes, drawn, ancestors=None):
        drawn = drawn.clone()
        drawn[:, 0] = torch.where(n_nodes > 1, tokens[:, 1], drawn[:, 0])
        return original(tokens, parents, n_nodes, drawn, ancestors)

    monkeypatch.setattr(device_step, "accept", biased)
    target, draft = tiny_vocab_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=6, max_ctx=64)
    counts, _ = sample_counts(eng, 1500)
    assert chi2_pvalue(counts, exact, 1500) < 1e-3


# ---- CUDA -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_the_kernel_on_cuda_builds_build_trees_nodes(name):
    assert mismatches(build_trees, ALL_CASES[name], "cuda") == []


@pytest.mark.gpu
def test_the_kernel_on_cuda_equals_the_definition_at_serving_shapes():
    """Many rows at once (one program each), bf16-rounded log-probs as a bf16 draft gives them."""
    for seed, (b, budget, chain) in enumerate([(8, 22, True), (8, 64, True), (5, 64, False), (16, 128, True)]):
        g = torch.Generator().manual_seed(seed)
        vals, ids = torch.log_softmax(torch.randn(b, 15, 4096, generator=g) * 3, -1).topk(budget, -1)
        vals = vals.bfloat16().float()
        bonus, caps = torch.randint(0, 4096, (b,), generator=g), torch.randint(0, 16, (b,), generator=g).int()
        want = reference_build_trees(vals, ids, bonus, budget, chain, caps)
        got = build_trees(vals.cuda(), ids.cuda(), bonus.cuda(), budget, chain, caps.cuda())
        for field in ("tokens", "parents", "depths", "n_nodes"):
            assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), (seed, field)
        masks = ancestor_masks(got.parents, got.n_nodes)
        assert torch.equal(masks.cpu(), ancestor_masks(want.parents, want.n_nodes))
        drawn = torch.where(torch.rand(b, budget + 1, generator=g) < 0.7, want.tokens.roll(-1, 1),
                            torch.randint(0, 4096, (b, budget + 1), generator=g))
        on_cuda = accept(got.tokens, got.parents, got.n_nodes, drawn.cuda(), masks)
        on_cpu = accept(want.tokens, want.parents, want.n_nodes, drawn)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(on_cuda, on_cpu))


@pytest.mark.gpu
def test_a_ddtree_step_reads_the_device_once(monkeypatch):
    """The one synchronizing call of a ddtree step (CUDA graphs, bf16) is the read of its
    result (a wait on the event behind its result's copy); any other is named by the file and
    line that made it. The embedded pair: its heads are wide enough for the CUDA attention
    kernels, unlike the tiny test pairs'."""
    from flashtree.runtime.engine import ASSETS
    from flashtree.runtime.sampling import Sampler

    eng = Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda",
                                 dtype="bfloat16", mode="ddtree", budget=22, max_ctx=512)
    eng.generate(PROMPT, max_tokens=16, stop_token_ids=[])  # compiles, captures
    dec = eng.decoder
    dec.state.truncate(0)
    bonus = int(dec.prefill_chunk(PROMPT).argmax())
    sampler = Sampler(SamplingParams(), eng.target.config.vocab_size, dec.device, PROMPT)
    syncs: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and not filename.endswith(SYNC_MODE_SWITCH):  # where in flashtree
            ours = [f for f in traceback.extract_stack() if "/flashtree/" in f.filename]
            syncs.append(f"{ours[-1].filename}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}")

    wait = torch.cuda.Event.synchronize  # an event's wait is no sync the debug mode reports
    monkeypatch.setattr(torch.cuda.Event, "synchronize",
                        lambda self: record("event synchronize", None, "?", 0) or wait(self))

    for _ in range(3):
        torch.cuda.synchronize()
        syncs.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = dec.step(bonus, sampler, 64)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert len(syncs) == 1, syncs
        bonus = res.tokens[-1]
