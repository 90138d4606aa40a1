"""A DFlash2 draft on the CUDA path, in bf16: the device step's draft phase, captured in a CUDA
graph (the convolutions, the windowed causal attention and the selector's chain or candidates
included), gives what its static buffers give run eagerly, step for step, and greedy chain /
ddtree (from the top-k or the selector) emit greedy AR's tokens."""

import pytest
import torch

from flashtree import Engine
from flashtree.models.dflash2 import DFlash2Draft
from flashtree.runtime.decoding import Decoder
from flashtree.runtime.graphs import ModelRunner
from flashtree.runtime.sampling import Sampler, SamplingParams
from flashtree.runtime.sequence import SequenceState
from tiny_models import make_dflash2_draft, make_target

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61, 5, 17, 250] * 3
N = 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_dflash2")
    target = make_target(root / "target", layers=4, hidden=128)
    draft = make_dflash2_draft(root / "draft", target, layers=2, target_layer_ids=[1, 2],
                               layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                               is_causal=None, output_multiplier=1.3, final_logit_softcapping=4.0)
    return target, draft


@pytest.fixture(scope="module")
def models(pair):
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), mode="chain", dtype="bfloat16",
                                 device="cuda", max_ctx=512)
    assert isinstance(eng.draft, DFlash2Draft) and eng.runner.captures
    return eng.target, eng.draft


def make(models, mode, graphs, budget=22, tree="topk"):
    """graphs: True = CUDA graphs, False = the static buffers run eagerly; tree: --dflash2-tree."""
    t, d = models
    d = d if mode != "ar" else None
    bs = models[1].config.block_size
    state = SequenceState(t.new_cache(1024, torch.bfloat16, DEV),
                          d.new_cache(1024, torch.bfloat16, DEV) if d is not None else None, DEV)
    sizes = [1] if d is None else [1, budget + 1 if mode == "ddtree" else bs]
    feats = d.config.target_layer_ids if d is not None else ()
    runner = ModelRunner(t, d, state, feats, sizes, bs, capture=graphs, static=True)
    return Decoder(t, d, state, runner, mode, budget, bs, True, tree)


def greedy(dec, n=N):
    sampler = Sampler(SamplingParams(), dec.target.config.vocab_size, DEV, PROMPT)
    out = [int(dec.prefill_chunk(PROMPT).argmax())]
    traces = []
    while len(out) < n:
        res = dec.step(out[-1], sampler, n - len(out), want_trace=True)
        out.extend(res.tokens)
        traces.append(res.trace)
    return out[:n], traces


@pytest.mark.parametrize("mode,tree", [("chain", "topk"), ("ddtree", "topk"), ("ddtree", "selector")])
@torch.inference_mode()
def test_the_captured_draft_phase_equals_its_buffers_run_eagerly(models, mode, tree):
    (out_g, tr_g), (out_e, tr_e) = greedy(make(models, mode, True, tree=tree)), greedy(make(models, mode, False, tree=tree))
    assert [t["draft_tokens"] for t in tr_g] == [t["draft_tokens"] for t in tr_e]
    assert [t["tree_tokens"] for t in tr_g] == [t["tree_tokens"] for t in tr_e]
    assert out_g == out_e


@torch.inference_mode()
def test_greedy_chain_and_ddtree_equal_ar(models):
    want, _ = greedy(make(models, "ar", True))
    for mode, tree in (("chain", "topk"), ("ddtree", "topk"), ("ddtree", "selector")):
        got, traces = greedy(make(models, mode, True, tree=tree))
        assert got == want, (mode, tree)
        assert max(len(t["accepted"]) for t in traces) >= 1
