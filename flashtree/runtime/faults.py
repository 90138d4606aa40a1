"""Deterministic fault injection, so every OOM and crash path is testable on a CPU.

FLASHTREE_FAULTS="site:kind:nth,..." with site in SITES, kind `oom` (raise torch.OutOfMemoryError)
or `crash` (the process dies by SIGKILL, as a CUDA fault or the kernel's OOM killer would kill it),
nth the 1-based visit of that site since the process started, or `*` for every visit. Unset, a
visit is one dict lookup that finds nothing.

The module imports no torch (it imports it where an error is raised or classified, by which time
torch is loaded), so the CLI can read the plan, and refuse a bad one, before any command runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator, Optional

from ..errors import ConfigError, EngineOutOfMemory

SITES = ("prefill", "snapshot_save", "snapshot_restore", "draft", "verify", "sample")
KINDS = ("oom", "crash")

_plan: dict[str, list[tuple[str, Optional[int]]]] = {}
_visits: dict[str, int] = {}


def parse(spec: str) -> dict[str, list[tuple[str, Optional[int]]]]:
    plan: dict[str, list[tuple[str, Optional[int]]]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in SITES or parts[1] not in KINDS:
            raise ConfigError(f"bad FLASHTREE_FAULTS item {item!r}: expected site:kind:nth with site in "
                              f"{', '.join(SITES)}, kind in {', '.join(KINDS)}, nth a number or *")
        nth: Optional[int] = None
        if parts[2] != "*":
            if not parts[2].isdigit() or int(parts[2]) < 1:
                raise ConfigError(f"bad FLASHTREE_FAULTS item {item!r}: nth must be >= 1 or *")
            nth = int(parts[2])
        plan.setdefault(parts[0], []).append((parts[1], nth))
    return plan


def configure(spec: Optional[str] = None) -> None:
    """(Re)read the plan, from `spec` or the environment, and reset the visit counters."""
    global _plan
    _plan = parse(spec if spec is not None else os.environ.get("FLASHTREE_FAULTS", ""))
    _visits.clear()


def hit(site: str) -> None:
    """Mark a visit of `site`; raise or die if the plan says so."""
    if not _plan:
        return
    faults = _plan.get(site)
    if not faults:
        return
    count = _visits[site] = _visits.get(site, 0) + 1
    for kind, nth in faults:
        if nth is None or nth == count:
            if kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            import torch
            raise torch.OutOfMemoryError(f"injected out-of-memory fault at {site} (visit {count})")


def is_oom(exc: BaseException) -> bool:
    """CUDA OOM, or the CPU allocator's failure (a RuntimeError, not an OutOfMemoryError)."""
    import torch
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower())


@contextlib.contextmanager
def site(name: str, inject: bool = True) -> Iterator[None]:
    """Run a block as the out-of-memory site `name`: an injected fault fires on entry (unless
    `inject` is off: a second block of the same visit), and an
    out-of-memory inside leaves as EngineOutOfMemory(name), so the site travels with the error
    instead of through a variable someone has to set and read. The original exception (and the
    tensors its frames hold) is released before the new one leaves."""
    failed = False
    try:
        if inject:
            hit(name)
        yield
    except Exception as e:
        if not is_oom(e):
            raise
        failed = True
    if failed:
        raise EngineOutOfMemory(name)


configure()
