"""Several live sequences in one engine: generations advanced side by side, their steps verified
in one shared forward (eager steps: the CPU), give each the tokens it gets alone (ar, chain,
ddtree; dense and hybrid), a side request leaves another session's rows alone, a prompt sharing
a prefix with another sequence takes its rows, and a cancel, an out-of-memory or a busy engine
touches only the request it belongs to."""

import pytest

from flashtree import Engine, SamplingParams
from flashtree.errors import EngineOutOfMemory
from flashtree.runtime import faults
from flashtree.runtime.device_step import DeviceSteps
from test_hybrid import hybrid_pair  # noqa: F401 (fixture)

A = [5 + (i * 7) % 300 for i in range(90)]   # a long conversation
B = [6 + (i * 11) % 300 for i in range(70)]  # an unrelated side request
N = 12



def engine(pair, sequences, **kw):
    kw.setdefault("max_ctx", 512)
    kw.setdefault("prefill_ubatch", 16)  # several chunks a prompt: prefills interleave too
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", max_sequences=sequences, **kw)


def alone(pair, prompt, **kw):
    return engine(pair, 1, **kw).generate(prompt, max_tokens=N, stop_token_ids=[]).token_ids


def side_by_side(streams):
    """Advance each stream one boundary in turn until all end; the order of the turns that
    yielded (index per turn) and each stream's error, if it raised."""
    iters = {i: iter(s) for i, s in enumerate(streams)}
    turns, errors = [], {}
    while iters:
        for i, it in list(iters.items()):
            try:
                next(it)
                turns.append(i)
            except StopIteration:
                del iters[i]
            except Exception as e:  # noqa: BLE001
                errors[i] = e
                del iters[i]
    return turns, errors


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_generations_side_by_side_equal_each_alone(tiny_pair, hybrid_pair, kind, mode):  # noqa: F811
    pair = tiny_pair if kind == "dense" else hybrid_pair
    opts = dict(mode=mode, budget=6)
    want = [alone(pair, p, **opts) for p in (A, B)]
    eng = engine(pair, 2, **opts)
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (A, B)]
    turns, errors = side_by_side(streams)
    assert not errors and [s.result.token_ids for s in streams] == want
    assert turns[:4] == [0, 1, 0, 1], "the two prefills advance a chunk each in turn"
    shared = [s.result.stats.shared_steps for s in streams]
    assert shared[0] == shared[1] >= 5, "their steps verified both trees in one forward"
    assert {seq.state.length for seq in eng.sequences} == {len(A) + N - 1, len(B) + N - 1}


def test_a_side_request_leaves_the_conversation_where_it_was(tiny_pair):
    eng = engine(tiny_pair, 2, mode="ddtree", budget=6)
    first = eng.generate(A, max_tokens=N, stop_token_ids=[])
    side = eng.generate(B, max_tokens=N, stop_token_ids=[])
    assert side.stats.cached_tokens == 0
    turn = A + first.token_ids + [7, 8, 9]  # the conversation's next turn
    again = eng.generate(turn, max_tokens=N, stop_token_ids=[])
    assert again.stats.cached_tokens == len(A) + N - 1, "its own rows, untouched by the side request"
    assert eng.cache.stats()["device"]["entries"] == 0, "no snapshot was needed"
    assert again.token_ids == alone(tiny_pair, turn, mode="ddtree", budget=6)
    assert [s["requests"] for s in eng.cache_stats()["sequences"]] == [2, 1]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_shared_prefix_is_taken_from_another_live_sequence(tiny_pair, hybrid_pair, kind):  # noqa: F811
    """A side request sharing the first 40 tokens with a conversation takes the idle sequence
    and those rows from the conversation's pages (a hybrid: up to its last state checkpoint in
    them; 40 rows are part of one page, so that page is copied) instead of prefilling them or
    cutting the conversation short."""
    pair = tiny_pair if kind == "dense" else hybrid_pair
    opts = dict(mode="ddtree", budget=6, state_checkpoint_interval=32)
    side = A[:40] + B[:30]
    eng = engine(pair, 2, **opts)
    eng.generate(A, max_tokens=N, stop_token_ids=[])
    got = eng.generate(side, max_tokens=N, stop_token_ids=[])
    assert got.stats.cached_tokens == (40 if kind == "dense" else 32)
    assert got.token_ids == alone(pair, side, **opts)
    assert sorted(seq.state.length for seq in eng.sequences) == sorted([len(A) + N - 1, len(side) + N - 1])
    back = eng.generate(A, max_tokens=N, stop_token_ids=[])
    assert back.stats.cached_tokens == len(A) - 1 and back.token_ids == alone(pair, A, **opts)


def test_a_busy_engine_refuses_a_third_generation_until_one_ends(tiny_pair):
    eng = engine(tiny_pair, 2, mode="ddtree", budget=6)
    first, second = (iter(eng.stream(p, max_tokens=N, stop_token_ids=[])) for p in (A, B))
    next(first), next(second)
    third = eng.stream(A[:20], max_tokens=N, stop_token_ids=[])
    with pytest.raises(RuntimeError, match="all 2 live sequences are busy"):
        next(iter(third))
    for _ in first:
        pass
    assert eng.generate(A[:20], max_tokens=N, stop_token_ids=[]).token_ids == alone(tiny_pair, A[:20],
                                                                                   mode="ddtree", budget=6)


def test_a_cancel_mid_prefill_ends_one_generation_and_keeps_its_rows(tiny_pair):
    opts = dict(mode="ddtree", budget=6)
    eng = engine(tiny_pair, 2, **opts)
    cancelled, other = (eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (A, B))
    it = iter(cancelled)
    next(it)  # one prefill chunk
    cancelled.cancel()
    turns, errors = side_by_side([cancelled, other])
    assert not errors and cancelled.result.finish_reason == "cancelled" and cancelled.result.token_ids == []
    assert other.result.token_ids == alone(tiny_pair, B, **opts)
    again = eng.generate(A, max_tokens=N, stop_token_ids=[])
    assert again.stats.cached_tokens == 16 and again.token_ids == alone(tiny_pair, A, **opts), \
        "the chunk prefilled before the cancel stays for reuse"


@pytest.mark.parametrize("site", ["prefill", "verify"])
def test_an_out_of_memory_fails_its_own_request_and_the_other_goes_on(tiny_pair, site):
    opts = dict(mode="ddtree", budget=6)
    want = [alone(tiny_pair, p, **opts) for p in (A, B)]
    eng = engine(tiny_pair, 2, **opts)
    # prefill: the third chunk, A's second (a chunk at the ubatch floor is not retried); verify:
    # the third step's shared verify, and then the first of its sequences' retries alone
    faults.configure("prefill:oom:3" if site == "prefill" else "verify:oom:3,verify:oom:4")
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (A, B)]
    _, errors = side_by_side(streams)
    faults.configure("")
    assert len(errors) == 1 and isinstance(next(iter(errors.values())), EngineOutOfMemory)
    (failed,) = errors
    ok = 1 - failed
    assert streams[ok].result.token_ids == want[ok], "the other request's caches were not touched"
    assert site == "prefill" or streams[ok].result.stats.shared_steps >= 2
    prompt = (A, B)[failed]
    assert eng.generate(prompt, max_tokens=N, stop_token_ids=[]).token_ids == want[failed]


def test_a_server_runs_two_streams_at_once_each_equal_to_the_engine(tiny_pair, tmp_path):
    """Through the openai client: two streamed completions sent together run side by side (their
    token streams overlap in time) and each is the in-process engine's greedy answer; /sequences,
    /props and /metrics report the two live sequences."""
    import threading
    import time

    from serve_harness import Server

    prompts = [A * 3, B * 4]  # 270 and 280 tokens: 17 and 18 chunks of 16
    eng = engine(tiny_pair, 1, max_ctx=1024)
    want = []
    for p in prompts:
        eng.clear_caches()
        want.append(eng.tokenizer.decode(eng.generate(p, max_tokens=40, stop_token_ids=[]).token_ids,
                                         skip_special_tokens=True))
    srv = Server(*tiny_pair, tmp_path / "server.log", "--max-sequences", "2", "--prefill-ubatch", "16")
    try:
        client, start = srv.client(), threading.Barrier(2)
        times, texts = [[], []], ["", ""]

        def run(i):
            start.wait()
            for chunk in client.completions.create(model="x", prompt=prompts[i], max_tokens=40, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    times[i].append(time.monotonic())
                    texts[i] += chunk.choices[0].text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        sequences = srv.get("/sequences").json()
        props = srv.get("/props").json()
        metrics = srv.get("/metrics").text
    finally:
        srv.stop()
    assert texts == want
    assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1], "the two streams overlapped"
    assert sequences["max_sequences"] == 2 and sequences["running"] == [] and sequences["waiting"] == 0
    assert sorted(s["tokens"] for s in sequences["sequences"]) == sorted(len(p) + 39 for p in prompts)
    assert props["total_slots"] == 2
    assert 'flashtree_live_sequence_tokens{sequence="1"}' in metrics
    shared = next(float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("flashtree_shared_decode_steps_total"))
    assert shared >= 20, "most of their steps were verified together (a CPU server's steps are eager)"


def static_runners(eng, mode):
    """Give each of `eng`'s sequences a runner over static buffers, uncaptured: the CUDA path's
    steps, run eagerly (budget 6)."""
    from flashtree.runtime.graphs import ModelRunner

    sizes = [1, 7 if mode == "ddtree" else eng.block_size]
    for seq in eng.sequences:
        seq.runner = seq.decoder.runner = ModelRunner(eng.target, eng.draft, seq.state,
                                                      eng.draft.config.target_layer_ids, sizes, eng.block_size,
                                                      capture=False, static=True)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_shared_device_steps_over_static_buffers_equal_each_alone(tiny_pair, hybrid_pair, kind, mode,  # noqa: F811
                                                                   monkeypatch):
    """The CUDA path's shared step, run eagerly over static buffers: one draft phase drafting both
    blocks and building both trees, one phase verifying both, walking both in one accept,
    appending both paths to the draft's context in one forward, and committing both (their KV
    rows in one move)."""
    pair = tiny_pair if kind == "dense" else hybrid_pair
    opts = dict(mode=mode, budget=6)
    want = [alone(pair, p, **opts) for p in (A, B)]
    eng = engine(pair, 2, **opts)
    static_runners(eng, mode)
    drafted_together = []
    draft_together = eng.shared_steps._draft_together
    eng.shared_steps._draft_together = lambda orders: drafted_together.append(draft_together(orders)) or \
        drafted_together[-1]
    appended = []
    write_context = eng.draft.write_context
    eng.draft.write_context = lambda inp: appended.append(len(inp.sequences())) or write_context(inp)
    walked = []
    walk_together = DeviceSteps.walk_together
    monkeypatch.setattr(DeviceSteps, "walk_together",
                        staticmethod(lambda steps, draws: walked.append(len(steps)) or walk_together(steps, draws)))
    committed, commit_together = [], DeviceSteps.commit_together
    monkeypatch.setattr(DeviceSteps, "commit_together", staticmethod(
        lambda steps, walks: committed.append(len(steps)) or commit_together(steps, walks)))
    built, one_by_one, build_one, build_together = [], [], DeviceSteps._build, DeviceSteps.build_together
    monkeypatch.setattr(DeviceSteps, "_build", lambda self, *a: one_by_one.append(1) or build_one(self, *a))

    def spy_build_together(steps, proposals):  # how many trees, and how many of them built one by one
        before = len(one_by_one)
        build_together(steps, proposals)
        built.append((len(steps), len(one_by_one) - before))
    monkeypatch.setattr(DeviceSteps, "build_together", staticmethod(spy_build_together))
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (A, B)]
    _, errors = side_by_side(streams)
    assert not errors and [s.result.token_ids for s in streams] == want
    assert min(s.result.stats.shared_steps for s in streams) >= 5
    assert sum(len(d) == 2 for d in drafted_together) >= 4, "both blocks drafted in one forward"
    assert appended.count(2) >= 4, "both accepted paths appended to the draft's context in one forward"
    assert walked.count(2) >= 4, "both trees walked in one accept"
    assert committed.count(2) >= 4, "both paths' KV rows kept in one move"
    assert built.count((2, 0 if mode == "ddtree" else 2)) >= 4, "a shared phase builds both ddtrees at once"


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_shared_steps_draft_the_next_steps_ahead_and_equal_each_alone(tiny_pair, hybrid_pair, kind, mode):  # noqa: F811
    """Over static buffers, with room for whole blocks: before a shared step is read, the next
    steps' draft phase is queued behind it (one for both sequences, each root the bonus its
    commit left on the device) and each generation's next step verifies that draft. The outputs,
    a greedy one and a sampled one, are each one's alone."""
    pair = tiny_pair if kind == "dense" else hybrid_pair
    opts, tokens = dict(mode=mode, budget=6), 40
    samplings = (None, SAMPLED)
    want = [engine(pair, 1, **opts).generate(p, s, max_tokens=tokens, stop_token_ids=[]).token_ids
            for p, s in zip((A, B), samplings)]
    eng = engine(pair, 2, **opts)
    static_runners(eng, mode)
    ahead = []
    queue = eng.shared_steps._queue_drafts
    eng.shared_steps._queue_drafts = lambda decoders, bonuses: ahead.append(bonuses) or queue(decoders, bonuses)
    streams = [eng.stream(p, s, max_tokens=tokens, stop_token_ids=[]) for p, s in zip((A, B), samplings)]
    _, errors = side_by_side(streams)
    assert not errors and [s.result.token_ids for s in streams] == want
    assert min(s.result.stats.drafted_ahead for s in streams) >= 3
    assert [None, None] in ahead, "both sequences' next drafts queued in one phase, roots on the device"


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.1, logprobs=2)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_sampled_requests_share_the_device_verify_and_draw_as_alone(tiny_pair, hybrid_pair, kind, mode):  # noqa: F811
    """A sampled request (a temperature, top-p, a penalty, logprobs, a seed) beside a greedy one
    in the CUDA path's shared steps, eagerly over static buffers: the shared phase verifies
    both trees, walks and commits the greedy one, and the sampled one draws from its own rows
    of the phase's output after it. Each emits what it emits alone, logprobs included, and
    their steps were shared."""
    pair = tiny_pair if kind == "dense" else hybrid_pair
    opts = dict(mode=mode, budget=6)
    samplings = (SAMPLED, None)
    want = [engine(pair, 1, **opts).generate(p, s, max_tokens=N, stop_token_ids=[]) for p, s in zip((A, B), samplings)]
    eng = engine(pair, 2, **opts)
    static_runners(eng, mode)
    streams = [eng.stream(p, s, max_tokens=N, stop_token_ids=[]) for p, s in zip((A, B), samplings)]
    _, errors = side_by_side(streams)
    assert not errors and [s.result.token_ids for s in streams] == [w.token_ids for w in want]
    got, alone_lp = streams[0].result.logprobs, want[0].logprobs  # (logprob, [(id, logprob)] alternatives)
    assert len(got) == len(alone_lp) == N
    for (lp, alts), (lp_alone, alts_alone) in zip(got, alone_lp):
        assert abs(lp - lp_alone) < 1e-4 and [i for i, _ in alts] == [i for i, _ in alts_alone]
    assert min(s.result.stats.shared_steps for s in streams) >= 5, "the sampled request's steps were shared"


def shared_side_by_side(pair, plan, samplings=(None, None), **opts):
    """A and B side by side (sampled as `samplings` say) in a fresh engine of two sequences over
    static buffers, the faults `plan` configured meanwhile: the streams and each one's error."""
    eng = engine(pair, 2, **opts)
    static_runners(eng, opts["mode"])
    faults.configure(plan)
    streams = [eng.stream(p, s, max_tokens=N, stop_token_ids=[]) for p, s in zip((A, B), samplings)]
    _, errors = side_by_side(streams)
    faults.configure("")
    return eng, streams, errors


@pytest.mark.parametrize("plan", ["verify:oom:1", "verify:oom:1,sample:oom:3"])
def test_a_failed_shared_device_verify_is_retried_by_each_step_alone(tiny_pair, plan):
    """The CUDA path's shared verify phase (eagerly, over static buffers) runs out of memory:
    each step then verifies alone (its own phase), as on the host path. Alone, both succeed:
    both outputs are each one's alone, and that step does not count as shared. With the first
    retry's own phase failing too (the sample site; the two first tokens visited it before),
    that request fails and the other goes on."""
    opts = dict(mode="ddtree", budget=6)
    want = [alone(tiny_pair, p, **opts) for p in (A, B)]
    eng, streams, errors = shared_side_by_side(tiny_pair, plan, **opts)
    if plan == "verify:oom:1":
        _, clean, _ = shared_side_by_side(tiny_pair, "", **opts)
        assert not errors and [s.result.token_ids for s in streams] == want
        assert [s.result.stats.shared_steps + 1 for s in streams] == [s.result.stats.shared_steps for s in clean]
        return
    assert len(errors) == 1 and isinstance(next(iter(errors.values())), EngineOutOfMemory)
    (failed,) = errors
    assert streams[1 - failed].result.token_ids == want[1 - failed]
    assert eng.generate((A, B)[failed], max_tokens=N, stop_token_ids=[]).token_ids == want[failed]


def test_a_sampled_step_whose_shared_verify_failed_runs_alone(tiny_pair):
    """The shared verify phase of a sampled and a greedy step runs out of memory: the sampled
    step then runs whole alone (its verify, draws, walk and commit), the greedy one its own
    phase, and both emit what they emit alone."""
    opts = dict(mode="ddtree", budget=6)
    samplings = (SAMPLED, None)
    want = [engine(tiny_pair, 1, **opts).generate(p, s, max_tokens=N, stop_token_ids=[]).token_ids
            for p, s in zip((A, B), samplings)]
    _, streams, errors = shared_side_by_side(tiny_pair, "verify:oom:1", samplings, **opts)
    assert not errors and [s.result.token_ids for s in streams] == want


def test_steps_of_different_shapes_are_refused_a_shared_build_or_walk():
    """Trees built or walked together must have one size: steps of another mode, budget or chain
    seeding (not one engine's sequences) are refused, not built at the first one's budget."""
    from types import SimpleNamespace

    from flashtree.runtime.device_step import _alike
    one, other = SimpleNamespace(name=("ddtree", 6, True, 1)), SimpleNamespace(name=("ddtree", 6, True, 2))
    assert _alike([one, other]) is one
    for odd in (("ddtree", 8, True, 3), ("chain", 6, True, 3), ("ddtree", 6, False, 3)):
        with pytest.raises(ValueError, match="one decode mode"):
            _alike([one, SimpleNamespace(name=odd)])
