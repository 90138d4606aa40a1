"""Device steps queued ahead on the GPU (CUDA graphs, bf16): a ddtree step is two graph replays
(the draft with its tree build; the verify with its draws, walk and commit) and one read, which
comes after the next step's draft is queued; drafting ahead changes no token (greedy or sampled
at a seed) against each draft after the read; greedy spec equals greedy AR (or parts at a bf16
tie, as test_gpu_decode.py judges); and a padded path folds bit for bit as the real path does.
"""

import traceback
import warnings

import pytest
import torch
from test_decoding import PROMPT
from test_gpu_decode import DEV, greedy, make, same_or_tie

from flashtree import Engine, SamplingParams
from flashtree.bench.models import build_pair
from flashtree.kernels.gated_delta import gated_delta_fold
from flashtree.runtime.sampling import Sampler

pytestmark = pytest.mark.gpu
N = 192

# torch.cuda.set_sync_debug_mode itself makes a synchronizing call (reported from this file)
# as it switches the check on: not the step's
SYNC_MODE_SWITCH = "torch/cuda/__init__.py"


@pytest.fixture(scope="module", params=["qwen3-1.7b", "qwen3.5-4b"])
def pair(request):
    """A dense and a hybrid random pair (conftest's `ref32` and `prompt` are built from it)."""
    return build_pair(request.param, DEV, max_pos=4096, seed=0, head_std=0.05)


def pipelined(dec, prompt, n, params=None):
    """The engine's loop: launch, queue the next draft, read, observe. (tokens, accept lengths,
    steps drafted ahead)."""
    dec.state.truncate(0)
    sampler = Sampler(params or SamplingParams(), dec.target.config.vocab_size, DEV, prompt)
    out = [int(dec.prefill_chunk(prompt).argmax())]
    ahead, accepts, drafted = None, [], 0
    while len(out) < n:
        room = n - len(out)
        drafted += ahead is not None
        launched = dec.launch(out[-1], sampler, room, ahead=ahead)
        ahead = dec.draft_ahead(launched, room)
        res = dec.read(launched)
        sampler.observe(res.tokens)
        out.extend(res.tokens)
        accepts.append(len(res.tokens))
    return out, accepts, drafted


def synchronous(dec, prompt, n, params):
    """Each step drafted after the read (Decoder.step), observing as the engine does."""
    dec.state.truncate(0)
    sampler = Sampler(params, dec.target.config.vocab_size, DEV, prompt)
    out = [int(dec.prefill_chunk(prompt).argmax())]
    accepts = []
    while len(out) < n:
        res = dec.step(out[-1], sampler, n - len(out))
        sampler.observe(res.tokens)
        out.extend(res.tokens)
        accepts.append(len(res.tokens))
    return out, accepts


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_drafting_ahead_changes_no_token(pair, prompt, mode):
    """The same graphs over the same inputs: the queued path equals the synchronous one exactly."""
    a, acc_a, drafted = pipelined(make(pair, mode), prompt, N)
    b, acc_b = greedy(make(pair, mode), prompt, N)
    assert drafted > 0 and (a, acc_a) == (b, acc_b)


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_drafting_ahead_equals_ar(pair, prompt, ref32, mode):
    ar, _ = greedy(make(pair, "ar"), prompt, N)
    spec, _, _ = pipelined(make(pair, mode), prompt, N)
    assert same_or_tie(ref32, prompt, ar, spec[:N])


@torch.inference_mode()
@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.1, "logprobs": 2}])
def test_sampled_drafting_ahead_equals_the_synchronous_path(pair, prompt, extra):
    """At a seed (the draws outside the graph; with penalties and logprobs too): the same draws,
    so the same tokens and accept lengths."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, **extra)
    a, acc_a, drafted = pipelined(make(pair, "ddtree"), prompt, 96, params)
    assert drafted > 0 and (a, acc_a) == synchronous(make(pair, "ddtree"), prompt, 96, params)


def test_a_ddtree_step_reads_once_after_queuing_the_next_draft(monkeypatch):
    """In the engine's loop each step, past the first, is exactly: the verify phase's replay, the
    next draft phase's replay, then the one read (an event's wait; no synchronizing call
    anywhere else, named by file and line if there is one). The embedded pair: its heads are
    wide enough for the CUDA attention kernels."""
    from flashtree.runtime.engine import ASSETS

    eng = Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda",
                                 dtype="bfloat16", mode="ddtree", budget=22, max_ctx=1024)
    eng.generate(PROMPT, max_tokens=64, stop_token_ids=[])  # compiles, captures
    dec, runner = eng.decoder, eng.runner
    names = {id(run.graph): name[0] for name, run in runner.phases.items()}
    assert set(names.values()) == {"draft", "verify"}
    log: list[tuple[str, str]] = []

    def where() -> str:
        stack = traceback.extract_stack()[:-2]  # without where() and the warning's hook
        ours = [f for f in stack if "/flashtree/" in f.filename] or stack
        return f"{ours[-1].filename}:{ours[-1].lineno}:{ours[-1].name}"

    replay, wait = torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda self: log.append(("replay", names.get(id(self), "forward"))) or replay(self))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: log.append(("read", where())) or wait(self))

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and not filename.endswith(SYNC_MODE_SWITCH):
            log.append(("sync", where()))

    with torch.inference_mode():
        dec.state.truncate(0)
        bonus = int(dec.prefill_chunk(PROMPT).argmax())
        sampler = Sampler(SamplingParams(), eng.target.config.vocab_size, dec.device, PROMPT)
        room, ahead = 600, None
        for i in range(6):
            torch.cuda.synchronize()
            log.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    launched = dec.launch(bonus, sampler, room, ahead=ahead)
                    ahead = dec.draft_ahead(launched, room)
                    res = dec.read(launched)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            room -= len(res.tokens)
            bonus = res.tokens[-1]
            want = [("replay", "draft")] if i == 0 else []  # the first step drafts after no read
            want += [("replay", "verify"), ("replay", "draft")]
            assert [e if e[0] == "replay" else (e[0],) for e in log] == want + [("read",)], log


@torch.inference_mode()
def test_a_padded_fold_is_the_real_paths_fold_on_cuda():
    """The identity steps the padded commit adds (g = 0, beta = 0) leave the Triton fold's state
    bit for bit as the real steps leave it (exp(0) is exactly 1 in the kernel too)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    h, dk, dv, real, rows = 96, 128, 128, 5, 16
    k = torch.nn.functional.normalize(torch.randn(real, h, dk, device=DEV, generator=g), dim=-1)
    v = torch.randn(real, h, dv, device=DEV, generator=g)
    gate, beta = -torch.rand(real, h, device=DEV, generator=g), torch.rand(real, h, device=DEV, generator=g)
    s0 = torch.randn(h, dk, dv, device=DEV, generator=g) * 0.1
    pad = rows - real

    def padded(x, fill=None):
        last = x[-1:].expand(pad, *x.shape[1:])
        return torch.cat([x, last if fill is None else torch.full_like(last, fill)]).contiguous()

    want = gated_delta_fold(s0, k, v, gate, beta)
    got = gated_delta_fold(s0, padded(k), padded(v), padded(gate, 0.0), padded(beta, 0.0))
    assert torch.equal(got, want)


@torch.inference_mode()
def test_hybrid_keep_path_equals_keep_rows_on_cuda(pair):
    if not getattr(pair.target.config, "linear_layers", None):
        pytest.skip("a dense target has no fold")
    st_a = pair.target.new_cache(64, torch.bfloat16, DEV, 24)
    st_b = pair.target.new_cache(64, torch.bfloat16, DEV, 24)
    g = torch.Generator(device=DEV).manual_seed(4)
    for a, b in ((st_a.node_k, st_b.node_k), (st_a.node_v, st_b.node_v), (st_a.ssm, st_b.ssm),
                 (st_a.node_conv, st_b.node_conv)):
        a.copy_(torch.randn(a.shape, device=DEV, generator=g))
        b.copy_(a)
    st_a.node_g.copy_(-torch.rand(st_a.node_g.shape, device=DEV, generator=g))
    st_a.node_beta.copy_(torch.rand(st_a.node_beta.shape, device=DEV, generator=g))
    st_b.node_g.copy_(st_a.node_g)
    st_b.node_beta.copy_(st_a.node_beta)
    path = [0, 2, 3, 7]
    st_a.keep_rows(10, torch.tensor(path, device=DEV))
    pad = torch.tensor(path + [path[-1]] * 12, device=DEV)
    st_b.keep_path(torch.tensor([10], dtype=torch.int32, device=DEV), pad, torch.tensor([len(path)], device=DEV))
    assert torch.equal(st_a.ssm, st_b.ssm) and torch.equal(st_a.conv, st_b.conv)
