"""The prefix cache and OOM resilience through the live server: every fault site, the stale-cache
regression, a crash with the disk tier found again, two servers sharing one cache directory, and
an agent loop with a sub-agent."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open

from flashtree.runtime.disk_tier import DiskTier
from serve_harness import Server

A = [5 + (i * 7) % 300 for i in range(90)]
B = [6 + (i * 11) % 300 for i in range(80)]
UBATCH = ["--prefill-ubatch", "32", "--cache-min-tokens", "32"]


def complete(server, prompt, n=12):
    """(status, body) of a greedy completion from token ids that runs to max_tokens."""
    r = server.post("/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": n,
                                             "temperature": 0, "ignore_eos": True})
    return r.status_code, r.json()


def start(tiny_pair, tmp_path, *flags, faults=""):
    """A server of one live sequence: each other prompt evicts it (its snapshots are the subject)."""
    target, draft = tiny_pair
    return Server(target, draft, tmp_path / "server.log", *UBATCH, "--max-sequences", "1", *flags,
                  env={"FLASHTREE_FAULTS": faults})


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory):
    srv = start(tiny_pair, tmp_path_factory.mktemp("ref"))
    try:
        return {name: complete(srv, p)[1]["choices"][0]["text"] for name, p in (("A", A), ("B", B))}
    finally:
        srv.stop()


# site -> (fault spec, the scenario's request names, index of the faulted request, faulted status)
SITES = {
    "prefill": ("prefill:oom:2", ["A"], 0, 200),           # retried with half the ubatch
    "draft": ("draft:oom:1", ["A"], 0, 503),
    "verify": ("verify:oom:1", ["A"], 0, 503),
    "sample": ("sample:oom:1", ["A"], 0, 503),
    "snapshot_save": ("snapshot_save:oom:1", ["A", "B"], 1, 200),       # B snapshots A: lost, B fine
    "snapshot_restore": ("snapshot_restore:oom:1", ["A", "B", "A"], 2, 200),  # A restored: full prefill
}


# the tree's site in the fast suite, every site in the slow one (each a live server, ~5-9 s)
@pytest.mark.parametrize("site", [s if s == "verify" else pytest.param(s, marks=pytest.mark.slow)
                                  for s in SITES])
def test_injected_oom_at_every_site(tiny_pair, tmp_path, reference, site):
    spec, names, faulted, status = SITES[site]
    srv = start(tiny_pair, tmp_path, faults=spec)
    try:
        for i, name in enumerate(names):
            code, body = complete(srv, {"A": A, "B": B}[name])
            if i == faulted and status == 503:
                assert code == 503 and body["error"]["type"] == "out_of_memory", body
                assert site in body["error"]["message"]
            else:
                assert code == 200, body
                assert body["choices"][0]["text"] == reference[name]
        if site == "snapshot_restore":
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert srv.metric("flashtree_cache_cleared_total", reason="oom") == 1
        assert srv.metric("flashtree_oom_total", site=site) == 1
        assert srv.get("/health").status_code == 200
        assert srv.metric("flashtree_worker_restarts_total") == 0
        code, body = complete(srv, A)  # the next request equals a fresh server's
        assert code == 200 and body["choices"][0]["text"] == reference["A"]
    finally:
        srv.stop()


def test_stale_cache_regression(tiny_pair, tmp_path, reference):
    """A cached (live, then as a snapshot); an OOM on another request clears the device tier; A
    again: right answer, re-prefilled, cached_tokens telling the truth."""
    # prefill visits: A 3 chunks (1-3), B 3 (4-6), A restored + 1 chunk (7), B' restored + 1 (8),
    # whose retry with half the ubatch (9) fails too
    srv = start(tiny_pair, tmp_path, "--host-cache-bytes", "0", faults="prefill:oom:8,prefill:oom:9")
    try:
        assert complete(srv, A)[0] == complete(srv, B)[0] == 200
        code, body = complete(srv, A)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(A) - 1
        code, body = complete(srv, B + [7, 7])
        assert code == 503 and body["error"]["type"] == "out_of_memory"
        assert srv.metric("flashtree_prefix_cache_entries", tier="device") == 0
        code, body = complete(srv, A)
        assert code == 200 and body["choices"][0]["text"] == reference["A"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        props = srv.get("/props").json()["prefix_cache"]
        assert props["tiers"]["device"]["entries"] == 1  # B' state saved when A came back
    finally:
        srv.stop()


@pytest.mark.slow  # 8 s: two worker starts
def test_crash_restarts_worker_and_disk_tier_survives(tiny_pair, tmp_path, reference):
    cache_dir = tmp_path / "kv"
    # A: prefill visits 1-3, B: 4-6 (A's state goes straight to disk), the third request dies
    srv = start(tiny_pair, tmp_path, "--prefix-cache-slots", "0", "--host-cache-bytes", "0",
                "--cache-dir", str(cache_dir), faults="prefill:crash:7")
    try:
        assert complete(srv, A)[0] == complete(srv, B)[0] == 200
        assert len(list(cache_dir.glob("*.safetensors"))) == 1
        code, body = complete(srv, [1, 2, 3])
        assert code == 503 and body["error"]["type"] == "engine_restarting"
        srv.wait_healthy()
        code, body = complete(srv, A)
        assert code == 200 and body["choices"][0]["text"] == reference["A"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(A) - 1
        assert srv.metric("flashtree_worker_restarts_total") == 1
        assert srv.metric("flashtree_prefix_cache_hits", tier="disk") == 1
    finally:
        srv.stop()


CONVERSATIONS = [[100 + c * 50 + (i * 13) % 40 for i in range(150)] for c in range(4)]
TIGHT_DISK = ["--prefix-cache-slots", "0", "--host-cache-bytes", "1K",  # every snapshot to disk
              "--disk-cache-bytes", "8M", "--cache-min-tokens", "16"]  # ~6 of the 1.3 MB files


def turn(c, r):
    """Conversation c's prompt in round r: the rounds diverge after the conversation's prefix."""
    return CONVERSATIONS[c] + [7 + r] * (r + 1)


@pytest.mark.slow
def test_two_servers_sharing_a_cache_dir_answer_right_and_leave_it_valid(tmp_path):
    """Both write the same snapshots (same greedy states, same file names), trim files the other
    one knows of, and restore while the other replaces or deletes: no crash, the answers of a
    server without a cache, and only whole, checksummed files in the directory at the end."""
    cache_dir = tmp_path / "kv"
    # one live sequence each: every other conversation evicts it, through the shared directory
    flags = [*TIGHT_DISK, "--cache-dir", str(cache_dir), "--max-sequences", "1"]
    with ThreadPoolExecutor(2) as pool:  # the embedded model: ~15 s to start on 2 cores
        started = [pool.submit(Server, None, None, tmp_path / "ref.log", "--prefix-cache-slots", "0",
                               "--host-cache-bytes", "0"),
                   pool.submit(Server, None, None, tmp_path / "one.log", *flags)]
    servers = [f.result() for f in started if f.exception() is None]
    try:
        ref, one = (f.result() for f in started)  # a failed start raises here, the other is stopped
        order = list(range(4))
        expected = {(c, r): complete(ref, turn(c, r), 8)[1]["choices"][0]["text"] for r in range(3) for c in order}
        ref.stop()
        for c in order:  # files for the second server to find at its start
            complete(one, turn(c, 0), 8)
        two = Server(None, None, tmp_path / "two.log", *flags)
        servers.append(two)

        def conversation(srv, cs):
            return [(c, r, *complete(srv, turn(c, r), 8)) for r in range(3) for c in cs]

        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(conversation, one, order), pool.submit(conversation, two, order[::-1])]
            results = [row for run in runs for row in run.result()]
        for c, r, code, body in results:
            assert code == 200, body
            assert body["choices"][0]["text"] == expected[c, r], (c, r)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, len(CONVERSATIONS[c]))
        assert one.metric("flashtree_prefix_cache_hits", tier="disk") + two.metric(
            "flashtree_prefix_cache_hits", tier="disk") > 0
        assert one.metric("flashtree_worker_restarts_total") == two.metric("flashtree_worker_restarts_total") == 0
    finally:
        for srv in servers:
            srv.stop()
    logs = "".join((tmp_path / f"{name}.log").read_text() for name in ("one", "two"))
    assert "Traceback" not in logs and "deleting cache file" not in logs  # nothing found damaged
    files = sorted(cache_dir.glob("*.safetensors"))
    assert files and not list(cache_dir.glob("*.tmp"))
    with safe_open(str(files[0]), framework="pt") as f:
        tier = DiskTier(cache_dir, f.metadata()["fingerprint"])
    found = tier.scan()
    assert [f.path for f in found] == files and sum(f.nbytes for f in found) <= 8 << 20
    for f in found:
        tier.read(f.path, f.tokens, torch.device("cpu"))  # whole and checksummed


SYSTEM = "You are a coding agent. " + " ".join(
    f"Tool {i}: read_file(path) reads a file; write_file(path, text) writes it; run(cmd) runs it."
    for i in range(60))
SUB_SYSTEM = "You are a sub-agent that summarises files. " * 40


def test_agent_loop_serves_turns_from_cache_with_a_sub_agent(tiny_pair, tmp_path):
    target, draft = tiny_pair
    srv = Server(target, draft, tmp_path / "server.log", "--prefix-cache-slots", "2",
                 max_ctx=8192)
    try:
        client = srv.client()
        main = [{"role": "system", "content": SYSTEM}]
        ratios = []
        for turn in range(10):
            main.append({"role": "user", "content": f"Task {turn}: fix the bug in module_{turn}.py"})
            r = client.chat.completions.create(model="x", messages=main, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
            main.append({"role": "assistant", "content": r.choices[0].message.content})
            if turn:
                ratios.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
            if turn in (3, 6):  # a sub-agent's own conversation in between
                client.chat.completions.create(
                    model="x", max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                    messages=[{"role": "system", "content": SUB_SYSTEM},
                              {"role": "user", "content": f"Summarise module_{turn}.py"}])
        assert r.usage.prompt_tokens > 1500
        assert min(ratios) >= 0.9, ratios
    finally:
        srv.stop()
