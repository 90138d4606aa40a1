"""A seeded stress of the live sequences on a KV page pool that holds about one prompt: requests
arrive at random (a shared system prompt, continuations of finished conversations, unrelated
prompts), start where Engine.can_admit admits them (as the server's worker does), advance a
boundary each in turn, are cancelled at random, and meet injected out-of-memory faults. Every
answer that finishes equals the one-sequence engine's; only the injected faults fail a request;
nothing waits forever; and at the end no sequence is busy and every page's reference count is
the number of caches and snapshots that hold it."""

import collections
import random

import pytest

from flashtree import Engine
from flashtree.errors import EngineOutOfMemory, KVPagesExhausted
from flashtree.runtime import faults
from test_hybrid import hybrid_pair  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
N = 10
SYSTEM = [5 + (i * 7) % 300 for i in range(60)]



def engine(pair, mode: str, **kw) -> Engine:
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", max_ctx=512, prefill_ubatch=16,
                                  mode=mode, budget=6, **kw)


class Alone:
    """Each prompt's answer from a one-sequence engine, computed with no fault armed."""

    def __init__(self, pair, mode: str):
        self.engine = engine(pair, mode, max_sequences=1)
        self.answers: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        if tuple(prompt) not in self.answers:
            armed, faults._plan = faults._plan, {}
            try:
                self.answers[tuple(prompt)] = self.engine.generate(prompt, max_tokens=N, stop_token_ids=[]).token_ids
            finally:
                faults._plan = armed
        return self.answers[tuple(prompt)]


def assert_pages_held_as_counted(eng: Engine) -> None:
    holders: dict[int, tuple] = {}
    for seq in eng.sequences:
        assert not seq.busy and seq.paused is None
        for cache in seq.state.kv_caches():
            holders.setdefault(id(cache.pool), (cache.pool, collections.Counter()))[1].update(cache.held)
    for entry in eng.cache.entries:
        for pages in entry.held or []:
            holders[id(pages.pool)][1].update(pages.pages)
    for pool, held in holders.values():
        free = set(pool.free)
        for page in range(pool.shared, pool.pages):
            assert pool.refs[page] == held[page], f"page {page}: {pool.refs[page]} refs, {held[page]} holders"
            assert (page in free) == (held[page] == 0), f"page {page}: free list and holders disagree"


@pytest.mark.parametrize("kind,mode,seed,plan", [
    ("dense", "ddtree", 4, "prefill:oom:5,verify:oom:40,snapshot_restore:oom:2"),
    ("hybrid", "chain", 8, "verify:oom:25,prefill:oom:14,snapshot_save:oom:3"),
])
def test_random_arrivals_cancels_and_faults_keep_answers_and_pages(tiny_pair, hybrid_pair,  # noqa: F811
                                                                   kind, mode, seed, plan):
    pair = tiny_pair if kind == "dense" else hybrid_pair
    rng = random.Random(seed)
    eng, alone = engine(pair, mode, max_sequences=4, kv_pool_tokens=512), Alone(pair, mode)
    preempted = []
    eng.listeners.append(lambda event, data: preempted.append(data) if event == "preempted" else None)
    finished: list[list[int]] = []

    def arrival() -> list[int]:
        draw = rng.random()
        turns = [f for f in finished if len(f) < 400]  # room for the next turn in max_ctx
        if turns and draw < 0.4:  # a conversation's next turn
            return rng.choice(turns) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))]
        if draw < 0.8:  # an agent sharing the system prompt
            return SYSTEM + [rng.randrange(3, 300) for _ in range(rng.randrange(5, 80))]
        return [rng.randrange(3, 300) for _ in range(rng.randrange(5, 150))]

    faults.configure(plan)
    waiting, running, ends = collections.deque(), {}, collections.Counter()
    arrivals = 40
    while arrivals or waiting or running:
        if arrivals and rng.random() < 0.5:
            waiting.append(arrival())
            arrivals -= 1
        while waiting and eng.can_admit(len(running), waiting[0]):
            prompt = waiting.popleft()
            stream = eng.stream(prompt, max_tokens=N, stop_token_ids=[])
            running[id(stream)] = (prompt, stream, iter(stream))
        assert running or not waiting, f"nothing runs and a {len(waiting[0])}-token prompt waits"
        for key, (prompt, stream, turns) in list(running.items()):
            if rng.random() < 0.01:
                stream.cancel()
            try:
                next(turns)
                continue
            except StopIteration:
                result = stream.result
                ends[result.finish_reason] += 1
                if result.finish_reason != "cancelled":
                    assert result.token_ids == alone(prompt), "an answer differs from the one-sequence engine's"
                    finished.append(prompt + result.token_ids)
            except EngineOutOfMemory as e:  # an injected fault's; a request never fails for want of a page
                assert not isinstance(e, KVPagesExhausted), e
                ends["out of memory"] += 1
            del running[key]
    assert ends["length"] >= 25 and ends["out of memory"] <= len(plan.split(","))
    assert preempted, "the pool was small enough to preempt"
    assert_pages_held_as_counted(eng)
