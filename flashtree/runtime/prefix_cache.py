"""Saved KV states ("snapshots") keyed by their token ids, in three tiers: device -> host -> disk.

Agent clients resend a growing conversation every turn and interleave sub-agents. The live
sequence already serves the main conversation's next turn; snapshots keep the states a divergent
request would overwrite. A snapshot holds the target's and the draft's KV rows for the same
tokens, so restoring one leaves both caches in step.

This object owns data and metadata together: an entry *is* its tensors (or its file), so there is
no second bookkeeping that could go stale. Dropping an entry drops both at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import faults
from .sequence import SequenceState, common_prefix

log = logging.getLogger("flashtree.cache")
TIERS = ("device", "host", "disk")
FORMAT = "flashtree-kv-1"


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    tier: str
    nbytes: int
    tensors: Optional[dict[str, torch.Tensor]] = None  # None while on disk only
    path: Optional[Path] = None
    hits: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.tokens).encode()).hexdigest()[:32]


class PrefixCache:
    def __init__(self, device: torch.device, slots: int, device_bytes: int, host_bytes: int,
                 cache_dir: Optional[str], disk_bytes: int, fingerprint: str):
        self.device = device
        self.slots = slots
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.dir = Path(cache_dir) if cache_dir else None
        self.fingerprint = fingerprint
        self.entries: list[Snapshot] = []
        self.hits = {t: 0 for t in TIERS}
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan_disk()

    # ---- queries -------------------------------------------------------------------------
    def best(self, prompt: list[int]) -> tuple[Optional[Snapshot], int]:
        """The entry sharing the longest prefix with `prompt`, and that length."""
        best, best_len = None, 0
        for e in self.entries:
            n = common_prefix(e.tokens, prompt)
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
        """Snapshot the state's committed rows of every cache (a device copy)."""
        n = state.length
        key = tuple(state.tokens)
        for e in [e for e in self.entries if key[:len(e.tokens)] == e.tokens]:
            self._drop(e)  # its tokens are a prefix of the new entry's: it adds nothing
        if any(e.tokens[:n] == key for e in self.entries):
            return  # already covered by a longer entry
        faults.hit("snapshot_save")
        views = state.rows(n)
        entry = Snapshot(key, "device", sum(v.numel() * v.element_size() for v in views.values()), views)
        self.entries.append(entry)
        try:
            if self.slots > 0 and entry.nbytes <= self.device_bytes:
                entry.tensors = {k: v.clone() for k, v in views.items()}
            elif not self._to_host(entry):  # too big for the device tier: straight out of the live
                self._demote_to_disk(entry)  # cache, no device copy, and no other entry evicted for it
        except BaseException:
            if entry in self.entries:  # an entry never keeps views of the live cache
                self._drop(entry)
            raise
        self._enforce_budgets()

    def restore(self, entry: Snapshot, n: int, state: SequenceState) -> None:
        """Make the state hold the entry's first n tokens and rows."""
        faults.hit("snapshot_restore")
        tensors = entry.tensors if entry.tensors is not None else self._read(entry)
        state.load(list(entry.tokens[:n]), tensors)
        entry.hits += 1
        entry.last_used = time.monotonic()
        if entry.path is not None:  # the file's mtime carries its recency across restarts
            with contextlib.suppress(OSError):
                os.utime(entry.path)
        self.hits[entry.tier] += 1

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

    def _forget(self, e: Snapshot) -> None:
        e.tensors = None
        if e.path is not None:
            e.path.unlink(missing_ok=True)

    def _drop(self, e: Snapshot) -> None:
        self.entries.remove(e)
        self._forget(e)

    def _enforce_budgets(self) -> None:
        def over(tier: str, limit: int, max_count: Optional[int]) -> Optional[Snapshot]:
            live = sorted((e for e in self.entries if e.tier == tier), key=lambda e: e.last_used)
            total = sum(e.nbytes for e in live)
            if live and (total > limit or (max_count is not None and len(live) > max_count)):
                return live[0]
            return None

        while (victim := over("device", self.device_bytes, self.slots)) is not None:
            if not self._to_host(victim):
                self._demote_to_disk(victim)
        while (victim := over("host", self.host_bytes, None)) is not None:
            self._demote_to_disk(victim)
        while (victim := over("disk", self.disk_bytes, None)) is not None:
            self._drop(victim)  # the file goes with it

    def _to_host(self, e: Snapshot) -> bool:
        used = sum(x.nbytes for x in self.entries if x.tier == "host")
        if used + e.nbytes > self.host_bytes:
            return False
        pin = self.device.type == "cuda"  # pinned: one DMA each way, and restores need no staging
        try:
            e.tensors = {k: _host_copy(v, pin) for k, v in e.tensors.items()}
        except Exception as err:  # host memory ran out too: the entry goes to disk or is dropped
            if not faults.is_oom(err):
                raise
            log.warning("no host memory for a %d-byte snapshot: %s", e.nbytes, err)
            return False
        e.tier = "host"
        return True

    def _demote_to_disk(self, e: Snapshot) -> None:
        if self.dir is not None and e.nbytes <= self.disk_bytes:
            try:
                self._write(e)
                e.tensors, e.tier = None, "disk"
                return
            except Exception as err:  # full disk (SafetensorError), or no host memory to stage it
                if not isinstance(err, (OSError, SafetensorError)) and not faults.is_oom(err):
                    raise
                log.warning("could not write snapshot to %s: %s", self.dir, err)
        self._drop(e)

    # ---- disk tier -----------------------------------------------------------------------
    def _write(self, e: Snapshot) -> None:
        """Atomic: write a temporary file, then rename it over the final name."""
        path = self.dir / f"{e.key}.safetensors"
        tmp = path.with_suffix(".tmp")
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "tokens": json.dumps(list(e.tokens))}
        try:
            save_file({k: _host_copy(v, pin=False) for k, v in e.tensors.items()}, str(tmp), metadata=meta)
            os.replace(tmp, path)
            e.nbytes = path.stat().st_size  # what the disk budget counts
        except BaseException:
            tmp.unlink(missing_ok=True)  # a partial file must not fill the disk further
            raise
        e.path = path

    def _scan_disk(self) -> None:
        for path in sorted(self.dir.glob("*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("fingerprint") != self.fingerprint:
                    log.warning("skipping cache file %s: made for another model or KV format", path.name)
                    continue
                tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            except (OSError, SafetensorError, ValueError, KeyError, TypeError) as err:
                log.warning("skipping unreadable cache file %s: %s", path.name, err)
                continue
            stat = path.stat()
            age = max(0.0, time.time() - stat.st_mtime)
            self.entries.append(Snapshot(tokens, "disk", stat.st_size, path=path,
                                         last_used=time.monotonic() - age))
        if self.entries:
            log.info("found %d cached states in %s", len(self.entries), self.dir)
            self._enforce_budgets()  # a smaller --disk-cache-bytes than the last run's

    def _read(self, e: Snapshot) -> dict[str, torch.Tensor]:
        try:
            with safe_open(str(e.path), framework="pt", device=str(self.device)) as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError) as err:
            self._drop(e)
            raise CacheFileError(f"cache file {e.path} is unreadable: {err}") from None
        if tensors["tk"].shape[1] != len(e.tokens):
            self._drop(e)
            raise CacheFileError(f"cache file {e.path} holds {tensors['tk'].shape[1]} rows for "
                                 f"{len(e.tokens)} tokens")
        return tensors


def _host_copy(v: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of snapshot rows [layers, n, heads, D], layer by layer: each layer's rows are
    contiguous even in a prefix view of the live cache, so no contiguous temporary is made on the
    device (as KVCache.load_rows, the other way)."""
    out = torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
    for layer in range(v.shape[0]):
        out[layer].copy_(v[layer])
    return out


class CacheFileError(Exception):
    """A disk snapshot that cannot be used; the entry has been dropped, prefill instead."""
