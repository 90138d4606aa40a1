"""Logits that are not finite where a token is drawn fail the request with NonFiniteLogits, never
emit garbage: a prompt that overflows (its first token), a decode step's accepted path in ar,
chain and ddtree (host steps, device steps eager and over the static buffers of the captured
phase), greedy and sampled, one of two sequences sharing steps, and through a live server (a 500
naming it, then the next request served). The failing request's live sequence is emptied, so no
later request or snapshot reuses its rows, and the next request gets a fresh engine's output;
below the generation loop a host step leaves the state as it was, a device step empties it.
Logits off the accepted path may be NaN: they emit nothing (a NaN inside the model, though,
spreads to the rest of its verify forward through masked attention, 0 times NaN, and then fails
the path's rows too).

The cause is real where it can be: a tiny target whose finite weights overflow on one token `t`
only. Its embedding's coordinate 0, which no other token has (and which the attention writes
nothing to), drives one MLP channel of layer 0 whose down projection is 1e38: the stream becomes
infinite and the next norm NaN. The load check feeds token 0 and passes; a prompt holding t, or an
output reaching t, overflows. Where a failure must come at a chosen step (sampled requests, a
hybrid target), a forward hook makes one verify forward's hidden states NaN."""

import math
import shutil
from pathlib import Path
from typing import NamedTuple, Optional

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree import Engine, SamplingParams
from flashtree.errors import NonFiniteLogits
from flashtree.runtime.device_step import DeviceSteps
from flashtree.runtime.sampling import Sampler, finite_rows
from flashtree.serve.chat import IncrementalDetokenizer
from test_fast_path import use_static_runner
from test_hybrid import hybrid_pair  # noqa: F401 (fixture)
from test_sequences import side_by_side, static_runners
from tiny_models import SPECIAL_TOKENS

A = [5 + (i * 7) % 300 for i in range(40)]   # its greedy output reaches t
B = [6 + (i * 11) % 300 for i in range(30)]  # neither it nor its greedy output holds t
A_TOKENS, B_TOKENS = 24, 12
SAMPLED = SamplingParams(temperature=0.8, seed=3)
CPU = torch.device("cpu")


class Poisoned(NamedTuple):
    target: Path           # the target that overflows on `token`
    draft: Path
    token: int             # t
    a_out: list[int]       # A's greedy output (t at a_out.index(token))
    b_out: list[int]       # B's
    b_text: str            # B's output as the server's text (its special tokens but the markers left out)


def rewired(src: Path, out: Path, trigger: Optional[int]) -> Path:
    """A copy of the qwen3 target `src` whose layer-0 MLP channel 0 reads only the embedding's
    coordinate 0 (zero for every token but `trigger`; the attention's output projection writes
    none of it) and writes 1e38 to every coordinate of the stream: finite weights, a finite
    forward for every input without the trigger, an infinite stream from the trigger's row on."""
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    embed[:, 0] = 0.0
    if trigger is not None:
        embed[trigger, 0] = 1.0
    state["model.layers.0.self_attn.o_proj.weight"][0] = 0.0
    for proj in ("gate_proj", "up_proj"):
        weight = state[f"model.layers.0.mlp.{proj}.weight"]
        weight[0] = 0.0
        weight[0, 0] = 1.0
    state["model.layers.0.mlp.down_proj.weight"][:, 0] = 1e38
    save_file(state, str(out / "model.safetensors"))
    return out


def engine(target, draft, sequences=1, **kw):
    kw.setdefault("max_ctx", 512)
    return Engine.from_pretrained(str(target), str(draft), device="cpu", max_sequences=sequences, **kw)


@pytest.fixture(scope="module")
def poisoned(tiny_pair, tmp_path_factory):
    """The rewired target without a trigger gives the greedy outputs (the trigger changes only
    the rows of t); t is the first token of A's output from its 6th on that no prompt or earlier
    output holds, and the poisoned target is the rewired one triggered by t."""
    root = tmp_path_factory.mktemp("nonfinite")
    target, draft = tiny_pair
    clean = engine(rewired(target, root / "clean", None), draft, mode="ar")
    a_out = clean.generate(A, max_tokens=A_TOKENS, stop_token_ids=[]).token_ids
    b_out = clean.generate(B, max_tokens=B_TOKENS, stop_token_ids=[]).token_ids
    token = next(tok for i, tok in enumerate(a_out) if i >= 5 and tok >= len(SPECIAL_TOKENS)
                 and tok not in a_out[:i] + A + B + b_out)
    text = IncrementalDetokenizer(clean.tokenizer)
    return Poisoned(rewired(target, root / "poisoned", token), draft, token, a_out, b_out,
                    text.push(b_out) + text.flush())


def until_error(stream) -> tuple[list[int], Optional[NonFiniteLogits]]:
    """The tokens a stream yields before it raises NonFiniteLogits, and that error (None: the
    stream ended without one)."""
    streamed: list[int] = []
    try:
        for tokens in stream:
            streamed += tokens
    except NonFiniteLogits as e:
        return streamed, e
    return streamed, None


def test_draws_say_which_rows_are_finite_and_a_sampled_draw_takes_them_all():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0],
                           [0.0, math.nan, 1.0, 0.0],
                           [0.0, math.inf, 1.0, 0.0],
                           [-math.inf] * 4,                      # nothing drawable
                           [-math.inf, 1.0, -math.inf, 0.5]])    # a grammar's mask: still a distribution
    rows = [True, False, False, False, True]
    assert finite_rows(logits).tolist() == rows
    greedy = Sampler(SamplingParams(), 4, CPU, []).draw(logits)
    assert greedy.finite.tolist() == rows and greedy.tokens[[0, 4]].tolist() == [1, 1]
    sampled = Sampler(SAMPLED.validate(), 4, CPU, []).draw(logits)  # torch.multinomial refuses a NaN row
    assert sampled.finite.tolist() == rows and sampled.tokens[4] in (1, 3)
    tempered = Sampler(SamplingParams(temperature=2e-4).validate(), 4, CPU, []).draw(torch.tensor([[0.0, 1e35, 0, 0]]))
    assert tempered.finite.tolist() == [False], "finite logits whose tempered softmax overflows are no distribution"


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_prompt_that_overflows_fails_its_first_token_and_keeps_no_row(poisoned, sampling):
    eng = engine(poisoned.target, poisoned.draft, mode="ddtree", budget=6)
    prompt = B[:20] + [poisoned.token] + B[20:]
    with pytest.raises(NonFiniteLogits) as info:
        eng.generate(prompt, sampling, max_tokens=B_TOKENS, stop_token_ids=[])
    assert info.value.position == len(prompt)
    assert str(info.value).startswith(f"the model's logits for this request were not finite (NaN or infinity) at "
                                      f"token position {len(prompt)}: its weights or activations overflowed")
    assert eng.state.length == 0 and int(eng.state.length_dev) == 0, "the live sequence keeps no row of the prompt"
    again = eng.generate(B, max_tokens=B_TOKENS, stop_token_ids=[])
    assert again.token_ids == poisoned.b_out and again.stats.cached_tokens == 0
    assert eng.cache.best(prompt)[1] == 0, "no snapshot holds the failed prompt's rows"


@pytest.mark.parametrize("mode,runner", [("ar", "eager"), ("chain", "eager"), ("ddtree", "eager"),
                                         ("chain", "static"), ("ddtree", "static")])
def test_an_output_that_overflows_fails_the_step_that_draws_after_it(poisoned, mode, runner, monkeypatch):
    """ar: a host step; chain and ddtree: device steps, drawn eagerly, or in the greedy phase a
    CUDA graph captures (over static buffers, run eagerly here)."""
    eng = engine(poisoned.target, poisoned.draft, mode=mode, budget=6)
    phases = []
    if runner == "static":
        use_static_runner(eng, 6)
        greedy_phase = DeviceSteps.greedy_phase
        monkeypatch.setattr(DeviceSteps, "greedy_phase", lambda self: phases.append(1) or greedy_phase(self))
    streamed, error = until_error(eng.stream(A, max_tokens=A_TOKENS, stop_token_ids=[]))
    at = poisoned.a_out.index(poisoned.token)
    assert error is not None, "a step drew from NaN logits and went on"
    assert error.position == len(A) + at + 1, "the token after t could not be drawn"
    assert streamed == poisoned.a_out[:len(streamed)] and len(streamed) <= at + 1, "nothing drawn from NaN went out"
    assert eng.state.length == 0 and not eng.state.unread and int(eng.state.length_dev) == 0
    assert (runner == "static") == bool(phases)
    assert eng.generate(B, max_tokens=B_TOKENS, stop_token_ids=[]).token_ids == poisoned.b_out


def oracle_with_second(eng, sequence: list[int], second: int) -> None:
    """A draft double that ranks the true continuation (`sequence`) first and `second` next at
    every depth (test_decoding.install_oracle's, with a fixed runner-up)."""
    vocab = eng.target.config.vocab_size

    def oracle(bonus):
        start = int(eng.state.length_dev)
        logits = torch.zeros(eng.decoder.block_size - 1, vocab)
        for j in range(1, eng.decoder.block_size):
            logits[j - 1, second] = 29.0
            logits[j - 1, sequence[start + j] if start + j < len(sequence) else 0] = 30.0
        return torch.log_softmax(logits, dim=-1)

    eng.decoder._draft_logprobs = oracle


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_tree_holding_an_overflowing_token_emits_no_garbage(poisoned, sampling):
    """Every tree holds t beside its path. t's rows are NaN from layer 1 on, and a masked
    attention's zero weight times a NaN value is NaN: every row of the verify may turn NaN, the
    path's too. Whatever reaches the path, nothing drawn from NaN goes out (a greedy draw was the
    NaN's index, a sampled one made torch.multinomial raise)."""
    eng = engine(poisoned.target, poisoned.draft, mode="ddtree", budget=10)  # past the chain seed's 7
    oracle_with_second(eng, B + poisoned.b_out, poisoned.token)
    streamed, error = until_error(eng.stream(B, sampling, max_tokens=B_TOKENS, stop_token_ids=[], trace=True))
    assert error is not None or len(streamed) == B_TOKENS
    assert sampling is not None or streamed == poisoned.b_out[:len(streamed)]
    assert error is None or (eng.state.length == 0 and error.position == len(B) + len(streamed))


def host_steps(eng, prompt: list[int], sampling: Optional[SamplingParams], tokens: int) -> tuple[list[int], list]:
    """Greedy or sampled decoding of `prompt` through host steps alone (the decoder's plan_tree
    and verify_tree: a grammar's path, here without one): the tokens and each step's trace."""
    dec = eng.decoder
    sampler = Sampler((sampling or SamplingParams()).validate(), eng.target.config.vocab_size, CPU, prompt)
    first = sampler.draw(sampler.adjust(dec.prefill_chunk(prompt))).tokens
    out, traces = first.tolist(), []
    while len(out) < tokens:
        res = dec.verify_tree(dec.plan_tree(out[-1], dec.block_size - 1), sampler, want_trace=True)
        out, traces = out + res.tokens, traces + [res.trace]
    return out[:tokens], traces


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("path", ["device", "host"])
def test_rows_off_the_accepted_path_may_be_non_finite(tiny_pair, path, sampling):
    """The target's last hidden state of every tree row holding `second` (the draft's runner-up at
    every depth, never the target's choice) is NaN: those rows' logits, and theirs alone. Only
    the path's rows must be finite, and a sampled step draws at every row, NaN ones included."""
    eng = engine(*tiny_pair, mode="ddtree", budget=10)  # past the chain seed's 7
    want = engine(*tiny_pair, mode="ar").generate(B, max_tokens=B_TOKENS, stop_token_ids=[]).token_ids
    second = next(tok for tok in range(len(SPECIAL_TOKENS), eng.target.config.vocab_size) if tok not in B + want)
    oracle_with_second(eng, B + want, second)

    def overflow(module, inputs, outputs):
        hidden, feats = outputs
        return hidden.masked_fill((inputs[0].ids == second)[:, None], math.nan), feats

    eng.target.register_forward_hook(overflow)
    if path == "device":
        res = eng.generate(B, sampling, max_tokens=B_TOKENS, stop_token_ids=[], trace=True)
        out, traces = res.token_ids, res.trace
    else:
        out, traces = host_steps(eng, B, sampling, B_TOKENS)
    assert len(out) == B_TOKENS and second not in out
    assert sampling is not None or out == want
    assert all(second in step["tree_tokens"] for step in traces if len(step["tree_tokens"]) > 1)


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_a_decoder_step_that_draws_from_nan_leaves_a_consistent_state(tiny_pair, mode):
    """The decoder's own rule, without the generation loop: a host step (ar) raises before its
    commit, the state as it was; a device step, committed on the device, empties it at its read."""
    eng = engine(*tiny_pair, mode=mode, budget=6)
    dec = eng.decoder
    first = int(dec.prefill_chunk(B).argmax())
    eng.target.register_forward_hook(lambda module, inputs, outputs: (outputs[0] * math.nan, outputs[1]))
    with pytest.raises(NonFiniteLogits) as info:
        dec.step(first, Sampler(SamplingParams(), eng.target.config.vocab_size, CPU, B), dec.block_size)
    assert info.value.position == len(B) + 1
    assert not eng.state.unread and eng.state.tokens == (B if mode == "ar" else [])
    assert int(eng.state.length_dev) == eng.state.length


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_logits_that_turn_nan_mid_decode_fail_the_request(tiny_pair, hybrid_pair, kind, mode, sampling):  # noqa: F811
    """The target's forward after the second step's tokens came out gives NaN hidden states,
    once: that step fails, the sequence is emptied (a hybrid's recurrent states too), and the
    next request is a fresh engine's."""
    pair = tiny_pair if kind == "dense" else hybrid_pair
    eng = engine(*pair, mode=mode, budget=6)
    armed = [False]

    def overflow(module, inputs, outputs):
        if armed[0]:
            armed[0] = False
            hidden, feats = outputs
            return torch.full_like(hidden, math.nan), feats
        return None

    eng.target.register_forward_hook(overflow)
    streamed, steps = [], 0
    with pytest.raises(NonFiniteLogits) as info:
        for tokens in eng.stream(A, sampling, max_tokens=A_TOKENS, stop_token_ids=[]):
            streamed += tokens
            steps += bool(tokens)
            if tokens and steps == 2:
                armed[0] = True
    assert info.value.position == len(A) + len(streamed), "the last token out is the failed step's root"
    assert eng.state.length == 0 and not eng.state.unread and not eng.state.checkpoints
    want = engine(*pair, mode=mode, budget=6).generate(B, max_tokens=B_TOKENS, stop_token_ids=[]).token_ids
    assert eng.generate(B, max_tokens=B_TOKENS, stop_token_ids=[]).token_ids == want


@pytest.mark.parametrize("mode,runner", [("ar", "eager"), ("ddtree", "eager"), ("ddtree", "static")])
def test_one_of_two_sequences_sharing_steps_fails_alone(poisoned, mode, runner):
    """A's output reaches t while B decodes beside it: A's step, shared with B's (one verify
    forward; on the static path one walk for both), fails A's request only, and B's output is
    the one it has alone."""
    eng = engine(poisoned.target, poisoned.draft, 2, mode=mode, budget=6, prefill_ubatch=16)
    if runner == "static":
        static_runners(eng, mode)
    failed_in = []
    run = eng.shared_steps.run

    def spy(orders):
        run(orders)
        failed_in.extend(len(orders) for order in orders if isinstance(order.error, NonFiniteLogits))

    eng.shared_steps.run = spy
    streams = [eng.stream(A, max_tokens=A_TOKENS, stop_token_ids=[]),
               eng.stream(B, max_tokens=B_TOKENS, stop_token_ids=[])]
    _, errors = side_by_side(streams)
    assert list(errors) == [0] and isinstance(errors[0], NonFiniteLogits)
    assert errors[0].position == len(A) + poisoned.a_out.index(poisoned.token) + 1
    assert failed_in == [2], "A's step failed inside a step shared with B's"
    assert streams[1].result.token_ids == poisoned.b_out
    assert sorted(seq.state.length for seq in eng.sequences)[0] == 0, "A's live sequence was emptied"


def test_a_server_answers_500_and_serves_the_next_request(poisoned, tmp_path):
    from serve_harness import Server

    log = tmp_path / "server.log"
    srv = Server(poisoned.target, poisoned.draft, log)
    try:
        client = srv.client()
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="x", prompt=B[:20] + [poisoned.token] + B[20:], max_tokens=8,
                                      temperature=0)
        error = info.value.response.json()["error"]
        assert info.value.status_code == 500
        assert error["type"] == "server_error" and error["code"] == "non_finite_logits"
        assert "logits for this request were not finite (NaN or infinity)" in error["message"]
        assert "not the client's fault" in error["message"]
        ok = client.completions.create(model="x", prompt=B, max_tokens=B_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert ok.choices[0].text == poisoned.b_text
        assert srv.get("/health").status_code == 200
    finally:
        srv.stop()
    assert "Traceback" not in log.read_text()
