"""A hybrid (Gated DeltaNet) target through the live server: an agent loop whose turns extend the
conversation, with a sub-agent interleaved and an injected out-of-memory, keeps its prefix-cache
reuse and answers as a server without a cache does."""

import pytest

from serve_harness import Server
from tiny_models import make_draft, make_target

MAIN = [5 + (i * 7) % 300 for i in range(90)]
SUB = [6 + (i * 11) % 300 for i in range(70)]
FLAGS = ["--prefill-ubatch", "32", "--cache-min-tokens", "16", "--state-checkpoint-interval", "48"]


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_serve")
    target = make_target(root / "target", arch="qwen3_5", layers=4)
    return target, make_draft(root / "draft", target, block_size=8, target_layer_ids=[1, 2])


def complete(server, prompt, n=10):
    r = server.post("/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": n,
                                             "temperature": 0, "ignore_eos": True})
    body = r.json()
    return r.status_code, body


def answers(server, prompts):
    return [complete(server, p) for p in prompts]


@pytest.mark.slow
def test_agent_loop_through_the_server(hybrid_pair, tmp_path):
    target, draft = hybrid_pair
    turn2 = MAIN + [40, 41, 42, 9, 9]
    sub2 = SUB + [50, 51, 7]
    script = [MAIN, turn2, SUB, turn2 + [60, 61], sub2, MAIN]
    fresh = Server(target, draft, tmp_path / "fresh.log", *FLAGS, "--prefix-cache-slots", "0",
                   "--host-cache-bytes", "0", "--cache-min-tokens", "100000")
    try:  # a server whose every request starts from nothing but the live sequence's reuse
        want = []
        for p in script:
            fresh.post("/v1/completions", json={"model": "x", "prompt": [1], "max_tokens": 1})  # reset live
            want.append(complete(fresh, p)[1]["choices"][0]["text"])
    finally:
        fresh.stop()
    srv = Server(target, draft, tmp_path / "server.log", *FLAGS,
                 env={"FLASHTREE_FAULTS": "verify:oom:30"})
    try:
        got = answers(srv, script)
    finally:
        srv.stop()
    ok = [(code, body) for code, body in got if code == 200]
    assert any(code == 503 and body["error"]["type"] == "out_of_memory" for code, body in got)
    cached = [body["usage"]["prompt_tokens_details"]["cached_tokens"] if code == 200 else None
              for code, body in got]
    texts = [body["choices"][0]["text"] if code == 200 else None for code, body in got]
    assert all(t == w for t, w in zip(texts, want) if t is not None)
    assert len(ok) >= len(script) - 1
    # the reuse each turn must get: the previous prompt's end, a snapshot after the sub-agent
    expected_min = [0, len(MAIN) - 1, 0, len(turn2) - 1, len(SUB) - 1, len(MAIN) - 1]
    for c, e in zip(cached, expected_min):
        assert c is None or c >= e, (cached, expected_min)
