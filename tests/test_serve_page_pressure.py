"""Agent traffic on a KV page pool far smaller than its sequences' contexts, through the real
server and the openai client: conversations that share a system prompt and grow turn by turn,
with side requests off their prefixes, so that shares, snapshots, restores, spills and
preemptions interleave. Every answer must be the one a one-sequence server gives, and a request
that finds no page must get the out-of-memory error, not a wrong answer or a dropped cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import httpx
import openai
import pytest

from serve_harness import Server
from tiny_models import make_tiny_pair

pytestmark = pytest.mark.slow

SYSTEM = "You are a coding agent. " * 12
AGENTS, TURNS = 8, 4


def ask(server: Server, messages: list[dict]) -> Optional[str]:
    """The greedy answer, or None where the server had no KV page for it (its 503)."""
    try:
        out = server.client().chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0)
    except openai.APIStatusError as err:
        assert err.status_code == 503 and err.body["code"] == "out_of_memory", err.body
        assert "KV page" in err.body["message"]
        return None
    return out.choices[0].message.content or ""


def agent(server: Server, k: int) -> list[tuple[list[dict], Optional[str]]]:
    rng = random.Random(k)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    asked = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"task {k} step {turn} " * rng.randint(2, 5)})
        answer = ask(server, list(messages))
        asked.append((list(messages), answer))
        if answer is None:
            break
        messages.append({"role": "assistant", "content": answer})
        if rng.random() < 0.5:  # a side request off the conversation's first turn
            side = messages[:2] + [{"role": "user", "content": "summarise " * rng.randint(1, 5)}]
            asked.append((side, ask(server, side)))
    return asked


def test_agents_on_a_small_page_pool_get_the_answers_of_a_server_of_one_sequence(tmp_path):
    target, draft = make_tiny_pair(tmp_path)
    small = Server(target, draft, tmp_path / "small.log", "--max-sequences", "4", "--kv-pool-tokens", "1024",
                   max_ctx=1024)
    try:
        with ThreadPoolExecutor(AGENTS) as pool:
            asked = [a for runs in pool.map(lambda k: agent(small, k), range(AGENTS)) for a in runs]
        metrics = httpx.get(small.url + "/metrics").text
    finally:
        small.stop()
    log = (tmp_path / "small.log").read_text()
    assert "Traceback" not in log and "dropped" not in log, log[-3000:]
    restored = [line for line in metrics.splitlines() if line.startswith('flashtree_prefix_cache_hits{tier="host"}')]
    assert restored and float(restored[0].split()[-1]) > 0, "the pool never sent a snapshot down a tier"
    answered = [(m, a) for m, a in asked if a is not None]
    assert len(answered) >= len(asked) // 2, f"{len(asked) - len(answered)} of {len(asked)} found no page"
    alone = Server(target, draft, tmp_path / "alone.log", "--max-sequences", "1", max_ctx=1024)
    try:
        differ = [(m[-1]["content"], a, want) for m, a in answered if (want := ask(alone, m)) != a]
    finally:
        alone.stop()
    assert not differ, differ
