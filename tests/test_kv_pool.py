"""The KV page pool (models/kv_cache.py): sequences hold pages, share a common prefix's pages by
reference and never write a page another holds; idle sequences give their pages back when the
pool runs short, and a request that finds none left fails alone."""

import pytest
import torch

from flashtree import Engine
from flashtree.errors import KVPagesExhausted
from flashtree.kernels.kv_storage import PAGE_ROWS, kv_rows, store_kv
from flashtree.models.kv_cache import KVCache, PagePool
from flashtree.serve.metrics import Metrics
from test_hybrid import hybrid_pair  # noqa: F401 (fixture)

N = 12


def caches(n: int, pool_rows: int, capacity: int = 4 * PAGE_ROWS, kv_type=None) -> list[KVCache]:
    pool = PagePool(2, pool_rows, 2, 32, torch.float32, "cpu", kv_type)
    return [KVCache(2, capacity, 2, 32, torch.float32, "cpu", kv_type, pool=pool) for _ in range(n)]


def write(cache: KVCache, start: int, end: int, value: float) -> None:
    cache.ensure(end)
    rows = torch.arange(start, end)
    for i in range(2):
        for side in cache.layer(i):
            store_kv(side, rows, torch.full((end - start, 2, 32), value) + rows[:, None, None])


def read(cache: KVCache, end: int) -> torch.Tensor:
    return torch.stack([kv_rows(side, end, torch.float32) for i in range(2) for side in cache.layer(i)])


def test_a_shared_prefix_holds_the_same_pages_and_writes_go_to_private_ones():
    a, b = caches(2, 8 * PAGE_ROWS)
    write(a, 0, 150, 1.0)
    before = read(a, 150).clone()
    b.share_pages(a.held, 140)  # pages 0 and 1 by reference, page 2 (rows 128..139) copied
    assert b.held[:2] == a.held[:2] and b.held[2] != a.held[2]
    assert b.shared_pages() == 2 and a.shared_pages() == 2
    assert torch.equal(read(b, 140), before[:, :140])
    write(b, 140, 200, -5.0)  # past the shared prefix: its own pages
    assert torch.equal(read(a, 150), before), "the lender's rows are untouched"
    a.cut(30)  # the lender goes back inside a shared page: it takes a copy before writing there
    assert a.held[0] != b.held[0] and b.shared_pages() == 0, "a released its page 1 and copied page 0"
    write(a, 30, 64, 9.0)
    assert torch.equal(read(b, 140), before[:, :140]), "the borrower's rows are untouched"


def test_cutting_releases_pages_and_the_pool_counts_its_holders():
    a, b = caches(2, 6 * PAGE_ROWS)
    pool = a.pool
    write(a, 0, 3 * PAGE_ROWS, 1.0)
    b.share_pages(a.held, 2 * PAGE_ROWS)
    assert pool.free_pages == 3
    a.cut(0)
    assert pool.free_pages == 4, "the pages b still holds stay taken"
    b.cut(0)
    assert pool.free_pages == 6 and a.held == b.held == []
    assert (a.table == 0).all(), "a table's unused entries point at the sink page"


def test_an_exhausted_pool_asks_reclaim_then_refuses_without_changing_the_cache():
    a, b = caches(2, 3 * PAGE_ROWS)
    write(a, 0, 2 * PAGE_ROWS, 1.0)
    asked = []
    a.pool.reclaim = asked.append
    with pytest.raises(KVPagesExhausted, match="KV page"):
        b.ensure(2 * PAGE_ROWS)
    assert asked == [2] and b.held == [] and a.pool.free_pages == 1
    a.pool.reclaim = lambda n: a.cut(0)  # what the engine does with an idle sequence
    b.ensure(2 * PAGE_ROWS)
    assert len(b.held) == 2 and a.held == []


@pytest.mark.parametrize("kv_type", [None, "q8_0", "q4_0"])
def test_loading_rows_never_writes_a_page_another_cache_holds(kv_type):
    a, b = caches(2, 8 * PAGE_ROWS, kv_type=kv_type)
    write(a, 0, 100, 1.0)
    b.share_pages(a.held, 100)
    saved = {name: rows.clone() for name, rows in a.rows(100).items()}
    other = caches(1, 4 * PAGE_ROWS, kv_type=kv_type)[0]
    write(other, 0, 100, 7.0)
    b.load_rows({name: rows.clone() for name, rows in other.rows(100).items()})
    assert torch.equal(read(b, 100), read(other, 100))
    assert all(torch.equal(rows.clone(), saved[name]) for name, rows in a.rows(100).items())
    assert b.shared_pages() == 0


def engine(pair, **kw):
    kw.setdefault("prefill_ubatch", 16)
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", mode="ddtree", budget=6, **kw)


def alone(pair, prompt, **kw):
    return engine(pair, max_sequences=1, max_ctx=512, **kw).generate(prompt, max_tokens=N, stop_token_ids=[]).token_ids


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_side_request_holds_the_conversations_prefix_pages(tiny_pair, hybrid_pair, kind):  # noqa: F811
    pair = tiny_pair if kind == "dense" else hybrid_pair
    conversation = [5 + (i * 7) % 300 for i in range(300)]  # longer than the side request shares
    side = conversation[:130] + [6 + (i * 11) % 300 for i in range(20)]
    eng = engine(pair, max_sequences=2, max_ctx=512, state_checkpoint_interval=64)
    eng.generate(conversation, max_tokens=N, stop_token_ids=[])
    got = eng.generate(side, max_tokens=N, stop_token_ids=[])
    assert got.stats.cached_tokens == (130 if kind == "dense" else 128)
    assert eng.cache_stats()["kv_pages"]["shared"] == 2, "rows 0..127 held by both, not copied"
    assert got.token_ids == alone(pair, side, state_checkpoint_interval=64)
    back = eng.generate(conversation, max_tokens=N, stop_token_ids=[])
    assert back.stats.cached_tokens == len(conversation) - 1
    assert back.token_ids == alone(pair, conversation, state_checkpoint_interval=64)


def test_idle_sequences_give_pages_back_and_resume_from_their_snapshots(tiny_pair):
    """A pool of one sequence's rows shared by two: each request takes the pages the idle one
    held, after that one's rows were saved as a snapshot, from which its next turn resumes."""
    a = [5 + (i * 7) % 300 for i in range(200)]
    b = [6 + (i * 11) % 300 for i in range(150)]
    eng = engine(tiny_pair, max_sequences=2, max_ctx=256, kv_pool_tokens=256, cache_min_tokens=1)
    first = eng.generate(a, max_tokens=N, stop_token_ids=[])
    side = eng.generate(b, max_tokens=N, stop_token_ids=[])
    assert side.token_ids == alone(tiny_pair, b)
    assert [s["tokens"] for s in eng.cache_stats()["sequences"]] == [0, len(b) + N - 1]
    again = eng.generate(a + first.token_ids, max_tokens=N, stop_token_ids=[])
    assert again.stats.cached_tokens == len(a) + N - 1, "restored from the snapshot saved for the pages"
    assert again.token_ids == alone(tiny_pair, a + first.token_ids)


def test_a_running_sequence_is_preempted_for_pages_and_resumes_where_it_was(tiny_pair):
    """Two prompts side by side in a pool that holds one of them: the first, waiting between
    prefill chunks, gives its rows up (saved as a snapshot) when the second needs a page, waits
    while the second runs, then takes them back and finishes: both answers are their own."""
    from test_sequences import side_by_side

    a = [5 + (i * 7) % 300 for i in range(200)]
    b = [6 + (i * 11) % 300 for i in range(150)]
    eng = engine(tiny_pair, max_sequences=2, max_ctx=256, kv_pool_tokens=256)
    events, metrics = [], Metrics()

    def observe(kind, data):  # as the worker forwards them: /metrics after each event
        metrics.observe_event(kind, data, eng.cache_stats())
        events.append((kind, data, metrics.preempted._value.get()))

    eng.listeners.append(observe)
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (a, b)]
    _, errors = side_by_side(streams)
    assert not errors
    assert [s.result.token_ids for s in streams] == [alone(tiny_pair, a), alone(tiny_pair, b)]
    assert [s.result.stats.preemptions for s in streams] == [1, 0]
    assert [(kind, data["sequence"]) for kind, data, _ in events if kind in ("preempted", "resumed")] == [
        ("preempted", 0), ("resumed", 0)]
    preempted = next(data["tokens"] for kind, data, _ in events if kind == "preempted")
    assert next(data["tokens"] for kind, data, _ in events if kind == "resumed") == preempted
    assert [waiting for kind, _, waiting in events if kind in ("preempted", "resumed")] == [1, 0], \
        "/metrics: flashtree_sequences_preempted"
    assert streams[0].result.stats.cached_tokens == 0, "its own rows came back, not a cached prefix"


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_a_sequence_waiting_for_a_shared_step_is_preempted_and_its_order_withdrawn(tiny_pair, mode):
    """Both decoding in shared steps when the pool runs out: the step's pages are reserved
    before it runs, the later request's sequence is preempted and its order leaves the step; it
    resumes once the other is done, and both answers are their own."""
    from test_sequences import side_by_side

    a = [5 + (i * 7) % 300 for i in range(120)]
    b = [6 + (i * 11) % 300 for i in range(110)]
    opts = dict(mode=mode, max_sequences=2, max_ctx=256, kv_pool_tokens=256)
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", budget=6, prefill_ubatch=16,
                                 **opts)
    streams = [eng.stream(p, max_tokens=60, stop_token_ids=[]) for p in (a, b)]
    _, errors = side_by_side(streams)
    assert not errors
    for prompt, s in zip((a, b), streams):
        want = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", budget=6,
                                      prefill_ubatch=16, mode=mode, max_sequences=1, max_ctx=256)
        assert s.result.token_ids == want.generate(prompt, max_tokens=60, stop_token_ids=[]).token_ids
    assert sum(s.result.stats.preemptions for s in streams) >= 1
    assert max(s.result.stats.shared_steps for s in streams) >= 3, "they shared steps before the pool ran out"


def test_a_preempted_sequence_without_a_snapshot_prefills_its_rows_again_with_heartbeats(tiny_pair):
    """With no tier to keep its snapshot, a preempted sequence prefills its rows again when it
    resumes, a chunk at a time, each chunk a heartbeat (the worker's watchdog hears from it), and
    its answer is still its own."""
    from test_sequences import side_by_side

    a = [5 + (i * 7) % 300 for i in range(200)]
    b = [6 + (i * 11) % 300 for i in range(150)]
    eng = engine(tiny_pair, max_sequences=2, max_ctx=256, kv_pool_tokens=256, prefix_cache_slots=0,
                 host_cache_bytes=0)
    preempted = eng.sequences[0]
    beats_while_paused = []
    eng.on_progress = lambda: beats_while_paused.append(preempted.paused is not None)
    events = []
    eng.listeners.append(lambda kind, data: events.append((kind, data)))
    streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (a, b)]
    _, errors = side_by_side(streams)
    assert not errors and [s.result.stats.preemptions for s in streams] == [1, 0]
    assert eng.cache.stats()["device"]["hits"] == eng.cache.stats()["host"]["hits"] == 0
    held = next(data["tokens"] for kind, data in events if kind == "preempted")
    # the other sequence's own prefill chunks beat meanwhile too
    assert sum(beats_while_paused) >= -(-held // 16), "a heartbeat for each re-prefilled chunk of 16"
    assert [s.result.token_ids for s in streams] == [alone(tiny_pair, a), alone(tiny_pair, b)]


def test_a_resumed_sequence_retries_an_out_of_memory_in_its_prefill_with_smaller_chunks(tiny_pair):
    """The re-prefill of a preempted sequence's rows is a prompt's prefill: an out-of-memory in
    its first chunk clears the device tier and retries with half the chunk (as a prompt's
    would) instead of failing the request, and the answer is still its own."""
    from flashtree.runtime import faults
    from test_sequences import side_by_side

    a = [5 + (i * 7) % 300 for i in range(200)]
    b = [6 + (i * 11) % 300 for i in range(150)]
    opts = dict(max_sequences=2, max_ctx=256, kv_pool_tokens=256, prefix_cache_slots=0, host_cache_bytes=0,
                prefill_ubatch=32, prefill_ubatch_floor=8)

    def run(plan):
        eng = engine(tiny_pair, **opts)
        paused, chunks = eng.sequences[0], []
        chunk = paused.decoder.prefill_chunk

        def counted(ids):  # the prefill site's visit each chunk is, and whether it resumes
            chunks.append((faults._visits.get("prefill", 0) + 1, paused.paused is not None, len(ids)))
            return chunk(ids)

        paused.decoder.prefill_chunk = counted
        faults.configure(plan)
        try:
            streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (a, b)]
            _, errors = side_by_side(streams)
        finally:
            faults.configure("")
        return streams, errors, chunks

    _, errors, chunks = run("prefill:oom:100000")  # counts the visits, fires none
    assert not errors
    first = next(visit for visit, resuming, _ in chunks if resuming)
    streams, errors, chunks = run(f"prefill:oom:{first}")
    assert not errors and [s.result.stats.preemptions for s in streams] == [1, 0]
    resumed = [size for _, resuming, size in chunks if resuming]
    assert resumed[:2] == [32, 16], "the failed chunk of 32, then its retry in 16"
    assert [s.result.token_ids for s in streams] == [alone(tiny_pair, a), alone(tiny_pair, b)]


def test_a_resume_whose_snapshot_restore_runs_out_of_memory_prefills_its_rows_instead(tiny_pair):
    """The restore of a preempted sequence's snapshot is a restore like a prompt's: an
    out-of-memory in it clears the device tier and the rows are prefilled instead of failing
    the request, and the answer is still its own."""
    from flashtree.runtime import faults
    from test_sequences import side_by_side

    a = [5 + (i * 7) % 300 for i in range(200)]
    b = [6 + (i * 11) % 300 for i in range(150)]
    eng = engine(tiny_pair, max_sequences=2, max_ctx=256, kv_pool_tokens=256)
    events = []
    eng.listeners.append(lambda kind, data: events.append((kind, data)))
    faults.configure("snapshot_restore:oom:*")  # b shares nothing with a: only the resume restores
    try:
        streams = [eng.stream(p, max_tokens=N, stop_token_ids=[]) for p in (a, b)]
        _, errors = side_by_side(streams)
    finally:
        faults.configure("")
    assert not errors and [s.result.stats.preemptions for s in streams] == [1, 0]
    assert ("cache_cleared", "snapshot_restore") in [(kind, data.get("site")) for kind, data in events]
    assert [s.result.token_ids for s in streams] == [alone(tiny_pair, a), alone(tiny_pair, b)]


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_over_static_buffers_a_draft_ahead_without_pages_waits_for_its_step(tiny_pair, mode):
    """The CUDA path's steps (static buffers, run eagerly) draft the next step ahead, before the
    step is read, where no sequence may be preempted: when the pool has no page for that draft,
    it is left to the next step. A sequence whose order waits with a draft queued ahead may
    still be preempted for another's step (the draft dropped), rather than the step failing.
    Both answers are their own."""
    from test_sequences import side_by_side, static_runners

    a = [5 + (i * 7) % 300 for i in range(120)]
    b = [6 + (i * 11) % 300 for i in range(110)]
    opts = dict(mode=mode, budget=6, prefill_ubatch=16, max_ctx=256)
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=2,
                                 kv_pool_tokens=256, **opts)
    static_runners(eng, mode)
    streams = [eng.stream(p, max_tokens=60, stop_token_ids=[]) for p in (a, b)]
    _, errors = side_by_side(streams)
    assert not errors
    for prompt, s in zip((a, b), streams):
        want = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=1, **opts)
        assert s.result.token_ids == want.generate(prompt, max_tokens=60, stop_token_ids=[]).token_ids
    assert sum(s.result.stats.preemptions for s in streams) >= 1
    assert max(s.result.stats.drafted_ahead for s in streams) >= 3, "their steps drafted ahead"


def test_a_sequence_decoding_with_a_draft_ahead_is_preempted_for_a_prompt(tiny_pair):
    """One generation decodes alone over static buffers, each step's next draft queued before
    the step is read; a second request arrives and its prefill needs that generation's pages.
    The first is preempted where it hands out its tokens (its draft ahead dropped) and resumes
    once the second is done; both answers are their own."""
    from test_sequences import static_runners

    a = [5 + (i * 7) % 300 for i in range(120)]
    b = [6 + (i * 11) % 300 for i in range(110)]
    opts = dict(mode="ddtree", budget=6, prefill_ubatch=16, max_ctx=256)
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=2,
                                 kv_pool_tokens=256, **opts)
    static_runners(eng, "ddtree")
    first = eng.stream(a, max_tokens=60, stop_token_ids=[])
    turns = iter(first)
    while eng.sequences[0].state.length <= len(a) + 8:  # until it decodes alone, its drafts queued ahead
        next(turns)
    second = eng.stream(b, max_tokens=60, stop_token_ids=[])
    for _ in second:
        pass
    for _ in turns:
        pass
    want = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=1, **opts)
    assert [s.result.token_ids for s in (first, second)] == [want.generate(p, max_tokens=60, stop_token_ids=[]).token_ids
                                                             for p in (a, b)]
    assert first.result.stats.preemptions == 1 and first.result.stats.drafted_ahead >= 3


def test_a_share_whose_page_copy_takes_the_lenders_rows_back_still_shares_them(tiny_pair):
    """A side request shares an idle sequence's prefix pages cache by cache (target, then
    draft). The page that the target's share copies may find the pool empty, and the engine's
    reclaim then gives the idle lender's rows back (saved as a snapshot first): the share holds
    the lender's pages and tokens from the start, so the draft's cache still gets them (it
    raised that 0 pages hold the rows) and the side request answers as it does alone."""
    a = [5 + (i * 13) % 300 for i in range(120)]
    side = a[:100] + [6 + (i * 11) % 300 for i in range(20)]
    eng = engine(tiny_pair, max_sequences=2, max_ctx=256, kv_pool_tokens=256, cache_min_tokens=1)
    eng.generate(a, max_tokens=N, stop_token_ids=[])
    lender, borrower = (s.state for s in eng.sequences)
    for cache in lender.kv_caches():  # another holder takes the free pages
        cache.pool.take(cache.pool.free_pages)
    assert borrower.share_prefix(lender, 100) == 100
    assert lender.length == 0, "the reclaim took the lender's rows"
    assert borrower.tokens == a[:100] and all(len(c.held) == 2 for c in borrower.kv_caches())
    got = eng.generate(side, max_tokens=N, stop_token_ids=[])
    assert got.stats.cached_tokens == 100 and got.token_ids == alone(tiny_pair, side)


PRESSED = dict(mode="ddtree", budget=6, prefill_ubatch=16, max_ctx=256)


def pressed_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    """A prompt of each length, none a prefix of another (no rows shared between them)."""
    return [[5 + k + (i * (7 + 2 * k)) % 300 for i in range(n)] for k, n in enumerate(lengths)]


def pressed_side_by_side(pair, sequences: int, pool_tokens: int) -> list[int]:
    """`sequences` generations of 60-token prompts, 80 tokens each, side by side over a pool of
    `pool_tokens`: each one's preemptions, once every answer is checked against its own alone."""
    from test_sequences import side_by_side

    prompts = pressed_prompts((60,) * sequences)
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", max_sequences=sequences,
                                 kv_pool_tokens=pool_tokens, **PRESSED)
    streams = [eng.stream(p, max_tokens=80, stop_token_ids=[]) for p in prompts]
    _, errors = side_by_side(streams)
    assert not errors, errors
    want = Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", max_sequences=1, **PRESSED)
    assert [s.result.token_ids for s in streams] == [want.generate(p, max_tokens=80, stop_token_ids=[]).token_ids
                                                     for p in prompts]
    return [s.result.stats.preemptions for s in streams]


def test_a_step_that_finds_no_page_waits_for_another_sequences_instead_of_failing(tiny_pair):
    """Three generations decode in shared steps over a pool that holds two of them. A step's
    pages are reserved in turn, and an order whose turn finds none left, with the others
    already given theirs, has no one to preempt: its sequence gives its own rows back and waits
    (preempted) while another runs, and resumes once that one's pages come free, where its
    request failed (KVPagesExhausted). Every answer is its own."""
    assert sum(pressed_side_by_side(tiny_pair, 3, 256)) >= 2


def test_a_preempted_sequence_resumes_only_where_the_running_ones_keep_room_to_step(tiny_pair):
    """Four generations on a pool that holds about two. A preempted sequence resumed as soon as
    its rows fit, took one step, and was preempted again by the next reservation of an older
    one (the latest request, 60 times in 80 tokens: each time all its rows saved and restored).
    It now waits until its rows and next step fit beside the next step of each running one:
    one preemption each, and every answer its own."""
    preemptions = pressed_side_by_side(tiny_pair, 4, 320)
    assert sum(preemptions) >= 1 and max(preemptions) <= 2, preemptions


def test_a_prompt_that_finds_no_page_waits_for_a_running_sequence_that_cannot_be_preempted(tiny_pair):
    """A prompt whose prefill finds no KV page while a running sequence holds them and cannot
    give them up (on the GPU: a commit of its not yet read; here the pools' reclaim refuses
    until that sequence ends) steps aside and waits for them, where its request failed
    (KVPagesExhausted). It waits until the whole prompt fits beside the running sequence's next
    step: resumed as soon as the rows it had prefilled fit, its next chunk found no page again
    (96 round trips of its rows in this prompt). Both answers are their own."""
    opts = dict(PRESSED, prefill_ubatch=128)
    prompts = pressed_prompts((60, 200))
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=2,
                                 kv_pool_tokens=256, **opts)
    pools = [c.pool for c in eng.state.kv_caches()]
    reclaim = pools[0].reclaim
    streams = [eng.stream(p, max_tokens=60, stop_token_ids=[]) for p in prompts]
    turns = {0: iter(streams[0])}
    while eng.sequences[0].state.length < 70:
        next(turns[0])
    for pool in pools:
        pool.reclaim = lambda n: None
    turns[1] = iter(streams[1])
    while turns:
        for i, turn in list(turns.items()):
            try:
                next(turn)
            except StopIteration:
                del turns[i]
                for pool in pools:
                    pool.reclaim = reclaim
    want = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=1, **opts)
    assert [s.result.token_ids for s in streams] == [want.generate(p, max_tokens=60, stop_token_ids=[]).token_ids
                                                     for p in prompts]
    assert streams[1].result.stats.preemptions == 1


def test_a_request_is_admitted_only_where_its_prompt_fits_beside_the_running_ones(tiny_pair):
    """The worker starts a request when the engine admits it (Engine.can_admit): its prompt and
    first step fit in the pages beside each running sequence's rows, prompt and next step, a
    prefix it will share with a running one counted once, and no running one waits preempted.
    Admitted regardless, a new request's prefix restore and prefill preempted the latest running
    sequence, which preempted it back at its next step."""
    eng = engine(tiny_pair, max_sequences=3, max_ctx=256, kv_pool_tokens=256)  # 4 pages of 64 rows
    a = pressed_prompts((150,))[0]
    running = eng.stream(a, max_tokens=40, stop_token_ids=[])
    turns = iter(running)
    while eng.sequences[0].state.length <= len(a):
        next(turns)
    assert eng.can_admit(1, pressed_prompts((1, 20))[1]), "a 20-token prompt's page is free"
    assert not eng.can_admit(1, pressed_prompts((1, 150))[1]), "3 pages beside the 3 it holds"
    assert eng.can_admit(1, a[:130] + [7] * 20), "2 of its 3 pages are the running one's own"
    assert not eng.can_admit(3, pressed_prompts((1, 20))[1]), "no free sequence"
    eng.sequences[0].paused = list(eng.sequences[0].state.tokens)  # as a preemption leaves it
    assert not eng.can_admit(1, pressed_prompts((1, 20))[1]), "a preempted one goes first"
    eng.sequences[0].paused = None
    for _ in turns:
        pass
    assert eng.can_admit(0, pressed_prompts((1, 250))[1]), "none running: the idle rows give way"


def test_a_generation_cancelled_while_preempted_ends_without_a_step_on_no_rows(tiny_pair):
    """A generation preempted out of a shared step waits for its rows; cancelled meanwhile, it
    ends there, its tokens a prefix of its answer alone. It went on to queue a step over the
    empty state it was left with, and handed out that step's tokens."""
    prompts, opts = pressed_prompts((60,) * 3), PRESSED
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=3,
                                 kv_pool_tokens=256, **opts)
    streams = [eng.stream(p, max_tokens=80, stop_token_ids=[]) for p in prompts]
    turns = {i: iter(s) for i, s in enumerate(streams)}
    cancelled = None
    while turns:
        for i, turn in list(turns.items()):
            if cancelled is None and eng.sequences[i].busy and eng.sequences[i].paused is not None:
                streams[i].cancel()
                cancelled = i
            try:
                next(turn)
            except StopIteration:
                del turns[i]
    assert cancelled is not None, "no generation was preempted"
    want = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), device="cpu", max_sequences=1, **opts)
    for i, (prompt, stream) in enumerate(zip(prompts, streams)):
        alone_ids = want.generate(prompt, max_tokens=80, stop_token_ids=[]).token_ids
        if i == cancelled:
            assert stream.result.finish_reason == "cancelled"
            assert stream.result.token_ids == alone_ids[:len(stream.result.token_ids)]
        else:
            assert stream.result.token_ids == alone_ids
