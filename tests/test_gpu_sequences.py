"""Several live sequences on the GPU (the embedded pair, bf16, CUDA graphs): each sequence replays
graphs captured over its own buffers, so two generations advanced side by side give each the
tokens it gets alone, and rows held from another sequence's KV pages are the rows an in-place
reuse keeps, bit for bit."""

import copy

import pytest
import torch
from test_gpu_decode import same_or_tie

from flashtree import Engine
from flashtree.runtime.engine import ASSETS
from test_sequences import A, B, side_by_side

pytestmark = pytest.mark.gpu
N = 48


def engine(sequences, **kw):
    return Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda", dtype="bfloat16",
                                  mode="ddtree", budget=22, max_ctx=2048, prefill_ubatch=64,
                                  max_sequences=sequences, **kw)


def shared_equals_alone(eng):
    """Two prompts generated each alone, then side by side: no errors, at least 5 shared steps
    each, and each answer its alone one but at a bf16 tie (the verify of both trees in one
    forward runs GEMMs over more rows, which may round otherwise). (streams, turns)."""
    prompts = (A * 4, B * 5)
    want = []
    for prompt in prompts:
        eng.clear_caches()
        want.append(eng.generate(prompt, max_tokens=N, stop_token_ids=[]).token_ids)
    eng.clear_caches()
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in prompts]
    turns, errors = side_by_side(streams)
    assert not errors and min(s.result.stats.shared_steps for s in streams) >= 5
    ref32 = copy.deepcopy(eng.target).float()
    for prompt, s, alone in zip(prompts, streams, want):
        assert same_or_tie(ref32, prompt, s.result.token_ids, alone, model=eng.target)
    return streams, turns


def test_side_by_side_on_cuda_graphs_equals_each_alone():
    """Their steps share one captured phase (batch_step.py); the verify of both trees in one
    forward runs bf16 GEMMs over more rows, which may round otherwise: a difference must be a tie."""
    eng = engine(3)
    assert all(seq.runner.captures for seq in eng.sequences)
    _, turns = shared_equals_alone(eng)
    assert turns[:4] == [0, 1, 0, 1] and eng.shared_steps.phases
    used = [seq for seq in eng.sequences if seq.state.length]
    assert len(used) == 2 and all(seq.runner.phases for seq in used)
    phases = [{id(run.graph) for run in seq.runner.phases.values()} for seq in used]
    assert not phases[0] & phases[1], "each sequence replays its own graphs"


def test_rows_held_from_another_sequences_pages_equal_rows_kept_in_place():
    """A side request sharing 70 tokens holds the conversation's first page and a copy of the
    next 6 rows (models/kv_cache.py): its rows are the ones an in-place reuse keeps, bit for bit."""
    side = A[:70] + B[:30]
    shared, in_place = engine(2), engine(1)
    for eng in (shared, in_place):
        eng.generate(A * 2, max_tokens=N, stop_token_ids=[])
    got = shared.generate(side, max_tokens=N, stop_token_ids=[])
    want = in_place.generate(side, max_tokens=N, stop_token_ids=[])
    assert got.stats.cached_tokens == want.stats.cached_tokens == 70
    assert got.token_ids == want.token_ids
    caches = [seq.state.kv_caches()[0] for seq in shared.sequences]
    assert caches[0].held[0] == caches[1].held[0], "the first page is held by both"
    rows = [eng.sequences[i].state.target.rows(70) for eng, i in ((shared, 1), (in_place, 0))]
    assert all(torch.equal(rows[0][name].clone(), rows[1][name].clone()) for name in rows[0])


def test_shared_steps_without_graphs_equal_each_alone():
    """Eager steps (no CUDA graphs): the running sequences' trees go through one verify forward
    (batch_step.py), whose per-sequence attention reads row slices of the batch's projections."""
    eng = engine(2, cuda_graphs=False)
    assert not any(seq.runner.captures for seq in eng.sequences)
    shared_equals_alone(eng)
