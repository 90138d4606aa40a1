"""logit_bias and logprobs in the engine: both come from the target's processed logits at every
tree node, so greedy chain/ddtree still equal ar token for token under a bias, and the logprobs
of the tokens emitted are the same whichever mode emitted them."""

import pytest

from flashtree import Engine, SamplingParams
from flashtree.errors import ConfigError
from test_decoding import install_oracle

PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61]
N_TOKENS = 32


def engine(tiny_pair, mode, **kw):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft), mode=mode, max_ctx=512, **kw)


@pytest.fixture(scope="module")
def ar(tiny_pair):
    return engine(tiny_pair, "ar")


@pytest.fixture(scope="module")
def bias(ar):
    """-100 on the first two distinct tokens greedy ar emits unbiased, +1 on another one."""
    plain = ar.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    distinct = list(dict.fromkeys(plain))
    bias = {distinct[0]: -100.0, 11: 1.0}
    if len(distinct) > 1:
        bias[distinct[1]] = -100.0
    biased = ar.generate(PROMPT, SamplingParams(logit_bias=bias), max_tokens=N_TOKENS,
                         stop_token_ids=[]).token_ids
    assert biased != plain and distinct[0] not in biased  # the bias really changes the output
    return bias


@pytest.mark.parametrize("mode,budget", [("chain", 22), ("ddtree", 4), ("ddtree", 22)])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_speculative_equals_ar_under_logit_bias(tiny_pair, ar, bias, mode, budget, oracle):
    """With the random draft most steps accept only the bonus; the oracle draft (which knows
    the biased greedy continuation, wrong at depth 3) makes the walk go deep and branch."""
    sampling = SamplingParams(logit_bias=bias)
    expected = ar.generate(PROMPT, sampling, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    eng = engine(tiny_pair, mode, budget=budget, block_size=8)
    if oracle:
        install_oracle(eng, PROMPT + expected, {3}, eng.target.config.vocab_size)
    res = eng.generate(PROMPT, sampling, max_tokens=N_TOKENS, stop_token_ids=[])
    assert res.token_ids == expected
    if oracle:
        assert max(res.stats.accept_lengths) > 2  # the tree was really used


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_logprobs_equal_between_ar_and_speculative(tiny_pair, ar, bias, mode):
    sampling = SamplingParams(logprobs=5, logit_bias=bias, presence_penalty=0.5)
    ref = ar.generate(PROMPT, sampling, max_tokens=N_TOKENS, stop_token_ids=[])
    eng = engine(tiny_pair, mode, block_size=8)
    install_oracle(eng, PROMPT + ref.token_ids, {4}, eng.target.config.vocab_size)
    res = eng.generate(PROMPT, sampling, max_tokens=N_TOKENS, stop_token_ids=[])
    assert max(res.stats.accept_lengths) > 2  # rows deep in the tree gave logprobs
    assert res.token_ids == ref.token_ids
    assert len(res.logprobs) == len(ref.logprobs) == len(ref.token_ids)
    for token, (lp, top), (ref_lp, ref_top) in zip(ref.token_ids, res.logprobs, ref.logprobs):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)
        assert len(top) == 5 and top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_logprobs_are_off_unless_asked_and_follow_stop_tokens(ar):
    plain = ar.generate(PROMPT, max_tokens=8, stop_token_ids=[])
    assert plain.logprobs is None
    stop = plain.token_ids[4]
    res = ar.generate(PROMPT, SamplingParams(logprobs=0), max_tokens=8, stop_token_ids=[stop])
    cut = plain.token_ids.index(stop)
    assert res.token_ids == plain.token_ids[:cut]
    assert len(res.logprobs) == cut and all(top == [] for _, top in res.logprobs)
    assert all(lp <= 0.0 for lp, _ in res.logprobs)


@pytest.mark.parametrize("sampling,field", [
    (SamplingParams(logit_bias={5: 100.5}), "logit_bias"),
    (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={"5": 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={5: "up"}), "logit_bias"),
    (SamplingParams(logprobs=21), "logprobs")])
def test_out_of_range_is_refused(ar, sampling, field):
    with pytest.raises(ConfigError, match=field):
        ar.generate(PROMPT, sampling, max_tokens=2)


def test_bias_on_a_token_past_the_vocabulary_is_refused(ar):
    vocab = ar.target.config.vocab_size
    with pytest.raises(ConfigError, match=f"logit_bias names token id {vocab}"):
        ar.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}), max_tokens=2)
