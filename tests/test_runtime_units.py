"""KV cache bookkeeping, commit of exactly the accepted rows, and sampling processing."""

import os

import pytest
import torch

from flashtree import Engine, SamplingParams
from flashtree.errors import ConfigError
from flashtree.models.kv_cache import KVCache
from flashtree.runtime.sampling import Sampler
from flashtree.runtime.sequence import SequenceState


def test_compact_keeps_exactly_the_accepted_rows():
    cache = KVCache(2, 32, 1, 4, torch.float32, "cpu")
    for layer in range(2):
        cache.k[layer, :5], cache.v[layer, :5] = 1.0 + layer, -1.0
    scratch = torch.arange(6, dtype=torch.float32).view(6, 1, 1).expand(6, 1, 4) + 100
    for layer in range(2):
        cache.k[layer, 5:11], cache.v[layer, 5:11] = scratch + layer, -scratch
    cache.compact(5, torch.tensor([0, 2, 5]))
    for layer in range(2):
        assert cache.k[layer, :5].eq(1.0 + layer).all()
        assert cache.k[layer, 5:8, 0, 0].tolist() == [100 + layer, 102 + layer, 105 + layer]
        assert cache.v[layer, 5:8, 0, 0].tolist() == [-100, -102, -105]


def test_sequence_state_commit_truncate_and_overflow():
    state = SequenceState(KVCache(1, 4, 1, 2, torch.float32, "cpu"), None, torch.device("cpu"))
    state.commit([7, 8, 9])
    assert state.length == 3 and int(state.length_dev) == 3
    state.truncate(1)
    assert state.tokens == [7] and int(state.length_dev) == 1
    with pytest.raises(ValueError):
        state.truncate(2)
    with pytest.raises(RuntimeError):
        state.commit([1, 2, 3, 4])
    assert state.tokens == [7]  # a refused commit changes nothing
    assert state.keep_prefix_of([7, 5], limit=4) == 1


def test_decode_step_commits_path_rows_to_both_caches(tiny_pair):
    """After a tree step, target rows equal a fresh prefill of the committed tokens, and the draft
    cache holds exactly the context of the same positions."""
    target, draft = tiny_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=8, max_ctx=128)
    prompt = [4, 8, 15, 16, 23, 42]
    eng.generate(prompt, max_tokens=12, stop_token_ids=[])
    n = eng.state.length
    assert int(eng.state.length_dev) == n == len(prompt) + 11  # the last emitted token is pending
    fresh = Engine.from_pretrained(str(target), str(draft), mode="ar", max_ctx=128)
    assert fresh.draft is None and fresh.state.draft is None  # ar loads no draft
    fresh.decoder.prefill_chunk(eng.state.tokens)
    got, want = eng.state.target.rows(n), fresh.state.target.rows(n)
    assert all(torch.allclose(got[side].clone(), want[side].clone(), atol=1e-5) for side in "kv")
    ctx_only = Engine.from_pretrained(str(target), str(draft), mode="ddtree", max_ctx=128)
    ctx_only.decoder.prefill_chunk(eng.state.tokens)
    assert torch.allclose(eng.state.draft.rows(n)["k"].clone(), ctx_only.state.draft.rows(n)["k"].clone(), atol=1e-5)


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
    drawn = s.draw(s.adjust(logits, node_tokens, anc)).tokens.tolist()
    assert drawn == [1, 2, 0]  # root: no history; node1: 1 penalised -> 2; node2: 1 and 2 penalised
    rep = sampler(temperature=0.0, repetition_penalty=10.0)  # prompt token 1 is history
    assert rep.draw(rep.adjust(torch.tensor([[0.0, 5.0, 4.0, 0, 0, 0]]))).tokens.tolist() == [2]


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
    assert s.draw(s.adjust(logits)).tokens.tolist() == [1]


@pytest.mark.parametrize("tie", [False, True])
def test_memory_plan_counts_the_weights_it_loads(tmp_path, tie):
    from tiny_models import make_draft, make_target
    target = make_target(tmp_path / "t", tie=tie)
    eng = Engine.from_pretrained(str(target), str(make_draft(tmp_path / "d", target, layers=2)), max_ctx=64)
    planned = {name.split(",")[0]: b for name, b in eng.memory_plan.items}
    assert planned["target weights"] == sum(p.nbytes for p in eng.target.parameters())  # tied ones once
    assert planned["draft weights"] == sum(p.nbytes for p in eng.draft.parameters())


def test_cpu_threads_default_to_half_the_cores_and_can_be_set(tiny_pair, monkeypatch):
    """torch's default (a thread per core) collapses when other processes hold cores (docs/SERVING.md,
    "CPU threads")."""
    target = str(tiny_pair[0])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(6)  # torch's own choice on 6 cores
        Engine.from_pretrained(target, mode="ar", max_ctx=64)
        assert torch.get_num_threads() == 3
        Engine.from_pretrained(target, mode="ar", max_ctx=64, threads=2)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        torch.set_num_threads(5)
        Engine.from_pretrained(target, mode="ar", max_ctx=64)
        assert torch.get_num_threads() == 5, "OMP_NUM_THREADS is the user's choice"
    finally:
        torch.set_num_threads(before)


def test_engine_reports_progress_after_every_prefill_chunk(tiny_pair):
    """The worker's heartbeat during a long prefill (serve/supervisor.py's watchdog)."""
    eng = Engine.from_pretrained(str(tiny_pair[0]), mode="ar", max_ctx=128, prefill_ubatch=8)
    lengths = []
    eng.on_progress = lambda: lengths.append(eng.state.length)
    eng.generate(list(range(1, 30)), max_tokens=2, stop_token_ids=[])
    assert lengths == [8, 16, 24, 29]


def test_a_vanishing_top_p_keeps_the_likeliest_token():
    """A top_p that rounds to 0 in float32 (8.9e-97, found by fuzzing /v1/messages) made every
    token's probability NaN and the request a 503; nucleus sampling keeps at least the top one."""
    s = Sampler(SamplingParams(temperature=0.7, top_p=8.9e-97).validate(), 6, torch.device("cpu"), [1])
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 0.0, 1.9]])
    probs = s.probs(logits)
    assert not torch.isnan(probs).any()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
