"""The CUDA path end to end on a 1.7B-parameter random bf16 model (the `qwen3-1.7b` preset):
graph replay agrees with the same forwards called directly and with the static buffers run
eagerly, graphs can be captured again after a runner is dropped, and greedy ddtree / chain emit
greedy AR's tokens for 256 tokens, or first diverge where the fp32 model itself sees a tie at
bf16 resolution."""

import copy
import gc

import pytest
import torch

from flashtree.bench.models import build_pair
from flashtree.models.inputs import ForwardInput
from flashtree.runtime.ddtree import build_tree
from flashtree.runtime.decoding import Decoder
from flashtree.runtime.graphs import ModelRunner
from flashtree.runtime.sampling import Sampler, SamplingParams
from flashtree.runtime.sequence import SequenceState

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
N = 256
TIE = 0.03  # a divergence is a bf16 tie if the fp32 logit gap is under 3% of the logit spread


@pytest.fixture(scope="module")
def pair():
    return build_pair("qwen3-1.7b", DEV, max_pos=4096, seed=0, head_std=0.05)


def make(pair, mode, graphs=True, budget=22, kv=None):
    """graphs: True = CUDA graphs, False = the static buffers run eagerly, None = direct calls;
    kv: the target's --kv-type (None: bf16)."""
    t = pair.target
    d = pair.draft if mode != "ar" else None
    bs = pair.draft.config.block_size
    state = SequenceState(t.new_cache(2048, torch.bfloat16, DEV, k_type=kv),
                          d.new_cache(2048, torch.bfloat16, DEV) if d is not None else None, DEV)
    sizes = [1] if d is None else [1, budget + 1 if mode == "ddtree" else bs]
    feats = d.config.target_layer_ids if d is not None else ()
    runner = ModelRunner(t, d, state, feats, sizes, bs, capture=bool(graphs), static=graphs is not None)
    return Decoder(t, d, state, runner, mode, budget, bs, True)


def greedy(dec, prompt, n=N, chunk=None):
    """n greedy tokens after `prompt`, prefilled in chunks of `chunk` tokens (None: one), and the
    number of tokens each step accepted."""
    dec.state.truncate(0)
    sampler = Sampler(SamplingParams(), dec.target.config.vocab_size, DEV, prompt)
    chunk = chunk or len(prompt)
    for first in range(0, len(prompt), chunk):
        logits = dec.prefill_chunk(prompt[first:first + chunk])
    out = [int(logits.argmax())]
    accepts = []
    while len(out) < n:
        res = dec.step(out[-1], sampler, n - len(out))
        out.extend(res.tokens)
        accepts.append(len(res.tokens))
    return out[:n], accepts


def install_oracle(dec, truth, wrong_depth=3):
    """A draft that ranks the true continuation first (second at `wrong_depth`)."""
    vocab = dec.target.config.vocab_size

    def oracle(bonus):
        start = dec.state.length
        depth = dec.block_size - 1
        logits = torch.randn(depth, vocab, device=DEV, generator=torch.Generator(DEV).manual_seed(start))
        for j in range(1, depth + 1):
            true = truth[start + j] if start + j < len(truth) else 0
            logits[j - 1, true] = 30.0
            if j == wrong_depth:
                logits[j - 1, (true + 1) % vocab] = 31.0
        return torch.log_softmax(logits, dim=-1)

    dec._draft_logprobs = oracle


def _last_logits(model, prefix, dtype, kv=None):
    cache = model.new_cache(len(prefix) + 1, dtype, DEV, k_type=kv)
    hidden, _ = model(ForwardInput.prefill(torch.tensor(prefix, device=DEV), cache))
    return model.logits(hidden[-1]).float()


@torch.inference_mode()
def same_or_tie(ref32, prompt, a, b, kv=None, model=None):
    """True if a == b, or if at the first difference the two tokens are a bf16 tie, not a decoding
    error: the fp32 model's logits of the two tokens are within TIE of the logit spread, or (given
    `model`, the bf16 model both ran) within twice the bf16 model's own error on that very logit
    difference, measured on the same prefix (a third way of computing it: one prefill pass). Two
    decoders that each carry an error of that size can order the two tokens either way. `kv`: the
    KV type both ran with, which the fp32 model's cache then has too."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return True
    prefix = prompt + a[:i]
    z = _last_logits(ref32, prefix, torch.float32, kv)
    gap = (z[a[i]] - z[b[i]]).abs().item()
    spread = (z.max() - z.median()).item()
    noise = 0.0
    if model is not None:
        z16 = _last_logits(model, prefix, next(model.parameters()).dtype, kv)
        noise = ((z16[a[i]] - z16[b[i]]) - (z[a[i]] - z[b[i]])).abs().item()
    print(f"first divergence at token {i}: fp32 gap {gap:.4f}, spread {spread:.3f}, bf16 error {noise:.4f}")
    return gap <= TIE * spread or gap <= 2 * noise


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.inference_mode()
def test_graphs_match_direct_calls(pair, prompt):
    plain, fast = make(pair, "ddtree", graphs=None), make(pair, "ddtree", graphs=True)
    long_prompt = (prompt * 8)[:300]
    for dec in (plain, fast):
        dec.state.truncate(0)
        dec.prefill_chunk(long_prompt)
    lp_plain = plain._draft_logprobs(11)
    lp_fast = fast._draft_logprobs(11)
    assert rel(lp_fast, lp_plain) < 3e-2
    vals, ids = lp_plain.topk(22, dim=-1)
    tree = build_tree(11, vals.cpu(), ids.cpu(), 22, True, 15)
    pos = torch.tensor(tree.depths, device=DEV) + 300
    tok = torch.tensor(tree.tokens, device=DEV)
    mask = tree.ancestor_mask(DEV)
    h_plain, f_plain = plain.runner.target_forward(tok, pos, mask)
    h_fast, f_fast = fast.runner.target_forward(tok, pos, mask)
    assert rel(h_fast, h_plain) < 3e-2 and rel(f_fast, f_plain) < 3e-2
    logits_plain, logits_fast = pair.target.logits(h_plain), pair.target.logits(h_fast)
    assert rel(logits_fast, logits_plain) < 3e-2


@torch.inference_mode()
def test_capture_again_after_a_runner_is_dropped(pair, prompt):
    """A dropped runner's graphs, freed by the garbage collector while another runner captures,
    must not invalidate that capture (cudaErrorStreamCaptureInvalidated)."""
    first = make(pair, "ddtree")
    want, _ = greedy(first, prompt, 32)
    cycle = [first]
    cycle.append(cycle)  # only the cyclic collector can free it now
    del first, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # collect at nearly every allocation: during the next capture if allowed
    try:
        second = make(pair, "ddtree")
    finally:
        gc.set_threshold(*threshold)
    got, _ = greedy(second, prompt, 32)
    assert got == want
    second.runner.close()
    third = make(pair, "ddtree")
    assert greedy(third, prompt, 32)[0] == want


@torch.inference_mode()
def test_graph_replay_equals_eager_run(pair, prompt, ref32):
    graphs, eager = make(pair, "ddtree", graphs=True), make(pair, "ddtree", graphs=False)
    a, acc_a = greedy(graphs, prompt, 64)
    b, acc_b = greedy(eager, prompt, 64)
    assert same_or_tie(ref32, prompt, a, b)
    if a == b:
        assert acc_a == acc_b


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_equals_ar_256_tokens(pair, prompt, ref32, mode):
    ar, _ = greedy(make(pair, "ar"), prompt)
    spec, accepts = greedy(make(pair, mode), prompt)
    assert len(spec) == N
    assert same_or_tie(ref32, prompt, ar, spec)


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_with_oracle_draft_equals_ar(pair, prompt, ref32, mode):
    """Long accepted paths: multi-row compaction and context append through the graphs."""
    ar, _ = greedy(make(pair, "ar"), prompt)
    dec = make(pair, mode)
    install_oracle(dec, prompt + ar)
    spec, accepts = greedy(dec, prompt)
    assert same_or_tie(ref32, prompt, ar, spec)
    agree = next((i for i, (x, y) in enumerate(zip(ar, spec)) if x != y), N)
    # the oracle knows AR's tokens: it is right only until a tie diverges. A step's tokens are
    # out[done + 1 .. done + a] (out[0] is prefill's); a step holding the diverging token was cut
    # short by the tie itself, so only the steps wholly before it count
    before, done = [], 0
    for a in accepts:
        if done + a >= agree:
            break
        before.append(a)
        done += a
    assert len(before) < 2 or sum(before) / len(before) > 2.5


@pytest.mark.parametrize("kv", ["fp8", "q8_0", "q4_0"])
@torch.inference_mode()
def test_greedy_spec_equals_ar_with_a_quantized_cache(pair, ref32, prompt, kv):
    """The same KV type on both sides: quantized rows are stored and read alike in a tree
    verify and an AR step, and compacting moves codes and scales together."""
    ar, _ = greedy(make(pair, "ar", kv=kv), prompt, 128)
    for mode in ("chain", "ddtree"):
        spec, _ = greedy(make(pair, mode, kv=kv), prompt, 128)
        # a quantized cache's own error on the two tokens' logits counts too, as in test_gpu_hybrid.py
        assert same_or_tie(ref32, prompt, ar, spec, kv, model=pair.target), mode


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@torch.inference_mode()
def test_the_draft_over_a_quantized_cache_matches_its_cpu_definition(pair, kv):
    """--draft-kv-type on the GPU: the fused store writes the draft's context rows as codes and
    the attention kernels read them; its block forward (which stores the block's own rows as
    codes too) equals the CPU definition's over a copy of the same codes (bf16 rounding apart)."""
    d = pair.draft
    c = d.config
    gen = torch.Generator(device=DEV).manual_seed(0)
    feats = torch.randn(700, len(c.target_layer_ids) * c.hidden_size, device=DEV, generator=gen).bfloat16()
    coded = d.new_cache(1024, torch.bfloat16, DEV, kv)
    d.write_context(ForwardInput(embeds=feats, cache=coded, lengths=torch.zeros(1, dtype=torch.int32, device=DEV)))
    cpu = copy.deepcopy(d).cpu()
    on_cpu = cpu.new_cache(1024, torch.bfloat16, "cpu", kv)
    for name, t in coded.pool.tensors.items():  # caches alone: their pages in order
        on_cpu.pool.tensors[name].copy_(t)
    block = torch.randn(c.block_size, c.hidden_size, device=DEV, generator=gen).bfloat16()
    length = torch.full((1,), 700, dtype=torch.int32, device=DEV)
    got = d(ForwardInput(embeds=block, cache=coded, lengths=length))
    want = cpu(ForwardInput(embeds=block.cpu(), cache=on_cpu, lengths=length.cpu()))
    assert torch.isfinite(got).all() and rel(got.cpu(), want) < 2e-2
