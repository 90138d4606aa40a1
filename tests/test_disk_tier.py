"""The disk tier's files on their own: any tensor names and shapes, checksums and finite values
checked on read, unique temporaries that eviction never touches, and several processes writing,
trimming and reading one directory at once."""

import multiprocessing
import os
import time

import pytest
import torch
from filelock import FileLock
from safetensors import safe_open

from flashtree.runtime import disk_tier
from flashtree.runtime.disk_tier import LOCK_NAME, STALE_TMP_S, CacheFileError, DiskTier

CPU = torch.device("cpu")


def state(tokens, rows=64):
    """A snapshot-like dict whose contents follow from its tokens, with names and shapes that
    are not a KV cache's: two writers of the same tokens write the same bytes."""
    g = torch.Generator().manual_seed(sum(tokens) * 1000 + len(tokens))
    return {"layers.0.ssm_state": torch.randn(2, rows, 3, 8, generator=g).to(torch.bfloat16),
            "conv": torch.randn(rows, 5, generator=g),
            "positions": torch.arange(rows, dtype=torch.int64),
            "empty": torch.zeros(0, 4)}


def same(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_any_named_tensors_round_trip_and_are_found_after_a_restart(tmp_path):
    tokens = (3, 1, 4, 1, 5)
    written = DiskTier(tmp_path, "model-a").write(tokens, state(tokens), time.time() - 60)
    assert abs(written.path.stat().st_mtime - (time.time() - 60)) < 5  # its last use, not now
    [found] = DiskTier(tmp_path, "model-a").scan()
    assert (found.tokens, found.path, found.nbytes) == (tokens, written.path, written.path.stat().st_size)
    assert same(DiskTier(tmp_path, "model-a").read(found.path, tokens, CPU), state(tokens))
    other = DiskTier(tmp_path, "model-b")
    assert other.path_for(tokens) != written.path and other.scan() == []  # another model's file


def overwrite_tensor_bytes(path):
    """Copy the second quarter of the tensor bytes over the first, in place, header untouched:
    finite values of the right dtypes, in the wrong places; only a checksum can tell."""
    with open(path, "r+b") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(start)
        data = f.read()
        quarter = len(data) // 4 // 64 * 64
        f.seek(start)
        f.write(data[quarter:2 * quarter])


def nan_state(tokens):
    bad = state(tokens)
    bad["conv"][7, 2] = float("nan")
    return bad


@pytest.mark.parametrize("damage", ["overwritten bytes", "nan written", "truncated"])
def test_a_damaged_file_is_deleted_with_a_warning_and_is_a_cache_file_error(tmp_path, caplog, damage):
    tokens = (2, 7, 1, 8)
    tier = DiskTier(tmp_path, "model-a")
    path = tier.write(tokens, nan_state(tokens) if damage == "nan written" else state(tokens), time.time()).path
    [found] = DiskTier(tmp_path, "model-a").scan()
    if damage == "overwritten bytes":
        overwrite_tensor_bytes(path)
        with safe_open(str(path), framework="pt") as f:
            assert all(torch.isfinite(f.get_tensor(k)).all() for k in f.keys())
    elif damage == "truncated":  # after the scan: at a scan, safetensors refuses it by its header
        os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CacheFileError, match={"overwritten bytes": "checksum", "nan written": "non-finite",
                                              "truncated": "unreadable"}[damage]):
        tier.read(found.path, tokens, CPU)
    assert not path.exists() and f"deleting cache file {path}" in caplog.text


def test_a_file_deleted_after_the_scan_is_a_miss_and_a_replaced_one_is_read(tmp_path):
    tokens = (9, 9, 9)
    writer, reader = DiskTier(tmp_path, "m"), DiskTier(tmp_path, "m")
    path = writer.write(tokens, state(tokens), time.time()).path
    [found] = reader.scan()
    writer.write(tokens, state(tokens), time.time())  # another process replaces it: same tokens
    assert same(reader.read(found.path, tokens, CPU), state(tokens))
    writer.delete(path)
    with pytest.raises(CacheFileError, match="deleted"):
        reader.read(found.path, tokens, CPU)


def test_a_file_deleted_while_it_is_opened_is_a_miss(tmp_path, monkeypatch):
    """Another process's trim can delete a file while safetensors opens it: its header read, then
    torch maps the file by name and fails with a RuntimeError ("unable to open file ... No such
    file or directory"; the stress test below met it). Injected here: a miss, not a crash, and
    nothing else is deleted."""
    tier = DiskTier(tmp_path, "m")
    path = tier.write((4,), state((4,)), time.time()).path
    other = tier.write((5,), state((5,)), time.time()).path

    def open_racing_a_deletion(name, **kw):
        os.unlink(name)
        raise RuntimeError(f"unable to open file <{name}> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(disk_tier, "safe_open", open_racing_a_deletion)
    with pytest.raises(CacheFileError, match="was deleted"):
        tier.read(path, (4,), CPU)
    assert other.exists()


def test_trim_keeps_the_directory_budget_by_mtime_and_never_touches_temporaries(tmp_path):
    a, b = DiskTier(tmp_path, "m"), DiskTier(tmp_path, "other model")  # two servers, one directory
    now = time.time()
    old = a.write((1,), state((1,)), now - 300).path
    mid = b.write((2,), state((2,)), now - 200).path
    new = a.write((3,), state((3,)), now - 100).path
    writing = tmp_path / "0123.4242.feed.tmp"  # another process's write in progress, bigger than all
    writing.write_bytes(b"\0" * 4 * old.stat().st_size)
    dead = tmp_path / "4567.4343.beef.tmp"  # a writer that died long ago
    dead.write_bytes(b"\0" * 100)
    os.utime(dead, (now - 2 * STALE_TMP_S, now - 2 * STALE_TMP_S))
    budget = new.stat().st_size + mid.stat().st_size
    assert a.trim(budget, [old, new]) == {old}  # the least recently used, whoever wrote it
    assert a.trim(new.stat().st_size, [old, new]) == {old}  # mid goes, b's; a knew only old
    assert not mid.exists() and new.exists() and writing.exists() and dead.exists()
    assert [f.path for f in a.scan()] == [new] and not dead.exists() and writing.exists()


def hammer(directory, worker, rounds):
    """One process of the stress test: write, trim, read, over prompts the others write too.
    A failure is an exception: its traceback goes to stderr and the exit code is 1."""
    tier = DiskTier(directory, "m")
    size = tier.write((0,), state((0,)), time.time()).nbytes
    for i in range(rounds):
        tokens = ((i * 7 + worker) % 5 + 1,)
        path = tier.write(tokens, state(tokens), time.time()).path
        tier.trim(3 * size, [path])  # room for 3 of the 6 files: the others' deletions race ours
        try:
            assert same(tier.read(path, tokens, CPU), state(tokens))
        except CacheFileError as e:
            assert "was deleted" in str(e), e  # a miss, never a damaged or foreign file


@pytest.mark.slow  # a multi-process stress run; the fast suite keeps the injected races above
def test_processes_sharing_a_directory_neither_fail_nor_corrupt_it(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe once torch has started threads
    procs = [ctx.Process(target=hammer, args=(tmp_path, w, 40)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    tier = DiskTier(tmp_path, "m")
    found = tier.scan()
    names = {p.name for p in tmp_path.iterdir()} - {LOCK_NAME}
    assert names == {f.path.name for f in found} and 0 < len(found) <= 3  # no temporaries left
    for f in found:
        assert same(tier.read(f.path, f.tokens, CPU), state(f.tokens))


def test_a_lock_held_too_long_by_another_process_costs_the_cache_not_the_caller(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_tier, "LOCK_TIMEOUT_S", 0.2)
    tier = DiskTier(tmp_path, "m")
    kept = tier.write((1,), state((1,)), time.time()).path
    with FileLock(str(tmp_path / LOCK_NAME)):  # another holder (a hung server, say)
        with pytest.raises(OSError):
            tier.write((2,), state((2,)), time.time())  # the caller drops the snapshot
        assert tier.scan() == [] and tier.trim(0, [kept]) == set()
        tier.delete(kept)
    assert kept.exists() and sorted(p.name for p in tmp_path.glob("*.tmp")) == []
    assert "could not scan" in caplog.text and "could not trim" in caplog.text
    assert "could not delete" in caplog.text
