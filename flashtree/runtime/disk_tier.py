"""Snapshot files on disk: the prefix cache's last tier, one safetensors file per snapshot.

A cache directory outlives the process and may be shared by several servers, so every file is
written, found, read and deleted as if another process were doing the same at any moment:

- directory mutations (the rename that publishes a file, deletions, the scan at start-up) take
  one lock file, `.lock` in the directory (`filelock`: an OS lock, released if the holder dies);
- a file is written under a temporary name of its own, `{name}.{pid}.{uuid}.tmp`, and renamed
  over its final name: readers see a whole file or none, and two writers never share a
  temporary. Only finished files are ever counted or evicted; a temporary is deleted only when
  nobody has written to it for an hour (its writer died);
- a file that another process deleted or replaced since this one found it is a miss;
- every file carries a checksum of its metadata and tensor bytes, checked on every read, and
  its tensors must be finite: the bytes under an intact header can still be wrong (a torn
  write, a bad disk, a stray writer), and restoring them would give wrong answers on every
  retry. A file that fails is deleted.

Tensors are a flat `dict[str, torch.Tensor]` with any names, dtypes and shapes: this module
knows nothing of what a snapshot holds, only its tokens and the owner's fingerprint (weights,
dtype, state layout), which both go into the file's name and metadata. A checksum proves only
that the bytes are the ones their writer signed, so a reader passes a check of the tensors'
names, dtypes and shapes against its own layout: a file that fails it is deleted like a damaged
one, before any of its tensors leaves the host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger("flashtree.cache")

FORMAT = "flashtree-kv-2"  # 2: metadata "checksum"; a file of format 1 has none and is skipped
SUFFIX = ".safetensors"
LOCK_NAME = ".lock"
LOCK_TIMEOUT_S = 30.0  # the lock is held for renames, deletions and header reads: never long
STALE_TMP_S = 3600.0  # a temporary nobody wrote to for this long belongs to a dead writer
HASH_CHUNK = 16 << 20  # bytes per hashed piece: the pieces are hashed in parallel
T = TypeVar("T")


class CacheFileError(Exception):
    """A snapshot that cannot be used (a disk file, or a host-memory copy that fails its
    checksum); the entry has been dropped, prefill instead."""


@dataclass(frozen=True)
class SnapshotFile:
    tokens: tuple[int, ...]
    path: Path
    nbytes: int  # the file's size: what the disk budget counts
    mtime: float  # wall-clock time of its last use
    names: tuple[str, ...] = ()  # its tensors' names


class DiskTier:
    """The snapshot files of one cache directory that belong to one model (its fingerprint)."""

    def __init__(self, directory: Path, fingerprint: str):
        self.dir = directory
        self.fingerprint = fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.dir / LOCK_NAME), timeout=LOCK_TIMEOUT_S)

    def path_for(self, tokens: tuple[int, ...]) -> Path:
        """The name covers the fingerprint too: two models' servers sharing the directory never
        write the same file for the same prompt."""
        key = hashlib.sha256(json.dumps([self.fingerprint, list(tokens)]).encode()).hexdigest()[:32]
        return self.dir / f"{key}{SUFFIX}"

    # ---- start-up ------------------------------------------------------------------------
    def scan(self) -> list[SnapshotFile]:
        """This model's usable files, from their headers only (the bytes are checked on read).
        Files of other models, of another format or unreadable are skipped with a warning."""
        found = []
        try:
            with self.lock:
                self._remove_dead_temporaries()
                for path in sorted(self.dir.glob(f"*{SUFFIX}")):
                    if (snapshot := self._header(path)) is not None:
                        found.append(snapshot)
        except OSError as err:  # filelock.Timeout is one: held for LOCK_TIMEOUT_S by another process
            log.warning("could not scan %s (%s): starting without its cached states", self.dir, err)
        return found

    def _header(self, path: Path) -> Optional[SnapshotFile]:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                names = tuple(f.keys())
            stat = path.stat()
            if meta.get("format") != FORMAT:
                why = ("written without checksums by an older flashtree" if meta.get("format") == "flashtree-kv-1"
                       else f"format {meta.get('format')!r}, not {FORMAT!r}")
                log.warning("skipping cache file %s: %s", path.name, why)
                return None
            if meta.get("fingerprint") != self.fingerprint:
                log.warning("skipping cache file %s: made for another model or KV format", path.name)
                return None
            tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            if "checksum" not in meta:
                raise KeyError("checksum")
        except FileNotFoundError:
            return None  # deleted by a process that does not take the lock: nothing to skip
        except (OSError, SafetensorError, ValueError, KeyError, TypeError) as err:
            log.warning("skipping unreadable cache file %s: %s", path.name, err)
            return None
        return SnapshotFile(tokens, path, stat.st_size, stat.st_mtime, names)

    def _remove_dead_temporaries(self) -> None:
        now = time.time()
        for tmp in self.dir.glob("*.tmp"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
                    log.info("removed %s, left by a writer that did not finish", tmp.name)
            except FileNotFoundError:
                pass  # its writer finished (renamed it) or gave up (deleted it) meanwhile

    # ---- write, read, delete -------------------------------------------------------------
    def write(self, tokens: tuple[int, ...], tensors: dict[str, torch.Tensor], last_used: float) -> SnapshotFile:
        """Write host tensors as the file for `tokens`, replacing any file of the same tokens;
        `last_used` (wall clock) becomes its mtime, the recency eviction goes by. Any failure is
        an OSError (a full disk included), and leaves no file behind."""
        path = self.path_for(tokens)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "tokens": json.dumps(list(tokens))}
        meta["checksum"] = checksum(meta, tensors)
        try:
            try:
                save_file(tensors, str(tmp), metadata=meta)
            except SafetensorError as err:  # how safetensors reports a failed write (ENOSPC, EFBIG)
                raise OSError(f"writing {tmp.name} failed: {err}") from err
            with self.lock:
                os.replace(tmp, path)
                os.utime(path, (last_used, last_used))
                return SnapshotFile(tokens, path, path.stat().st_size, last_used)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a partial file must not fill the disk further
            raise

    def read(self, path: Path, tokens: tuple[int, ...], device: torch.device,
             check: Optional[Callable[[dict[str, torch.Tensor]], Optional[str]]] = None) -> dict[str, torch.Tensor]:
        """The tensors of the file for `tokens`, on `device`, checked: the checksum, then
        `check` (what is wrong with the tensors for the caller's layout, None if nothing), then
        finite values. Raises CacheFileError if the file is gone or now holds something else (a
        miss), or is damaged or does not fit the layout (then it is deleted, with a warning)."""
        inode: Optional[int] = None
        try:
            inode = path.stat().st_ino
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError, RuntimeError) as err:
            # deleted before its stat (FileNotFoundError) or while safetensors opened it (torch's
            # RuntimeError "unable to open file" when it maps the file by name)
            if isinstance(err, FileNotFoundError) or (inode is not None and self._gone(path, inode)):
                raise CacheFileError(f"cache file {path.name} was deleted (by another process sharing "
                                     f"{self.dir}?)") from None
            if inode is None:  # not even its status could be read: not ours to delete
                raise CacheFileError(f"cache file {path} is inaccessible: {err}") from None
            self._discard(path, inode, f"unreadable: {err}")
            raise CacheFileError(f"cache file {path} is unreadable: {err}") from None
        if (meta.get("format"), meta.get("fingerprint"), meta.get("tokens")) != (
                FORMAT, self.fingerprint, json.dumps(list(tokens))):
            raise CacheFileError(f"cache file {path.name} was replaced by one for other tokens or "
                                 "another model")
        expected = meta.pop("checksum", None)
        if checksum(meta, tensors) != expected:
            self._discard(path, inode, "its checksum does not match its contents")
            raise CacheFileError(f"cache file {path} is corrupt (checksum mismatch)")
        if check is not None and (why := check(tensors)) is not None:
            self._discard(path, inode, f"its tensors do not fit this model's state layout: {why}")
            raise CacheFileError(f"cache file {path} does not fit this model's state layout ({why})")
        tensors = {k: t.to(device) for k, t in tensors.items()}
        if bad := [k for k, t in tensors.items() if not all_finite(t)]:
            self._discard(path, inode, f"non-finite values in {', '.join(bad)}")
            raise CacheFileError(f"cache file {path} holds non-finite values")
        return tensors

    def delete(self, path: Path) -> None:
        """Delete a file this process no longer wants; a failure leaves it to the LRU trim."""
        try:
            with self.lock:
                path.unlink(missing_ok=True)
        except OSError as err:  # the lock timed out (filelock.Timeout is one), or a permission
            log.warning("could not delete cache file %s: %s", path.name, err)

    @staticmethod
    def _gone(path: Path, inode: int) -> bool:
        """Whether the file read as `inode` has since been deleted (or replaced by another)."""
        try:
            return path.stat().st_ino != inode
        except FileNotFoundError:
            return True

    def _discard(self, path: Path, inode: int, why: str) -> None:
        """Delete a damaged file, unless another process has replaced it since it was read."""
        log.warning("deleting cache file %s: %s", path, why)
        try:
            with self.lock:
                if not self._gone(path, inode):
                    path.unlink()
        except OSError:
            pass  # gone or replaced already, or the lock timed out: the next read checks again

    # ---- budget --------------------------------------------------------------------------
    def trim(self, budget: int, known: Iterable[Path]) -> set[Path]:
        """Keep the directory's finished files (any model's: the budget is the directory's) within
        `budget` bytes, deleting the least recently used first (mtime). Returns those of the
        `known` files that no longer exist, deleted here or by another process."""
        try:
            with self.lock:
                files = []
                for path in self.dir.glob(f"*{SUFFIX}"):
                    try:
                        stat = path.stat()
                    except FileNotFoundError:
                        continue
                    files.append((stat.st_mtime, stat.st_size, path))
                total = sum(size for _, size, _ in files)
                present = {path for _, _, path in files}
                for _, size, path in sorted(files):
                    if total <= budget:
                        break
                    path.unlink(missing_ok=True)
                    present.discard(path)
                    total -= size
        except OSError as err:  # a lock timeout, or a file this process may not delete
            log.warning("could not trim %s (%s): its budget is enforced at the next write", self.dir, err)
            return set()
        return set(known) - present


def checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the metadata, each tensor's name, dtype and shape, and its raw bytes (host
    tensors). The bytes are hashed in fixed pieces on a thread pool (hashlib releases the GIL),
    the pieces' digests then hashed in order: the result does not depend on the thread count."""
    items = sorted(tensors.items())
    head = hashlib.sha256(json.dumps([sorted(meta.items()), [(k, str(t.dtype), list(t.shape))
                                                            for k, t in items]]).encode())
    for digest in _piece_digests(items, lambda piece: hashlib.sha256(piece).digest()):
        head.update(digest)
    return "sha256:" + head.hexdigest()


def fast_checksum(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """CRC-32 of each fixed piece of the tensors' raw bytes (host tensors), in name order: what a
    host-memory snapshot is checked with. It guards against damage, not against an adversary,
    and is several times faster than sha256 (zlib releases the GIL, so pieces run in parallel)."""
    return tuple(_piece_digests(sorted(tensors.items()), zlib.crc32))


def _piece_digests(items: list[tuple[str, torch.Tensor]], digest: Callable[[Any], T]) -> list[T]:
    """`digest` of each HASH_CHUNK-byte piece of the tensors' bytes, in order, on a thread pool."""
    raw = [t.detach().reshape(-1).view(torch.uint8).numpy() for _, t in items]
    pieces = [b[i:i + HASH_CHUNK] for b in raw for i in range(0, len(b), HASH_CHUNK)]
    if len(pieces) <= 1:
        return [digest(piece) for piece in pieces]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(digest, pieces))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf: min and max propagate NaN, and an Inf is one of them (one pass, on the
    tensor's own device; several times faster on the CPU than isfinite().all())."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
