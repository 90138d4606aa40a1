"""The CUDA path's runner, checked on the CPU (kernels fall back to their definitions there):
packed weights keep the checkpoint's names, the runner leaves the models alone, and decoding
through its static buffers (padding, masks, device lengths, context append) emits the plain
tokens."""

import pytest
import torch

from flashtree import Engine
from safetensors.torch import load_file

from flashtree.kernels.attention import cache_attention
from flashtree.kernels.reference import prefix_block_mask, sdpa
from flashtree.runtime.ddtree import build_tree
from flashtree.runtime.graphs import ModelRunner
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
    kw.setdefault("max_sequences", 1)  # use_static_runner replaces the one sequence's runner
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
    ref = sdpa(q, k, v, prefix_block_mask(15, block), 0.3)
    assert torch.equal(out, ref)
    causal = cache_attention(q, k, v, 15, 0.3, causal=True)
    assert torch.equal(causal, sdpa(q, k, v, prefix_block_mask(15, torch.ones(5, 5).tril().bool()), 0.3))
    with pytest.raises(ValueError):
        cache_attention(q, k, v, 15, 0.3, block_mask=block, causal=True)


def use_static_runner(eng, budget):
    """Give the engine's (one) live sequence a runner with the CUDA path's static buffers, run
    eagerly, over its own state; returns it."""
    assert len(eng.sequences) == 1, "build the engine with max_sequences=1"
    sizes = [1] if eng.draft is None else [1, budget + 1 if eng.mode == "ddtree" else eng.block_size]
    feats = eng.draft.config.target_layer_ids if eng.draft is not None else ()
    seq = eng.sequences[0]
    seq.runner = seq.decoder.runner = ModelRunner(eng.target, eng.draft, eng.state, feats, sizes, eng.block_size,
                                                  capture=False, static=True)
    return seq.runner


def test_checkpoint_names_round_trip_through_packed_weights(pair):
    """Weights are packed at load, yet state_dict() reports the checkpoint's own names and values."""
    eng = engine(pair, mode="ddtree")
    for model, ckpt in ((eng.target, pair[0]), (eng.draft, pair[1])):
        files = sorted(ckpt.glob("*.safetensors"))
        on_disk = {}
        for f in files:
            on_disk.update(load_file(str(f)))
        ours = model.state_dict()
        if model is eng.target and "lm_head.weight" not in on_disk:
            ours.pop("lm_head.weight")
        assert set(ours) == set(on_disk)
        for name, tensor in on_disk.items():
            assert torch.equal(ours[name], tensor.float()), name


def test_building_the_runner_does_not_touch_the_models(pair):
    eng = engine(pair, mode="ddtree", budget=6)
    before = {n: (p.data_ptr(), p.clone()) for m in (eng.target, eng.draft) for n, p in m.named_parameters()}
    use_static_runner(eng, 6)
    after = {n: p for m in (eng.target, eng.draft) for n, p in m.named_parameters()}
    assert set(after) == set(before)
    for n, p in after.items():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n


@pytest.mark.parametrize("mode,budget", [("ar", 4), ("chain", 4), ("ddtree", 4), ("ddtree", 12)])
def test_runner_decodes_like_plain_path(pair, mode, budget):
    """Decoding through the static buffers (padding, masks, context append) emits the plain
    path's tokens, also when the live sequence is reused and when a short tail follows."""
    plain = engine(pair, mode=mode, budget=budget)
    fast = engine(pair, mode=mode, budget=budget)
    use_static_runner(fast, budget)
    assert fast.runner.verify  # the static path is the one being run
    for prompt, n in ((PROMPT, 30), (PROMPT + [4, 4], 9), (PROMPT[:3], 17)):  # reuse, then a short tail
        want = plain.generate(prompt, max_tokens=n, stop_token_ids=[])
        got = fast.generate(prompt, max_tokens=n, stop_token_ids=[])
        assert got.token_ids == want.token_ids
        assert got.stats.accept_lengths == want.stats.accept_lengths
