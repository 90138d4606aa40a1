"""The CUDA path's forwards and runner, checked on the CPU (kernels fall back to PyTorch there):
the fused forwards compute what the plain models compute, and decoding through the runner's
static buffers (padding, masks, device lengths, context append) emits the plain tokens."""

import pytest
import torch

from flashtree import Engine
from flashtree.kernels.attention import cache_attention
from flashtree.models.common import attention, prefix_block_mask
from flashtree.runtime.cuda_graphs import GraphRunner
from flashtree.runtime.ddtree import build_tree
from flashtree.runtime.fast_forward import FastDraft, FastTarget
from tiny_models import make_draft, make_target

PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61, 5, 8, 13]


def close(a, b, tol=1e-5):
    return (a - b).norm() / b.norm() < tol


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    target = make_target(root / "target", layers=4)
    draft = make_draft(root / "draft", target, block_size=6, layers=2,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    return target, draft


def engine(pair, **kw):
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), max_ctx=256, device="cpu", **kw)


def random_tree(n, depth_cap=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth_cap, 50, generator=g), -1).sort(-1, descending=True)
    return build_tree(7, logp.values, logp.indices, n - 1, True, depth_cap)


def test_cache_attention_reference_matches_model_masks():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, h, 8, generator=g) for s, h in ((5, 4), (20, 2), (20, 2)))
    tree = random_tree(5)
    block = tree.ancestor_mask()
    out = cache_attention(q, k, v, torch.tensor([15]), 0.3, block_mask=block)
    ref = attention(q, k, v, prefix_block_mask(15, block), 0.3)
    assert torch.equal(out, ref)
    causal = cache_attention(q, k, v, 15, 0.3, causal=True)
    assert torch.equal(causal, attention(q, k, v, prefix_block_mask(15, torch.ones(5, 5).tril().bool()), 0.3))
    with pytest.raises(ValueError):
        cache_attention(q, k, v, 15, 0.3, block_mask=block, causal=True)


@torch.inference_mode()
def test_fast_target_matches_model(pair):
    eng = engine(pair, mode="ar")
    model, feats = eng.target, (1, 2)
    fast = FastTarget(model)
    ids = torch.tensor(PROMPT)
    pos = torch.arange(len(PROMPT))
    c1, c2 = model.new_cache(64, torch.float32, "cpu"), model.new_cache(64, torch.float32, "cpu")
    h1, f1 = model(ids, pos, c1, None, feats)
    h2, f2 = fast.forward(ids, pos, c2, torch.tensor([0]), None, True, feats)
    assert close(h2, h1) and close(f2, f1)
    assert close(c2.k[:, :len(PROMPT)], c1.k[:, :len(PROMPT)])
    c1.advance(len(PROMPT))
    c2.advance(len(PROMPT))
    tree = random_tree(9)
    tids, tpos = torch.tensor(tree.tokens), torch.tensor(tree.depths) + len(PROMPT)
    h1, f1 = model(tids, tpos, c1, tree.ancestor_mask(), feats)
    h2, f2 = fast.forward(tids, tpos, c2, torch.tensor([len(PROMPT)]), tree.ancestor_mask(), False, feats)
    assert close(h2, h1) and close(f2, f1)
    assert FastTarget(model).layers[0].qkv_w.data_ptr() == fast.layers[0].qkv_w.data_ptr()


@torch.inference_mode()
def test_fast_draft_matches_model(pair):
    eng = engine(pair, mode="ddtree")
    draft, target = eng.draft, eng.target
    fast = FastDraft(draft, target)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(9, 2 * target.config.hidden_size, generator=g)
    c1, c2 = draft.new_cache(64, torch.float32, "cpu"), draft.new_cache(64, torch.float32, "cpu")
    draft.append_context(feats, torch.arange(9), c1)
    fast.write_context(feats, c2, torch.tensor([0]))
    c2.advance(9)
    assert close(c2.k[:, :9], c1.k[:, :9]) and close(c2.v[:, :9], c1.v[:, :9])
    block = torch.tensor([5, 9, 9, 9, 9, 9])
    h1 = draft(target.embed(block), torch.arange(9, 15), c1)
    h2 = fast.forward(block, c2, torch.tensor([9]))
    assert close(h2, h1)


@pytest.mark.parametrize("mode,budget", [("ar", 4), ("chain", 4), ("ddtree", 4), ("ddtree", 12)])
def test_runner_decodes_like_plain_path(pair, mode, budget):
    plain = engine(pair, mode=mode, budget=budget)
    fast = engine(pair, mode=mode, budget=budget)
    d = fast.decoder
    sizes = [1, budget + 1 if mode == "ddtree" else d.block_size]
    d.runner = GraphRunner(d.target, d.draft, d.tcache, d.dcache, d.feature_layers, sizes,
                           d.block_size, capture=False)
    for prompt, n in ((PROMPT, 30), (PROMPT + [4, 4], 9), (PROMPT[:3], 17)):  # reuse, then a short tail
        want = plain.generate(prompt, max_tokens=n, stop_token_ids=[])
        got = fast.generate(prompt, max_tokens=n, stop_token_ids=[])
        assert got.token_ids == want.token_ids
        assert got.stats.accept_lengths == want.stats.accept_lengths
        assert d.draft is None or d.dcache.length == d.tcache.length
