"""Saved KV states ("snapshots") keyed by their token ids, in three tiers: device -> host -> disk.

Agent clients resend a growing conversation every turn and interleave sub-agents. The live
sequence already serves the main conversation's next turn; snapshots keep the states a divergent
request would overwrite. A snapshot holds the target's and the draft's KV rows for the same
tokens, so restoring one leaves both caches in step. In the device tier it holds those rows'
KV pages (no copy: models/kv_views.py, HeldPages) and copies only a hybrid's recurrent states;
it copies the rows out when it moves to the host tier, which page pressure asks of the least
recently used first (`spill_pages`).

A snapshot in host memory carries a CRC-32 of its bytes, taken when it arrives there and checked
when it is restored or written to disk: host memory can be damaged too (a bad DIMM, a stray write through a
pinned buffer), and restored KV rows that are wrong give wrong answers with no error. One that
fails is dropped with a warning and the request is prefilled (disk files carry a sha256, checked
in disk_tier). A disk file must also hold exactly the tensors, dtypes and shapes the live state
would save for its tokens (`SequenceState.snapshot_mismatch`), checked before any of it is loaded:
a checksum signs whatever its writer had. One that does not is deleted like a damaged one.

This object owns data and metadata together: an entry *is* its tensors (or its file), so there is
no second bookkeeping that could go stale. Dropping an entry drops both at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import KVPagesExhausted
from ..models.kv_views import HeldPages, LiveRows
from . import faults
from .disk_tier import CacheFileError, DiskTier, fast_checksum
from .sequence import SequenceState, by_cache, common_prefix, state_points

log = logging.getLogger("flashtree.cache")
TIERS = ("device", "host", "disk")
# pinned host memory from malloc + cudaHostRegister on 8 threads, not one cudaHostAlloc call
PINNED_ALLOCATION = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def pin_in_threads() -> None:
    """Have torch pin the host tier's memory on 8 threads. Pinning is the cost of a snapshot that
    goes to host memory: for the 3.8 GB state of a 62K-token 27B hybrid, torch's default (one
    cudaHostAlloc) took 2.96-3.29 s, against 0.10 s for the copy and 0.14 s for the CRC-32;
    pinned this way it took 0.78-1.18 s (docs/CACHE.md). Pinned memory a snapshot frees is cached
    by torch and reused without pinning again. A PYTORCH_CUDA_ALLOC_CONF that sets pinned_*
    itself is left as it is."""
    if "pinned_" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9's name
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    try:
        setter(PINNED_ALLOCATION)
    except (RuntimeError, ValueError) as err:  # a torch that does not know the keys: its own pinning
        log.warning("pinned memory stays torch's default (%s): snapshots to host memory pin slower", err)


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    tier: str
    nbytes: int
    tensors: Optional[dict[str, torch.Tensor]] = None  # None while on disk only
    held: Optional[list[HeldPages]] = None  # in the device tier: the KV rows' pages; `tensors` the states
    path: Optional[Path] = None
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)
    points: Optional[tuple[int, ...]] = None  # lengths with recurrent states; None: any length
    crc: Optional[tuple[int, ...]] = None  # of the host copy's bytes, while in the host tier

    @property
    def device_nbytes(self) -> int:
        """What the entry takes of device memory outside the KV pages (the device tier's budget):
        its recurrent states where it holds pages, else all of it."""
        if self.held is not None:
            return sum(t.nbytes for t in (self.tensors or {}).values())
        return self.nbytes

    def release(self) -> None:
        """Give the KV pages back (the rows now live elsewhere, or nowhere)."""
        for pages in self.held or []:
            pages.release()
        self.held = None

    def usable(self, prompt: list[int]) -> int:
        """How much of `prompt` this entry can serve."""
        n = common_prefix(self.tokens, prompt)
        return n if self.points is None else max(p for p in self.points if p <= n)


class PrefixCache:
    def __init__(self, device: torch.device, slots: int, device_bytes: int, host_bytes: int,
                 cache_dir: Optional[str], disk_bytes: int, fingerprint: str):
        self.device = device
        self.slots = slots
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.disk = DiskTier(Path(cache_dir), fingerprint) if cache_dir else None
        self.entries: list[Snapshot] = []
        self.hits = {t: 0 for t in TIERS}
        if self.disk is not None:
            self._scan_disk()

    # ---- queries -------------------------------------------------------------------------
    def best(self, prompt: list[int]) -> tuple[Optional[Snapshot], int]:
        """The entry sharing the longest prefix with `prompt`, and that length."""
        best, best_len = None, 0
        for e in self.entries:
            n = e.usable(prompt)
            if n > best_len:
                best, best_len = e, n
        return best, best_len

    def stats(self) -> dict[str, dict[str, int]]:
        out = {t: {"entries": 0, "bytes": 0, "hits": self.hits[t]} for t in TIERS}
        for e in self.entries:
            out[e.tier]["entries"] += 1
            out[e.tier]["bytes"] += e.nbytes
        return out

    # ---- save / restore ------------------------------------------------------------------
    def save(self, state: SequenceState) -> None:
        """Snapshot the state's committed rows of every cache. In the device tier the KV rows
        stay in their pages, held by the entry (no copy; models/kv_views.py: HeldPages), and the
        recurrent states are copied; an entry whose states the tier cannot take goes to the
        host tier (or further) at once."""
        n = state.length
        key = tuple(state.tokens)
        for e in [e for e in self.entries if key[:len(e.tokens)] == e.tokens]:
            self._drop(e)  # its tokens are a prefix of the new entry's: it adds nothing
        if any(e.tokens[:n] == key for e in self.entries):
            return  # already covered by a longer entry
        faults.hit("snapshot_save")
        states = state.state_views(n)
        state_bytes = sum(v.nbytes for v in states.values())
        entry = Snapshot(key, "device", n * state.bytes_per_token() + state_bytes, points=state_points(list(states), n))
        self.entries.append(entry)
        try:
            if self.slots > 0 and state_bytes <= self.device_bytes:
                entry.tensors = {k: v.clone() for k, v in states.items()}
                entry.held = state.hold(n)
            else:  # the tier cannot take it: straight out of the live cache, with no device copy and
                entry.tensors = state.rows(n)  # no other entry evicted for it
                if not self._to_host(entry):
                    self._demote_to_disk(entry)
        except BaseException:
            if entry in self.entries:  # an entry never keeps views of the live cache
                self._drop(entry)
            raise
        self._enforce_budgets()

    def restore(self, entry: Snapshot, n: int, state: SequenceState) -> int:
        """Make the state hold the entry's first n tokens and rows (fewer, down to where the
        entry kept recurrent states, for a hybrid); returns how many. An entry that cannot be
        restored for any reason but an OOM is dropped, its file with it, and CacheFileError
        raised: the caller prefills."""
        faults.hit("snapshot_restore")
        try:
            tensors = entry.tensors if entry.tensors is not None else self._read(entry, state)
            restored = state.load(list(entry.tokens[:n]), tensors, entry.held)
        except CacheFileError:
            raise  # dropped by _read
        except Exception as err:
            # kept, it would fail every request sharing its prefix (a file: after every restart
            # too); an OOM, or no free KV page, is the memory's fault, not the entry's
            if faults.is_oom(err) or isinstance(err, KVPagesExhausted):
                raise
            state.truncate(0)  # a load that failed part-way leaves rows or states its tokens do not match
            self._drop(entry)
            raise CacheFileError(f"dropped a {entry.tier} snapshot of {len(entry.tokens)} tokens: restoring it "
                                 f"failed ({type(err).__name__}: {err}); prefilling instead") from err
        # a host copy is checked while its rows travel (copies from pinned memory are async): a
        # damaged one costs the rows just loaded, every one of which may be wrong
        if not self._intact(entry):
            state.truncate(0)
            self._drop(entry)
            raise CacheFileError(f"dropped a host-memory snapshot of {len(entry.tokens)} tokens: its bytes "
                                 "changed since it was saved there (checksum mismatch); prefilling instead")
        entry.hits += 1
        entry.last_used = time.monotonic()
        if entry.path is not None:  # the file's mtime carries its recency across restarts
            with contextlib.suppress(OSError):
                os.utime(entry.path)
        self.hits[entry.tier] += 1
        return restored

    # ---- eviction and clearing -----------------------------------------------------------
    def drop_device_tier(self, spill: bool = True) -> int:
        """After an OOM: no snapshot may stay in device memory. Entries move to the host tier
        where its budget allows (`spill`), otherwise they are dropped, data and metadata at once.
        Returns how many entries left the device."""
        device = [e for e in self.entries if e.tier == "device"]
        for e in device:
            if not (spill and self._to_host(e)):
                self._drop(e)
        self._enforce_budgets()
        return len(device)

    def clear_all(self) -> int:
        """Drop every entry of every tier, disk files included."""
        n = len(self.entries)
        for e in self.entries:
            self._forget(e)
        self.entries = []
        return n

    def spill_pages(self, enough: Callable[[], bool]) -> bool:
        """Move device entries, the least recently used first, to the host tier (or further
        down) until `enough()` says the KV pools have the pages they need: their pages go back
        to the pool. Whether enough() holds at the end."""
        for e in sorted((e for e in self.entries if e.held is not None), key=lambda e: e.last_used):
            if enough():
                return True
            if not self._to_host(e):  # which keeps the host tier to its budget
                self._demote_to_disk(e)
        return enough()

    def _forget(self, e: Snapshot) -> None:
        e.release()
        e.tensors = None
        if e.path is not None and self.disk is not None:
            self.disk.delete(e.path)

    def _drop(self, e: Snapshot) -> None:
        self.entries.remove(e)
        self._forget(e)

    def _enforce_budgets(self) -> None:
        def over(tier: str, limit: int, max_count: Optional[int]) -> Optional[Snapshot]:
            live = sorted((e for e in self.entries if e.tier == tier), key=lambda e: e.last_used)
            total = sum(e.device_nbytes if tier == "device" else e.nbytes for e in live)
            if live and (total > limit or (max_count is not None and len(live) > max_count)):
                return live[0]
            return None

        while (victim := over("device", self.device_bytes, self.slots)) is not None:
            if not self._to_host(victim):
                self._demote_to_disk(victim)
        while (victim := over("host", self.host_bytes, None)) is not None:
            self._demote_to_disk(victim)

    def _to_host(self, e: Snapshot) -> bool:
        """Move a device entry (or one still viewing the live cache) to host memory, the least
        recently used host entries going to disk first where the budget needs their room."""
        if e.nbytes > self.host_bytes:
            return False
        while sum(x.nbytes for x in self.entries if x.tier == "host") + e.nbytes > self.host_bytes:
            self._demote_to_disk(min((x for x in self.entries if x.tier == "host"), key=lambda x: x.last_used))
        pin = self.device.type == "cuda"  # pinned: one DMA each way, and restores need no staging
        try:
            e.tensors = {k: _host_copy(v, pin) for k, v in self._rows(e).items()}
            e.release()
        except Exception as err:  # host memory ran out too: the entry goes to disk or is dropped
            if not faults.is_oom(err):
                raise
            log.warning("no host memory for a %d-byte snapshot: %s", e.nbytes, err)
            return False
        e.tier, e.crc = "host", fast_checksum(e.tensors)
        return True

    @staticmethod
    def _rows(e: Snapshot) -> dict[str, "torch.Tensor | LiveRows"]:
        """Every tensor of an entry in memory: its own, and the rows of the pages it holds."""
        assert e.tensors is not None
        if e.held is None:
            return e.tensors
        return {**by_cache([pages.rows() for pages in e.held]), **e.tensors}

    @staticmethod
    def _intact(e: Snapshot) -> bool:
        """False for a host copy whose bytes changed since they were copied there."""
        return e.tier != "host" or e.tensors is None or fast_checksum(e.tensors) == e.crc

    def _demote_to_disk(self, e: Snapshot) -> None:
        if not self._intact(e):  # written out, its damage would get a valid checksum of its own
            log.warning("dropping a host-memory snapshot of %d tokens: its bytes changed since it was "
                        "saved there (checksum mismatch)", len(e.tokens))
            self._drop(e)
            return
        if self.disk is not None and e.nbytes <= self.disk_bytes:
            try:
                self._write(e)
            # an OSError (a full disk, a lock held too long), or no host memory to stage the write
            except Exception as err:
                if not isinstance(err, OSError) and not faults.is_oom(err):
                    raise
                log.warning("could not write snapshot to %s: %s", self.disk.dir, err)
            else:
                e.release()
                e.tensors, e.tier = None, "disk"
                self._trim_disk()
                return
        self._drop(e)

    # ---- disk tier (flashtree/runtime/disk_tier.py: files, lock, checksums) ---------------
    def _write(self, e: Snapshot) -> None:
        """The file's mtime is the entry's last use (wall clock): the recency that eviction goes
        by, in this process, in another sharing the directory, and after a restart."""
        assert self.disk is not None and e.tensors is not None
        staged = {k: _host_copy(v, pin=False) for k, v in self._rows(e).items()}
        written = self.disk.write(e.tokens, staged, time.time() - (time.monotonic() - e.last_used))
        e.path, e.nbytes = written.path, written.nbytes  # the file's size is what the budget counts

    def _scan_disk(self) -> None:
        assert self.disk is not None
        now, wall = time.monotonic(), time.time()
        for f in self.disk.scan():
            self.entries.append(Snapshot(f.tokens, "disk", f.nbytes, path=f.path,
                                         last_used=now - max(0.0, wall - f.mtime),
                                         points=state_points(f.names, len(f.tokens))))
        if self.entries:
            log.info("found %d cached states in %s", len(self.entries), self.disk.dir)
        self._trim_disk()  # a smaller --disk-cache-bytes than the last run's

    def _trim_disk(self) -> None:
        """The disk budget is the directory's, shared with any other server using it: the least
        recently used files go first, whoever wrote them. Entries whose files are gone (deleted
        here or by another process) go with them."""
        assert self.disk is not None
        gone = self.disk.trim(self.disk_bytes, [e.path for e in self.entries if e.path is not None])
        for e in [e for e in self.entries if e.path in gone]:
            e.path = None  # nothing left to delete
            self._drop(e)

    def _read(self, e: Snapshot, state: SequenceState) -> dict[str, torch.Tensor]:
        """A file that is gone, replaced, damaged or not of `state`'s layout (its tensors, dtypes
        and shapes for the entry's tokens) is a miss: CacheFileError, entry dropped."""
        assert self.disk is not None and e.path is not None
        try:
            return self.disk.read(e.path, e.tokens, self.device,
                                  lambda tensors: state.snapshot_mismatch(tensors, len(e.tokens)))
        except CacheFileError:
            e.path = None  # the disk tier deleted the file if it was damaged, and only then
            self._drop(e)
            raise


def _host_copy(v: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of snapshot rows [layers, n, heads, D], layer by layer: each layer's rows are
    contiguous even in a prefix view of the live cache, so no contiguous temporary is made on the
    device (as KVCache.load_rows, the other way)."""
    out = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
    for layer in range(v.shape[0]):
        out[layer].copy_(v[layer])
    return out
