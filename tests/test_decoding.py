"""Speculative decoding is exact: greedy chain/ddtree == greedy ar token for token, and at
temperature > 0 the output distribution is the target's."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from flashtree import Engine, SamplingParams
from flashtree.models.inputs import ForwardInput
from flashtree.runtime import ddtree
from tiny_models import SPECIAL_TOKENS, make_draft, make_target

PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61]
N_TOKENS = 40


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target, draft = tiny_pair
    ar = Engine.from_pretrained(str(target), str(draft), mode="ar", max_ctx=512)
    out = ar.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    assert len(out) == N_TOKENS
    return out


def engine(tiny_pair, **kw):
    target, draft = tiny_pair
    return Engine.from_pretrained(str(target), str(draft), max_ctx=512, **kw)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("budget", [1, 2, 4, 8, 22, 40])
def test_greedy_ddtree_equals_ar_random_draft(tiny_pair, reference, block_size, budget):
    eng = engine(tiny_pair, mode="ddtree", budget=budget, block_size=block_size)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    assert res.token_ids == reference
    assert all(1 <= a <= block_size for a in res.stats.accept_lengths)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_chain_equals_ar_random_draft(tiny_pair, reference, block_size):
    res = engine(tiny_pair, mode="chain", block_size=block_size).generate(
        PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    assert res.token_ids == reference


def install_oracle(eng, full_sequence, wrong_depths, vocab):
    """Replace the draft with a double that knows the greedy continuation: at each depth the true
    next token is ranked first, except at `wrong_depths` where a wrong token is first and the
    true one second (so chains break there and trees must take a side branch)."""

    def oracle(bonus):
        start = int(eng.state.length_dev)  # the device's length: a draft queued ahead runs before the host reads
        depth = eng.decoder.block_size - 1
        logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(start))
        for j in range(1, depth + 1):
            pos = start + j
            true = full_sequence[pos] if pos < len(full_sequence) else 0
            wrong = (true + 1) % vocab
            if j in wrong_depths:
                logits[j - 1, wrong], logits[j - 1, true] = 30.0, 29.0
            else:
                logits[j - 1, true] = 30.0
        return torch.log_softmax(logits, dim=-1)

    eng.decoder._draft_logprobs = oracle


@pytest.mark.parametrize("mode,budget", [("chain", 22), ("ddtree", 2), ("ddtree", 8), ("ddtree", 22), ("ddtree", 40)])
@pytest.mark.parametrize("wrong_depths", [(), (3,), (2, 5)])
def test_greedy_equals_ar_with_oracle_draft(tiny_pair, reference, mode, budget, wrong_depths):
    eng = engine(tiny_pair, mode=mode, budget=budget, block_size=8)
    install_oracle(eng, PROMPT + reference, set(wrong_depths), eng.target.config.vocab_size)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    assert res.token_ids == reference
    longest = max(res.stats.accept_lengths)
    if not wrong_depths:
        assert longest == (8 if mode == "chain" else min(8, budget + 1))  # whole blocks (chains)
    elif mode == "chain":
        assert longest == min(wrong_depths)  # the chain breaks at the first wrong depth
    elif budget >= 8:
        # the tree holds the rank-2 sibling and follows the side branch past the wrong depth
        assert longest > min(wrong_depths)
        side = [t for t in res.trace if any(
            t["tree_parents"][n] != n - 1 for n in t["accepted"][1:])]
        assert side, "no step accepted a side branch"


def test_stop_token_and_max_tokens(tiny_pair, reference):
    eng = engine(tiny_pair, mode="ddtree")
    stop = reference[10]
    first = reference.index(stop)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[stop])
    assert res.finish_reason == "stop" and res.token_ids == reference[:first]
    res = eng.generate(PROMPT, max_tokens=7, stop_token_ids=[])
    assert res.finish_reason == "length" and res.token_ids == reference[:7]


def test_stream_yields_steps_and_cancel(tiny_pair, reference):
    eng = engine(tiny_pair, mode="ddtree")
    stream = eng.stream(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    seen = []
    for ids in stream:
        seen.extend(ids)
        if len(seen) >= 5:
            stream.cancel()
    assert stream.result.finish_reason == "cancelled"
    assert seen == reference[:len(seen)] == stream.result.token_ids
    # the engine state stays consistent: the same request again gives the full answer
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == reference


def test_live_prefix_is_reused(tiny_pair, reference):
    eng = engine(tiny_pair, mode="ddtree")
    eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    follow = PROMPT + reference[:20]
    res = eng.generate(follow, max_tokens=10, stop_token_ids=[])
    assert res.stats.cached_tokens == len(follow) - 1
    assert res.token_ids == reference[20:30]


def test_context_limit_ends_with_length(tiny_pair):
    target, draft = tiny_pair
    eng = Engine.from_pretrained(str(target), str(draft), max_ctx=32)
    res = eng.generate(PROMPT, max_tokens=100, stop_token_ids=[])
    assert res.finish_reason == "length" and len(PROMPT) + len(res.token_ids) == 32


# ---- distribution at temperature > 0 -------------------------------------------------------

VOCAB = 6


# the hybrid's sampling tests take 26 s on CI's two cores: they run with the slow suite
@pytest.fixture(scope="module", params=["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def tiny_vocab_pair(request, tmp_path_factory):
    """A dense and a hybrid (Gated DeltaNet) target over a 6-token vocabulary."""
    root = tmp_path_factory.mktemp("v6")
    target = make_target(root / "t", arch=request.param, vocab_size=VOCAB, hidden=32,
                         layers=3 if request.param == "qwen3_5" else 2, seed=5)
    # a tokenizer of the model's 6 tokens (a larger one is refused at load: models/checks.py),
    # the tiny tokenizers' first three specials at their ids and their EOS ids (<|im_end|> 2,
    # <|endoftext|> 0), byte-level so that llguidance can read it
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS[:3] + ["a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS[:3])
    tok.save(str(target / "tokenizer.json"))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    draft = make_draft(root / "d", target, block_size=4, mask_token_id=VOCAB - 1, seed=6)
    return target, draft


SAMPLING = SamplingParams(temperature=0.9, top_k=5)
N_SEQ = 3


def exact_distribution(eng):
    """P(t1..t3) of plain sampling, from the target's processed distribution, by enumeration."""
    from flashtree.runtime.sampling import Sampler
    sampler = Sampler(SAMPLING, VOCAB, torch.device("cpu"), [])
    probs = {(): 1.0}
    for _ in range(N_SEQ):
        nxt = {}
        for prefix, p in probs.items():
            seq = [1, 2, 3] + list(prefix)
            cache = eng.target.new_cache(64, torch.float32, "cpu")
            h, _ = eng.target(ForwardInput.prefill(torch.tensor(seq), cache))
            dist = sampler.probs(eng.target.logits(h[-1:]))[0]
            for t in range(VOCAB):
                nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


def sample_counts(eng, n):
    """Output counts over n seeds, and the fraction of decode steps that accepted a draft token."""
    counts, steps, accepted = {}, 0, 0
    for seed in range(n):
        params = SamplingParams(**{**SAMPLING.to_dict(), "seed": seed})
        res = eng.generate([1, 2, 3], params, max_tokens=N_SEQ, stop_token_ids=[])
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        steps += len(res.stats.accept_lengths)
        accepted += sum(a > 1 for a in res.stats.accept_lengths)
    return counts, accepted / max(steps, 1)


def chi2_pvalue(counts, exact, n):
    cells = sorted(exact, key=exact.get, reverse=True)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for c in cells:
        if exact[c] * n >= 5:
            obs.append(counts.get(c, 0))
            exp.append(exact[c] * n)
        else:
            rest_o += counts.get(c, 0)
            rest_e += exact[c] * n
    if rest_e > 0:  # the small cells pooled (a distribution may have none)
        obs.append(rest_o)
        exp.append(rest_e)
    total = sum(exp)
    from scipy.stats import chisquare  # here: scipy.stats takes seconds to import, and few tests use it

    return chisquare(obs, [e * n / total for e in exp]).pvalue


@pytest.fixture(scope="module")
def exact(tiny_vocab_pair):
    target, draft = tiny_vocab_pair
    return exact_distribution(Engine.from_pretrained(str(target), str(draft), mode="ar", max_ctx=64))


N_SAMPLES = 1500


# ddtree (the engine's default) in the fast suite; ar and chain, 9-14 s each, with the slow tests
@pytest.mark.parametrize("mode", [pytest.param("ar", marks=pytest.mark.slow),
                                  pytest.param("chain", marks=pytest.mark.slow), "ddtree"])
def test_sampled_distribution_equals_target(tiny_vocab_pair, exact, mode):
    target, draft = tiny_vocab_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode=mode, budget=6, max_ctx=64)
    counts, accept_rate = sample_counts(eng, N_SAMPLES)
    if mode != "ar":  # the speculative path is really exercised
        assert accept_rate > 0.05
    assert chi2_pvalue(counts, exact, N_SAMPLES) > 1e-3


@pytest.mark.slow  # 11-14 s a walk: the power of the distribution test above, checked with the slow tests
@pytest.mark.parametrize("walk", ["host", "device"])
def test_biased_acceptance_is_detected(tiny_vocab_pair, exact, monkeypatch, walk):
    """Accepting the draft's first child whenever the target's draw is 'close' (here: always
    taking the first child once) biases the output, and the test above would catch it: in the
    host's walk (Tree.walk: grammar and ar steps; chain steps forced onto the host here) and in
    the device's (kernels.tree.accept: chain and ddtree steps; ddtree's case is in
    test_tree_device.py)."""
    from flashtree.runtime import decoding, device_step

    if walk == "host":
        original = ddtree.Tree.walk

        def biased(self, drawn):
            kids = self.children()
            if kids[0]:
                first = min(kids[0].values())
                drawn = list(drawn)
                drawn[0] = self.tokens[first]
            return original(self, drawn)

        def host_launch(self, bonus, sampler, max_emit, want_trace=False, grammar=None, ahead=None):
            cap = min(self.block_size - 1, max_emit - 1)
            return decoding.Launched(result=self._host_step(bonus, sampler, cap, want_trace, grammar))

        monkeypatch.setattr(ddtree.Tree, "walk", biased)
        monkeypatch.setattr(decoding.Decoder, "launch", host_launch)
    else:
        original_accept = device_step.accept

        def biased_accept(tokens, parents, n_nodes, drawn, ancestors=None):
            drawn = drawn.clone()
            drawn[:, 0] = torch.where(n_nodes > 1, tokens[:, 1], drawn[:, 0])
            return original_accept(tokens, parents, n_nodes, drawn, ancestors)

        monkeypatch.setattr(device_step, "accept", biased_accept)
    target, draft = tiny_vocab_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="chain", max_ctx=64)
    counts, _ = sample_counts(eng, N_SAMPLES)
    assert chi2_pvalue(counts, exact, N_SAMPLES) < 1e-3
