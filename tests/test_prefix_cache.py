"""Snapshots across tiers, reuse for agent-style conversations, fault-injected OOM at every site,
and the on-disk tier (survives restarts, rejects foreign or corrupt files)."""

import contextlib
import inspect
import resource
import signal
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashtree import Engine
from flashtree.errors import EngineOutOfMemory
from flashtree.runtime import disk_tier, faults, prefix_cache
from test_disk_tier import overwrite_tensor_bytes

A = [5 + (i * 7) % 300 for i in range(90)]      # a "conversation"
B = [6 + (i * 11) % 300 for i in range(80)]     # a diverging one (a sub-agent)



def make(tiny_pair, **kw):
    target, draft = tiny_pair
    kw.setdefault("max_ctx", 512)
    kw.setdefault("max_sequences", 1)  # one live sequence: every other prompt evicts it
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=8, **kw)
    events = []
    eng.listeners.append(lambda kind, data: events.append((kind, data)))
    return eng, events


def gen(eng, prompt, n=12):
    return eng.generate(prompt, max_tokens=n, stop_token_ids=[])


def cache_files(cache_dir):
    """What a cache directory holds besides its lock file: snapshots and temporaries."""
    return sorted(p.name for p in cache_dir.iterdir() if p.name != disk_tier.LOCK_NAME)


@pytest.fixture(scope="module")
def fresh(tiny_pair):
    target, draft = tiny_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode="ddtree", budget=8, max_ctx=512)
    out = {}
    for name, prompt in (("A", A), ("B", B)):
        eng.clear_caches()
        out[name] = gen(eng, prompt).token_ids
    return out


def test_diverging_request_snapshots_live_state_and_it_is_restored(tiny_pair, fresh):
    eng, _ = make(tiny_pair)
    assert gen(eng, A).token_ids == fresh["A"]
    b = gen(eng, B)
    assert b.token_ids == fresh["B"] and b.stats.cached_tokens == 0
    assert eng.cache.stats()["device"]["entries"] == 1
    again = gen(eng, A + [1, 2])  # the main conversation's next turn, after the sub-agent's
    assert again.stats.cached_tokens == len(A)
    ref, _ = make(tiny_pair)
    assert again.token_ids == gen(ref, A + [1, 2]).token_ids
    assert eng.cache.stats()["device"]["hits"] == 1


def test_rewriting_the_last_tokens_keeps_the_live_state_without_a_snapshot(tiny_pair):
    eng, _ = make(tiny_pair, cache_min_tokens=16)
    first = gen(eng, A)
    live = len(A) + len(first.token_ids)
    edited = A + first.token_ids[:-3] + [7, 8]  # a client re-tokenized the tail of the answer
    again = gen(eng, edited)
    assert again.stats.cached_tokens == live - 3
    assert sum(t["entries"] for t in eng.cache.stats().values()) == 0
    ref, _ = make(tiny_pair)
    assert again.token_ids == gen(ref, edited).token_ids
    gen(eng, A[:len(A) - 20] + [1])  # loses more than 16 tokens of the live state: worth a snapshot
    assert eng.cache.stats()["device"]["entries"] == 1


@pytest.mark.parametrize("fraction", [0.25, 0.0])
def test_a_state_losing_a_small_part_of_itself_is_not_snapshotted(tiny_pair, fraction):
    eng, _ = make(tiny_pair, cache_min_tokens=8, cache_min_fraction=fraction)
    gen(eng, A)
    nxt = gen(eng, A + [1, 2])  # the next turn drops the answer: 12 of 102 tokens, under a quarter
    assert nxt.stats.cached_tokens == len(A)
    assert len(eng.cache.entries) == (0 if fraction else 1)
    branch = A[:50] + [3]  # loses 54 of 104: worth a snapshot either way
    got = gen(eng, branch)
    assert len(eng.cache.entries) == (1 if fraction else 2) and got.stats.snapshot_s > 0  # the copy's time
    assert eng.cache.entries[-1].tokens == tuple(A + [1, 2] + nxt.token_ids[:-1])  # the last one is not fed
    ref, _ = make(tiny_pair)
    assert got.token_ids == gen(ref, branch).token_ids


def test_a_new_host_snapshot_sends_the_least_recently_used_one_down(tiny_pair, tmp_path):
    eng, _ = make(tiny_pair, prefix_cache_slots=0, cache_dir=str(tmp_path))
    prompts = [[10 + k] + A[1:] for k in range(3)]
    gen(eng, prompts[0], 4)
    gen(eng, prompts[1], 4)  # prompts[0]'s state -> host
    eng.cache.host_bytes = 2 * eng.cache.entries[0].nbytes  # room for two such entries
    gen(eng, prompts[2], 4)
    gen(eng, B, 4)  # the third: the host tier is full, so its oldest entry goes to disk
    assert {e.tokens[0]: e.tier for e in eng.cache.entries} == {10: "disk", 11: "host", 12: "host"}
    got = gen(eng, prompts[0] + [3], 4)
    assert got.stats.cached_tokens == len(A) and eng.cache.stats()["disk"]["hits"] == 1


def test_a_host_snapshot_restores_a_strict_prefix_of_itself(tiny_pair):
    eng, _ = make(tiny_pair, prefix_cache_slots=0)  # every snapshot goes to the host tier
    gen(eng, A, 4)
    gen(eng, B, 4)
    assert eng.cache.stats()["host"]["entries"] == 1
    prompt = A[:60] + [3, 4, 5]  # shares 60 of the snapshot's rows, not all of them
    got = gen(eng, prompt)
    assert got.stats.cached_tokens == 60 and eng.cache.stats()["host"]["hits"] == 1
    ref, _ = make(tiny_pair)
    assert got.token_ids == gen(ref, prompt).token_ids


def assert_pages_accounted(eng):
    """Each page of the target's pool is held exactly as often as the live sequences and the
    device snapshots hold it, and free when none does (the sink, page 0, aside)."""
    pool = eng.state.kv_caches()[0].pool
    count = Counter(p for seq in eng.sequences for p in seq.state.kv_caches()[0].held)
    count.update(p for e in eng.cache.entries if e.held for p in e.held[0].pages)
    assert [pool.refs[p] for p in range(1, pool.pages)] == [count[p] for p in range(1, pool.pages)]
    assert sorted(pool.free) == [p for p in range(1, pool.pages) if not count[p]]


def test_a_device_snapshot_holds_the_live_pages_and_a_rewrite_below_it_copies_the_page(tiny_pair, fresh):
    """The device tier keeps a sequence's KV rows in their pages, holding them (no copy), and
    takes nothing of its byte budget for a dense pair (no recurrent states). The live sequence
    then goes back inside the snapshot's last page and writes other tokens there: it must write
    a copy of the page, not the snapshot's rows, which a restore then serves unchanged."""
    eng, _ = make(tiny_pair, cache_min_tokens=8, cache_min_fraction=0.0)
    gen(eng, A)
    pool = eng.state.kv_caches()[0].pool
    live_pages = list(eng.state.kv_caches()[0].held)
    free = pool.free_pages
    branch = A[:70] + [3]  # loses the rows past 70, inside the page of rows 64-127
    got = gen(eng, branch)
    [entry] = eng.cache.entries
    assert entry.tier == "device" and entry.device_nbytes == 0
    target_pages = entry.held[0].pages
    assert target_pages == live_pages[:len(target_pages)]  # the same pages, not copies
    assert all(pool.refs[p] >= 1 for p in target_pages)
    assert eng.state.kv_caches()[0].held[1] != target_pages[1]  # the live sequence wrote a copy
    assert pool.free_pages == free - 1  # that copy is the one page taken
    assert_pages_accounted(eng)
    ref, _ = make(tiny_pair)
    assert got.token_ids == gen(ref, branch).token_ids
    again = gen(eng, A)  # restored by sharing the held pages
    assert again.stats.cached_tokens == len(A) - 1 and again.token_ids == fresh["A"]
    assert eng.cache.stats()["device"]["hits"] == 1


def test_page_pressure_moves_device_snapshots_to_the_host_tier(tiny_pair, fresh):
    """Pages a device snapshot holds are the pool's: when a live sequence needs them, the least
    recently used snapshots move to the host tier, and restore from there the same."""
    eng, _ = make(tiny_pair, max_ctx=256, kv_pool_tokens=256, cache_min_tokens=8, cache_min_fraction=0.0)
    gen(eng, A)
    gen(eng, B)  # A's rows: a device snapshot holding its pages
    assert [e.tier for e in eng.cache.entries] == ["device"]
    c = [9 + (i * 7) % 300 for i in range(200)]
    gen(eng, c)  # B's rows saved too; C needs their pages
    assert [(e.tokens[:len(A)] == tuple(A), e.tier) for e in eng.cache.entries] == [(True, "host"), (False, "host")]
    assert all(e.held is None for e in eng.cache.entries if e.tier == "host")
    assert_pages_accounted(eng)
    again = gen(eng, A)
    assert again.stats.cached_tokens == len(A) - 1 and again.token_ids == fresh["A"]
    assert eng.cache.stats()["host"]["hits"] == 1


def test_slots_and_byte_budgets_move_entries_down_the_tiers(tiny_pair, tmp_path):
    eng, _ = make(tiny_pair, prefix_cache_slots=1, host_cache_bytes=0, cache_dir=str(tmp_path))
    prompts = [[10 + k] + A[1:] for k in range(3)]
    for p in prompts:
        gen(eng, p, 4)
    gen(eng, B, 4)  # saves the third; device holds one slot, host none, so two went to disk
    st = eng.cache.stats()
    assert st["device"]["entries"] == 1 and st["host"]["entries"] == 0 and st["disk"]["entries"] == 2
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    disk_tokens = {e.tokens[0] for e in eng.cache.entries if e.tier == "disk"}
    assert disk_tokens == {10, 11}  # least recently used went first
    res = gen(eng, prompts[0] + [3], 4)  # restore from disk
    assert res.stats.cached_tokens == len(A)
    assert eng.clear_caches() == 4 and not list(tmp_path.glob("*.safetensors"))  # B was saved too


def _no_host_memory(v, pin):  # what the CPU allocator raises when malloc fails
    raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {v.nbytes} bytes")


def test_host_memory_exhaustion_sends_snapshots_to_disk_or_drops_them(tiny_pair, tmp_path, fresh, monkeypatch):
    real_copy = prefix_cache._host_copy

    def no_memory_for_the_host_tier(v, pin):  # a disk write's short-lived staging copy still fits
        for_host_tier = any(frame.function == "_to_host" for frame in inspect.stack()[1:4])
        return _no_host_memory(v, pin) if for_host_tier else real_copy(v, pin)

    monkeypatch.setattr(prefix_cache, "_host_copy", no_memory_for_the_host_tier)
    eng, events = make(tiny_pair, prefix_cache_slots=1, cache_dir=str(tmp_path))
    gen(eng, A)
    gen(eng, B)
    gen(eng, [9] + A[1:])  # A's snapshot leaves the device: no host memory, so it goes to disk
    assert [e.tier for e in eng.cache.entries] == ["disk", "device"]
    faults.configure("verify:oom:1")  # an OOM's recovery must still empty the device tier
    with pytest.raises(EngineOutOfMemory):
        gen(eng, B + [3])  # the live [9]+A... state is saved on the device, B's goes to disk
    faults.configure("")
    assert [e.tier for e in eng.cache.entries] == ["disk", "disk"]  # the device entry dropped, not half-moved
    assert events[-1] == ("cache_cleared", {"reason": "oom", "site": "verify", "dropped": 1})
    again = gen(eng, A + [1, 2])
    assert again.stats.cached_tokens == len(A) and again.token_ids == gen(make(tiny_pair)[0], A + [1, 2]).token_ids


def test_no_host_memory_at_all_costs_snapshots_not_requests(tiny_pair, fresh, tmp_path, monkeypatch):
    monkeypatch.setattr(prefix_cache, "_host_copy", _no_host_memory)  # not even to stage a disk write
    eng, events = make(tiny_pair, prefix_cache_slots=0, cache_dir=str(tmp_path))
    assert gen(eng, A).token_ids == fresh["A"]
    assert gen(eng, B).token_ids == fresh["B"]  # A's snapshot could go nowhere: dropped, with a warning
    assert eng.cache.entries == [] and cache_files(tmp_path) == []
    assert not any(kind == "cache_cleared" for kind, _ in events)  # not treated as a device OOM


def test_host_tier_takes_device_evictions_within_its_budget(tiny_pair):
    eng, _ = make(tiny_pair, prefix_cache_slots=1)
    gen(eng, A, 4)
    gen(eng, B, 4)
    gen(eng, [9] + A[1:], 4)
    st = eng.cache.stats()
    assert st["device"]["entries"] == 1 and st["host"]["entries"] == 1
    host = next(e for e in eng.cache.entries if e.tier == "host")
    assert all(t.device.type == "cpu" for t in host.tensors.values())


def test_disk_entries_survive_a_restart_and_foreign_files_are_rejected(tiny_pair, tmp_path, fresh, caplog):
    eng, _ = make(tiny_pair, prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    gen(eng, A)
    gen(eng, B)  # A's state goes straight to disk
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 10)
    del eng
    target, draft = tiny_pair
    again, _ = make(tiny_pair, cache_dir=str(tmp_path))
    assert [e.tier for e in again.cache.entries] == ["disk"]
    assert "garbage.safetensors" in caplog.text
    res = gen(again, A)
    assert res.stats.cached_tokens == len(A) - 1 and res.token_ids == fresh["A"]
    foreign = Engine.from_pretrained(str(target), None, mode="ar", max_ctx=512, cache_dir=str(tmp_path))
    assert foreign.cache.entries == []  # no draft => other KV layout => fingerprint mismatch


def test_disk_tier_keeps_to_its_byte_budget_least_recently_used_first(tiny_pair, tmp_path, fresh):
    one = dict(prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    eng, _ = make(tiny_pair, **one)
    gen(eng, A)
    gen(eng, B)  # A's state -> disk
    size = eng.cache.stats()["disk"]["bytes"]
    assert size > 0 and len(list(tmp_path.glob("*.safetensors"))) == 1
    eng.cache.disk_bytes = int(size * 1.5)  # room for one file
    gen(eng, [7] + A[1:])  # B's state -> disk; A's file is the least recently used: deleted
    disk = [e for e in eng.cache.entries if e.tier == "disk"]
    assert [e.tokens[:len(B)] for e in disk] == [tuple(B)]
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    del eng
    again, _ = make(tiny_pair, **one, disk_cache_bytes=int(size * 1.5))
    res = gen(again, B)  # found again after a restart, within the budget
    assert res.stats.cached_tokens == len(B) - 1 and res.token_ids == fresh["B"]
    smaller, _ = make(tiny_pair, **one, disk_cache_bytes=size // 2)  # a restart with less room
    assert smaller.cache.entries == [] and list(tmp_path.glob("*.safetensors")) == []


def test_overwritten_tensor_bytes_are_caught_by_the_checksum_and_prefilled_right(tiny_pair, tmp_path, fresh, caplog):
    """A file whose header is intact but whose tensor bytes were overwritten
    used to be restored as it was: wrong answers on every retry, and the bad rows saved again."""
    one = dict(prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    eng, _ = make(tiny_pair, **one)
    gen(eng, A)
    gen(eng, B)  # A's state -> disk
    [path] = tmp_path.glob("*.safetensors")
    overwrite_tensor_bytes(path)
    del eng
    again, _ = make(tiny_pair, **one)  # a restart: the header still names A's tokens
    assert [e.tier for e in again.cache.entries] == ["disk"]
    res = gen(again, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == 0  # prefilled, and says so
    assert "checksum" in caplog.text and not path.exists() and again.cache.entries == []
    gen(again, B)  # A's state is saved again, from its prefill
    res = gen(again, A)
    assert res.stats.cached_tokens == len(A) - 1 and res.token_ids == fresh["A"]


def test_checksumless_files_of_format_1_are_skipped_with_a_warning(tiny_pair, tmp_path, caplog):
    one = dict(prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    eng, _ = make(tiny_pair, **one)
    gen(eng, A)
    gen(eng, B)
    [path] = tmp_path.glob("*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "checksum"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "format": "flashtree-kv-1"})  # as 8ec79bd wrote
    again, _ = make(tiny_pair, **one)
    assert again.cache.entries == [] and path.exists()
    assert "without checksums" in caplog.text


def test_a_file_another_process_deleted_is_a_miss_and_one_it_replaced_is_read(tiny_pair, tmp_path, fresh):
    one = dict(prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    writer, _ = make(tiny_pair, **one)
    gen(writer, A)
    gen(writer, B)  # A's file
    reader, _ = make(tiny_pair, **one)  # a second server on the directory finds it
    writer.clear_caches()  # and the first deletes it
    res = gen(reader, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == 0 and reader.cache.entries == []
    gen(writer, A)
    gen(writer, B)  # A's file again
    reader, _ = make(tiny_pair, **one)
    writer.clear_caches()
    gen(writer, A)
    gen(writer, B)  # replaced by a new file of the same tokens
    res = gen(reader, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == len(A) - 1


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` fail in the kernel (EFBIG), as they would on a full disk."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_disk_write_costs_the_snapshot_not_the_request(tiny_pair, tmp_path, fresh, caplog):
    eng, _ = make(tiny_pair, prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    gen(eng, A)
    with file_size_limit(4096):  # the snapshot is far larger: its write fails part-way
        b = gen(eng, B)
    assert b.token_ids == fresh["B"]
    assert "could not write snapshot" in caplog.text
    assert eng.cache.entries == [] and cache_files(tmp_path) == []  # no partial file left
    assert gen(eng, A).token_ids == fresh["A"]


@pytest.mark.parametrize("site", ["draft", "verify", "sample"])
def test_decode_oom_aborts_request_clears_device_tier_and_next_request_is_right(tiny_pair, fresh, site):
    eng, events = make(tiny_pair, host_cache_bytes=0)
    gen(eng, A)
    gen(eng, B)  # A snapshotted on the device
    faults.configure(f"{site}:oom:2")
    with pytest.raises(EngineOutOfMemory) as err:
        gen(eng, A)  # B snapshotted, A restored, then the fault
    assert err.value.site == site
    assert ("cache_cleared", {"reason": "oom", "site": site, "dropped": 2}) in events
    assert eng.cache.stats()["device"]["entries"] == 0
    faults.configure("")
    res = gen(eng, A)
    assert res.token_ids == fresh["A"]


@pytest.mark.parametrize("mode,site", [("ar", "verify"), ("ar", "sample"), ("ddtree", "draft"),
                                       ("ddtree", "verify"), ("ddtree", "sample")])
def test_oom_mid_decode_keeps_the_live_sequence(tiny_pair, fresh, mode, site):
    """An OOM in the middle of a decode step leaves the live sequence as it was before that
    step: the request repeating the conversation reuses its prompt from the cache."""
    eng = Engine.from_pretrained(str(tiny_pair[0]), str(tiny_pair[1]), mode=mode, budget=8, max_ctx=512)
    faults.configure(f"{site}:oom:3")
    with pytest.raises(EngineOutOfMemory):
        gen(eng, A)
    faults.configure("")
    res = gen(eng, A)
    assert res.token_ids == fresh["A"]
    assert res.stats.cached_tokens >= len(A) // 2
    assert res.stats.cached_tokens == len(A) - 1  # all of it but the token whose logits are needed


def test_prefill_oom_retries_with_half_ubatch(tiny_pair, fresh):
    eng, events = make(tiny_pair, prefill_ubatch=32)
    faults.configure("prefill:oom:2")
    res = gen(eng, A)
    assert res.token_ids == fresh["A"]
    assert [k for k, _ in events] == ["cache_cleared"]
    faults.configure("prefill:oom:*")
    eng.clear_caches()
    with pytest.raises(EngineOutOfMemory, match="prefill"):
        gen(eng, B)
    faults.configure("")
    assert gen(eng, B).token_ids == fresh["B"]


def test_snapshot_save_and_restore_oom_lose_the_cache_not_the_request(tiny_pair, fresh):
    eng, events = make(tiny_pair, host_cache_bytes=0)
    gen(eng, A)
    faults.configure("snapshot_save:oom:1")
    assert gen(eng, B).token_ids == fresh["B"]
    assert events[-1][1]["site"] == "snapshot_save"
    faults.configure("")
    gen(eng, A)  # snapshots B, restores nothing (A was never saved)
    gen(eng, B)  # A saved, B restored... then:
    faults.configure("snapshot_restore:oom:1")
    res = gen(eng, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == 0
    assert events[-1][1]["site"] == "snapshot_restore"


def test_stale_metadata_regression(tiny_pair, fresh):
    """A conversation cached live and as a snapshot; an OOM on another request clears the caches;
    the conversation comes back: right answer, re-prefilled, cached_tokens truthful."""
    eng, _ = make(tiny_pair, host_cache_bytes=0)
    gen(eng, A)
    gen(eng, B)          # A is a device snapshot, B is live
    gen(eng, A)          # A restored and live; B snapshotted
    faults.configure("verify:oom:1")
    with pytest.raises(EngineOutOfMemory):
        gen(eng, B + [7, 7])
    faults.configure("")
    assert eng.cache.stats()["device"]["entries"] == 0
    res = gen(eng, A)
    assert res.token_ids == fresh["A"]
    live_overlap = next(i for i, (x, y) in enumerate(zip(B + [7, 7], A)) if x != y)
    assert res.stats.cached_tokens == live_overlap == 0


def test_memory_plan_refuses_what_cannot_fit(tiny_pair, monkeypatch):
    from flashtree.errors import ConfigError
    from flashtree.runtime import memory_plan
    monkeypatch.setattr(memory_plan, "host_available", lambda: 10_000)
    with pytest.raises(ConfigError, match=r"does not fit.*target weights.*--max-ctx \(now 512"):
        make(tiny_pair)


def test_real_cpu_allocator_failure_is_an_oom():
    with pytest.raises(RuntimeError) as err:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert faults.is_oom(err.value)


def test_fault_spec_is_validated():
    from flashtree.errors import ConfigError
    for bad in ("prefill:oom", "nowhere:oom:1", "prefill:melt:1", "prefill:oom:0"):
        with pytest.raises(ConfigError):
            faults.parse(bad)
    assert faults.parse("prefill:oom:2,verify:crash:*") == {"prefill": [("oom", 2)], "verify": [("crash", None)]}


def corrupt_host_snapshot(eng):
    """Overwrite part of the one host-tier snapshot's first tensor in place, as a bad DIMM or a
    stray write would: returns the entry."""
    [entry] = [e for e in eng.cache.entries if e.tier == "host"]
    name = sorted(entry.tensors)[0]
    raw = entry.tensors[name].view(-1).view(torch.uint8)
    raw[: raw.numel() // 2] = 0x3F
    return entry


def test_a_corrupted_host_snapshot_is_dropped_and_the_prompt_prefilled(tiny_pair, fresh, caplog):
    eng, _ = make(tiny_pair, prefix_cache_slots=0)  # every snapshot goes to the host tier
    gen(eng, A)
    gen(eng, B)  # A's state -> host memory
    entry = corrupt_host_snapshot(eng)
    res = gen(eng, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == 0  # prefilled, and says so
    assert "checksum mismatch" in caplog.text and entry not in eng.cache.entries
    gen(eng, B)  # A's state is saved again, from its prefill, and restores fine
    res = gen(eng, A)
    assert res.token_ids == fresh["A"] and res.stats.cached_tokens == len(A) - 1


def test_a_corrupted_host_snapshot_is_not_written_to_disk(tiny_pair, tmp_path, caplog):
    eng, _ = make(tiny_pair, prefix_cache_slots=0, cache_dir=str(tmp_path))
    gen(eng, A)
    gen(eng, B)
    entry = corrupt_host_snapshot(eng)
    eng.cache._demote_to_disk(entry)  # what the host budget does to its least recently used
    assert entry not in eng.cache.entries and cache_files(tmp_path) == []
    assert "checksum mismatch" in caplog.text


def test_pinning_in_threads_is_asked_of_torch_unless_the_user_set_it(monkeypatch, caplog):
    asked = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", asked.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    prefix_cache.pin_in_threads()
    assert asked == [prefix_cache.PINNED_ALLOCATION]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_num_register_threads:4")
    prefix_cache.pin_in_threads()
    assert len(asked) == 1  # the user's pinned_* settings stand

    def refuses(settings):
        raise RuntimeError("unrecognized key pinned_use_cuda_host_register")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuses, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    prefix_cache.pin_in_threads()  # an older torch: a warning, not a failed start
    assert "pinned memory stays torch's default" in caplog.text


@pytest.mark.parametrize("split", [0, 1, 1023, 1024, 1025, 3000, 4096])
def test_common_prefix_finds_the_first_difference_across_runs_lists_and_tuples(split):
    from flashtree.runtime.sequence import common_prefix

    a = [(i * 7919) % 5000 for i in range(4096)]
    b = a[:split] + [9999] + a[split + 1:]
    assert common_prefix(a, tuple(b)) == min(split, 4096)
    assert common_prefix(tuple(a[:split]), b) == split  # one ends first


def test_a_device_snapshot_restored_at_a_shorter_prefix_keeps_its_later_rows(tiny_pair):
    """A restore of the first 100 of a 212-token snapshot's rows shares only the pages those
    100 rows are in: the sequence then writes past 100, and the snapshot's rows there must stay
    its own, so restoring all of it later answers as a cold prefill does."""
    long_prompt = [5 + (i * 17) % 290 for i in range(200)]
    cold, _ = make(tiny_pair)
    want = gen(cold, long_prompt).token_ids
    eng, _ = make(tiny_pair, cache_min_tokens=8, cache_min_fraction=0.0)
    gen(eng, long_prompt)
    gen(eng, B)  # the long state: a device snapshot of 4 pages
    short = gen(eng, long_prompt[:100] + [3])  # restores rows [0, 100), writes rows 100-112
    assert short.stats.cached_tokens == 100
    again = gen(eng, long_prompt)
    assert again.stats.cached_tokens == len(long_prompt) - 1 and again.token_ids == want


def test_a_device_snapshot_spilled_while_it_is_restored_is_still_restored(tiny_pair, caplog):
    """Restoring a device snapshot shares its pages cache by cache (target, then draft), and the
    page the restore copies may find the pool empty: the reclaim that starts then moves device
    snapshots, this one first (the least recently used), to the host tier, which gives their
    pages back. The restore holds the pages it shares, so the draft's cache still finds them
    and the snapshot serves the request (it was dropped, and the prompt prefilled)."""
    three_pages = [5 + (i * 13) % 300 for i in range(120)]  # with 12 generated: 131 rows
    cold, _ = make(tiny_pair)
    want = gen(cold, three_pages).token_ids
    eng, _ = make(tiny_pair, max_ctx=256, kv_pool_tokens=256, cache_min_tokens=8, cache_min_fraction=0.0)
    gen(eng, three_pages)
    gen(eng, B)  # the first rows: a device snapshot of 3 pages; B's live rows take the other 2
    assert [e.tier for e in eng.cache.entries] == ["device"]
    assert all(c.pool.free_pages == 0 for c in eng.state.kv_caches())
    with caplog.at_level("WARNING"):
        again = gen(eng, three_pages)
    assert "dropped" not in caplog.text
    assert again.stats.cached_tokens == len(three_pages) - 1 and again.token_ids == want
    assert_pages_accounted(eng)
