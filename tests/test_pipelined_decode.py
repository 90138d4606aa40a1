"""Device steps queued ahead (runtime/device_step.py, the engine's decode loop): a chain or
ddtree step commits on the device, the next step's draft is queued before the host reads the
step, and the host stops (max_tokens, a stop token, cancellation) by dropping that draft. Every
output, trace, logprob and final state equals the synchronous path's (each draft after the
read), greedy spec equals AR, a grammar's steps stay synchronous, and an out-of-memory in a
draft queued ahead reaches the request only where the next step starts. The `gpu` tests check
the CUDA graphs: one read a step, queued after the next step's draft."""

import contextlib

import llguidance
import pytest
import torch
from test_decoding import PROMPT, install_oracle
from tiny_models import make_draft, make_target

from flashtree import Engine, SamplingParams
from flashtree.errors import EngineOutOfMemory
from flashtree.runtime import decoding, faults
from flashtree.runtime.graphs import ModelRunner

N_TOKENS = 40


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request, tmp_path_factory):
    """A dense and a hybrid (Gated DeltaNet) target with a block-8 draft."""
    root = tmp_path_factory.mktemp(f"pipelined_{request.param}")
    layers, feats = (5, [1, 3]) if request.param == "qwen3_5" else (4, None)
    target = make_target(root / "target", arch=request.param, layers=layers)
    return target, make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=feats)


def engine(pair, **kw):
    kw.setdefault("max_ctx", 512)
    kw.setdefault("max_sequences", 1)  # the tests drive the one sequence's decoder directly
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", **kw)


@pytest.fixture(scope="module")
def reference(pair):
    return engine(pair, mode="ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids



def synchronous(monkeypatch):
    """Every step drafts after the previous one was read (the path before drafting ahead)."""
    monkeypatch.setattr(decoding.Decoder, "draft_ahead", lambda self, launched, room, grammar=None: None)


def committed_state(eng):
    """The committed part of the live state: tokens, device length, rows and recurrent states."""
    st = eng.state
    assert not st.unread and int(st.length_dev) == st.length
    return st.tokens[:], {name: t.clone() for name, t in st.rows(st.length).items()}


def same_state(a, b):
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("max_tokens", [N_TOKENS, 13, 7])
def test_greedy_spec_equals_ar_drafting_ahead(pair, reference, mode, max_tokens):
    """Long accepted paths (an oracle draft, one wrong depth), max_tokens cutting into a step."""
    eng = engine(pair, mode=mode, budget=12)
    install_oracle(eng, PROMPT + reference, {3}, eng.target.config.vocab_size)
    res = eng.generate(PROMPT, max_tokens=max_tokens, stop_token_ids=[])
    assert res.token_ids == reference[:max_tokens] and res.finish_reason == "length"
    assert res.stats.mean_accept_length > 2
    if max_tokens == N_TOKENS:
        assert res.stats.drafted_ahead >= 2
    assert not eng.state.unread and int(eng.state.length_dev) == eng.state.length


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_a_stop_token_drops_the_draft_queued_ahead(pair, reference, mode, monkeypatch):
    """The step holding the stop token was drafted ahead of; its successor's draft, queued
    before the read, is dropped, and the state is the synchronous path's."""
    stop = reference[20]
    got = engine(pair, mode=mode, budget=12)
    install_oracle(got, PROMPT + reference, set(), got.target.config.vocab_size)
    res = got.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[stop])
    assert res.finish_reason == "stop" and res.token_ids == reference[:reference.index(stop)]
    assert res.stats.drafted_ahead >= 1
    synchronous(monkeypatch)
    want = engine(pair, mode=mode, budget=12)
    install_oracle(want, PROMPT + reference, set(), want.target.config.vocab_size)
    again = want.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[stop])
    assert again.token_ids == res.token_ids and again.stats.accept_lengths == res.stats.accept_lengths
    assert same_state(committed_state(got), committed_state(want))


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_cancel_at_a_step_boundary(pair, reference, mode):
    eng = engine(pair, mode=mode)
    stream = eng.stream(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    seen = []
    for ids in stream:
        seen.extend(ids)
        if len(seen) >= 9:
            stream.cancel()
    assert stream.result.finish_reason == "cancelled" and seen == reference[:len(seen)]
    assert not eng.state.unread and int(eng.state.length_dev) == eng.state.length
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == reference


SAMPLED = [dict(temperature=0.9, top_k=40), dict(temperature=0.8, top_p=0.9, logprobs=2),
           dict(temperature=1.1, repetition_penalty=1.3, presence_penalty=0.4),
           dict(temperature=0.7, logit_bias={7: 3.0, 11: -2.0}), dict(logprobs=1, frequency_penalty=0.5)]


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_sampled_outputs_equal_the_synchronous_paths(pair, mode, monkeypatch):
    """Seed by seed: tokens, logprobs, traces, accept lengths and the final state."""
    runs = []
    for patch in (False, True):
        if patch:
            synchronous(monkeypatch)
        eng = engine(pair, mode=mode, budget=6)
        out = []
        for seed, extra in enumerate(SAMPLED):
            res = eng.generate(PROMPT, SamplingParams(seed=seed, **extra), max_tokens=30, stop_token_ids=[],
                               trace=True)
            out.append((res.token_ids, res.logprobs, res.trace, res.stats.accept_lengths, committed_state(eng)))
            if not patch:
                assert res.stats.drafted_ahead >= 1
        runs.append(out)
    for got, want in zip(*runs):
        assert got[:4] == want[:4] and same_state(got[4], want[4])


def host_launch(self, bonus, sampler, max_emit, want_trace=False, grammar=None, ahead=None):
    cap = min(self.block_size - 1, max_emit - 1)
    return decoding.Launched(result=self._host_step(bonus, sampler, cap, want_trace, grammar))


def test_sampled_chain_equals_the_host_chain(pair, monkeypatch):
    """A chain's device tree, walk and commit against the host's chain_tree and Tree.walk."""
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(decoding.Decoder, "launch", host_launch)
        eng = engine(pair, mode="chain")
        runs.append([eng.generate(PROMPT, SamplingParams(seed=s, **SAMPLED[s]), max_tokens=25, stop_token_ids=[],
                                  trace=True) for s in range(len(SAMPLED))])
    for got, want in zip(*runs):
        assert (got.token_ids, got.logprobs, got.trace) == (want.token_ids, want.logprobs, want.trace)


def test_a_draft_queued_ahead_changes_no_committed_state(pair):
    """A draft only reads the committed state and writes scratch rows and the tree buffers: the
    host may drop it. The bonus it drafts from is the one the last step left on the device."""
    eng = engine(pair, mode="ddtree")
    dec = eng.decoder
    dec.prefill_chunk(PROMPT)
    sampler = decoding.Sampler(SamplingParams(), eng.target.config.vocab_size, dec.device, PROMPT)
    res = dec.read(dec.launch(5, sampler, 50))
    before = committed_state(eng)
    with torch.inference_mode():
        for _ in range(2):
            dec.device_steps().draft(dec.block_size - 1, None)
    assert same_state(committed_state(eng), before) and int(dec.runner.bonus) == res.tokens[-1]


def test_drafts_go_ahead_only_while_the_next_cap_is_certain(pair):
    """The next step's depth cap is the block's whatever this step accepts only while the
    room left after this step's most rows still holds a block; nearer the end it drafts after
    the read, with the cap it then knows."""
    eng = engine(pair, mode="ddtree")
    dec = eng.decoder
    dec.prefill_chunk(PROMPT)
    sampler = decoding.Sampler(SamplingParams(), eng.target.config.vocab_size, dec.device, PROMPT)
    bs = dec.block_size
    for room, ahead in ((2 * bs, True), (2 * bs - 1, False), (bs, False)):
        launched = dec.launch(5, sampler, room)
        assert launched.most == bs
        assert (dec.draft_ahead(launched, room) is not None) == ahead, room
        dec.read(launched)
    launched = dec.launch(5, sampler, 1)  # root only: a host step, nothing to draft behind
    assert launched.result is not None and dec.draft_ahead(launched, 100) is None


def test_grammar_steps_stay_synchronous(pair):
    """A grammar's tree needs the host (admit, masks) and its matcher advanced by the previous
    step: nothing is drafted ahead, and greedy constrained spec equals constrained AR."""
    grammar = llguidance.LLMatcher.grammar_from_lark("start: <[5-200]> <[5-200]>+ <[201-300]>")
    outs = {}
    for mode in ("ar", "chain", "ddtree"):
        res = engine(pair, mode=mode).generate(PROMPT, max_tokens=20, grammar=grammar)
        assert res.stats.drafted_ahead == 0
        outs[mode] = res.token_ids
    assert outs["chain"] == outs["ar"] == outs["ddtree"] and outs["ar"]


def test_an_oom_in_a_draft_queued_ahead_is_raised_where_the_next_step_starts(pair, reference):
    """The second draft is the first queued ahead: the step before it is read and its tokens
    stream, then the request fails at the next step's launch, with the state consistent."""
    eng = engine(pair, mode="ddtree")
    faults.configure("draft:oom:2")
    stream = eng.stream(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    seen = []
    with pytest.raises(EngineOutOfMemory) as err:
        for ids in stream:
            seen.extend(ids)
    assert err.value.site == "draft"
    assert len(seen) > 1 and seen == reference[:len(seen)]  # the first token and the first step's
    assert not eng.state.unread and int(eng.state.length_dev) == eng.state.length
    faults.configure("")
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == reference


@pytest.mark.parametrize("site", ["verify", "sample"])
def test_an_oom_in_a_device_step_leaves_the_state_consistent(pair, reference, site):
    eng = engine(pair, mode="ddtree")
    faults.configure(f"{site}:oom:3")
    with pytest.raises(EngineOutOfMemory):
        eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    faults.configure("")
    assert not eng.state.unread and int(eng.state.length_dev) == eng.state.length
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == reference


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_captured_phases_run_twice_under_their_guard(pair, reference, mode, monkeypatch):
    """What a CUDA capture does, on the CPU: each phase runs twice (its warm-up) before its
    first use, under its guard; the phases read only static buffers and device tensors, and the
    guard undoes a commit, so the output is unchanged."""
    from test_fast_path import use_static_runner

    seen = set()

    def capture(self, name, fn, guard=None):
        if name not in seen:
            seen.add(name)
            for _ in range(2):
                with (guard or contextlib.nullcontext)():
                    fn()
        return fn

    monkeypatch.setattr(ModelRunner, "graph", capture)
    eng = engine(pair, mode=mode, budget=6)
    use_static_runner(eng, 6)
    for _ in range(2):
        res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
        assert res.token_ids == reference and res.stats.drafted_ahead >= 2
    assert {name[0] for name in seen} == {"draft", "verify"}
