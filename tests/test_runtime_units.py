"""KV cache bookkeeping, commit of exactly the accepted rows, and sampling processing."""

import pytest
import torch

from flashtree import Engine, SamplingParams
from flashtree.errors import ConfigError
from flashtree.runtime.kv_cache import KVCache
from flashtree.runtime.sampling import Sampler


def test_compact_keeps_exactly_the_accepted_rows():
    cache = KVCache(2, 32, 1, 4, torch.float32, "cpu")
    for layer in range(2):
        cache.write(layer, torch.full((5, 1, 4), 1.0 + layer), torch.full((5, 1, 4), -1.0))
    cache.advance(5)
    scratch = torch.arange(6, dtype=torch.float32).view(6, 1, 1).expand(6, 1, 4) + 100
    for layer in range(2):
        cache.write(layer, scratch + layer, -scratch)
    cache.compact(torch.tensor([0, 2, 5]))
    assert cache.length == 8
    for layer in range(2):
        assert cache.k[layer, :5].eq(1.0 + layer).all()
        assert cache.k[layer, 5:8, 0, 0].tolist() == [100 + layer, 102 + layer, 105 + layer]
        assert cache.v[layer, 5:8, 0, 0].tolist() == [-100, -102, -105]


def test_truncate_and_overflow():
    cache = KVCache(1, 4, 1, 2, torch.float32, "cpu")
    cache.write(0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    cache.advance(3)
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.truncate(2)
    with pytest.raises(RuntimeError):
        cache.write(0, torch.ones(4, 1, 2), torch.ones(4, 1, 2))


def test_decode_step_commits_path_rows_to_both_caches(tiny_pair):
    """After a tree step, target rows equal a fresh prefill of the committed tokens, and the draft
    cache holds exactly the context of the same positions."""
    target, draft = tiny_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=8, max_ctx=128)
    prompt = [4, 8, 15, 16, 23, 42]
    eng.generate(prompt, max_tokens=12, stop_token_ids=[])
    n = eng.tcache.length
    assert eng.dcache.length == n == len(eng.seq_tokens)
    fresh = Engine.from_pretrained(str(target), str(draft), mode="ar", max_ctx=128)
    fresh.decoder.prefill_chunk(eng.seq_tokens)
    assert torch.allclose(eng.tcache.k[:, :n], fresh.tcache.k[:, :n], atol=1e-5)
    assert torch.allclose(eng.tcache.v[:, :n], fresh.tcache.v[:, :n], atol=1e-5)
    ctx_only = Engine.from_pretrained(str(target), str(draft), mode="ddtree", max_ctx=128)
    ctx_only.decoder.prefill_chunk(eng.seq_tokens)
    assert torch.allclose(eng.dcache.k[:, :n], ctx_only.dcache.k[:, :n], atol=1e-5)


def sampler(**kw):
    return Sampler(SamplingParams(**kw).validate(), 6, torch.device("cpu"), [1])


def test_probs_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0001]]))
    p = sampler(temperature=1.0, top_k=2).probs(logits)[0]
    assert torch.allclose(p[:2], torch.tensor([4 / 7, 3 / 7]), atol=1e-4) and p[2:].sum() == 0
    p = sampler(temperature=1.0, top_p=0.8).probs(logits)[0]  # 0.4+0.3 < 0.8 -> keep 3
    assert (p > 0).sum() == 3
    p = sampler(temperature=1.0, min_p=0.3).probs(logits)[0]  # floor 0.12 -> keep 3
    assert (p > 0).sum() == 3
    hot = sampler(temperature=2.0).probs(logits)[0]
    assert hot[0] < 0.4 and hot[5] > 0.0001


def test_penalties_use_each_nodes_own_path():
    s = sampler(temperature=0.0, presence_penalty=2.0)
    logits = torch.tensor([[0.0, 1.5, 1.0, -1, -1, -1]]).repeat(3, 1)
    # root(0) -> node1 token 1 -> node2 token 2 ; node 2's path holds token 1 (and itself: 2)
    node_tokens = torch.tensor([0, 1, 2])
    anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    drawn = s.draw(logits, node_tokens, anc).tolist()
    assert drawn == [1, 2, 0]  # root: no history; node1: 1 penalised -> 2; node2: 1 and 2 penalised
    rep = sampler(temperature=0.0, repetition_penalty=10.0)  # prompt token 1 is history
    assert rep.draw(torch.tensor([[0.0, 5.0, 4.0, 0, 0, 0]])).tolist() == [2]


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -3), ("min_p", 2.0), ("repetition_penalty", 0.0),
                                         ("frequency_penalty", 3.0), ("seed", -1)])
def test_invalid_sampling_values_name_the_range(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value}).validate()


def test_seed_reproducible(tiny_pair):
    target, draft = tiny_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", max_ctx=256)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = eng.generate([1, 2, 3], p, max_tokens=20, stop_token_ids=[]).token_ids
    b = eng.generate([9, 9], p, max_tokens=5, stop_token_ids=[]).token_ids
    c = eng.generate([1, 2, 3], p, max_tokens=20, stop_token_ids=[]).token_ids
    assert a == c and len(b) == 5


def test_vanishing_temperature_is_greedy_not_nan():
    s = sampler(temperature=4e-196)
    logits = torch.tensor([[0.0, 1.5, 1.0, -1, -1, -1]])
    assert s.draw(logits).tolist() == [1]


@pytest.mark.parametrize("tie", [False, True])
def test_memory_plan_counts_the_weights_it_loads(tmp_path, tie):
    from flashtree.runtime.memory_plan import draft_param_count, lm_param_count
    from tiny_models import make_draft, make_target
    target = make_target(tmp_path / "t", tie=tie)
    eng = Engine.from_pretrained(str(target), str(make_draft(tmp_path / "d", target, layers=2)), max_ctx=64)
    assert lm_param_count(eng.target.config) == sum(p.numel() for p in eng.target.parameters())
    assert draft_param_count(eng.draft.config) == sum(p.numel() for p in eng.draft.parameters())
