"""Where the engine computes: the torch device it was asked for, and how many CPU threads torch
may use.

The device is checked before anything is loaded, so a machine without CUDA answers `--device
cuda` with one sentence instead of a traceback from deep inside a model load.

Threads: torch defaults to one OpenMP thread per core, and whenever other processes hold some of
those cores its threads wait on each other at every operator: on a 2-core machine with two busy
processes beside it, the embedded pair decodes at 4.8 tok/s with torch's two threads and 67 with
one. Where the cores are free, more threads do help (an idle 16-core host: 87 tok/s with 1
thread, 122 with 2, 178 with 4, 236 with 8). So the default is half the cores this process may
run on, at most 8, which leaves room for the server, the tokenizer and a neighbour (docs/SERVING.md, "CPU
threads", has the measurements); OMP_NUM_THREADS or `threads` overrides it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..errors import ConfigError

log = logging.getLogger("flashtree.engine")

MAX_DEFAULT_THREADS = 8  # beyond this even a 170M-parameter model decoded no faster (16 cores)


def pick_device(requested: Optional[str]) -> torch.device:
    """The device named by `--device` (default: cuda when available, else cpu), refused with a
    ConfigError when it does not exist here."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"unknown device {requested!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "a torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
            raise ConfigError(f"device {requested!r} asked for, but CUDA is not available ({built}); "
                              "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {requested!r} does not exist: {torch.cuda.device_count()} CUDA "
                              "device(s) visible")
    elif device.type != "cpu":
        raise ConfigError(f"device {requested!r} is not supported: use cpu, cuda or cuda:N")
    return device


def default_threads() -> int:
    """Half the cores this process may run on (its affinity mask), at least 1, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_DEFAULT_THREADS, max(1, cores // 2))


def set_threads(requested: Optional[int], device: torch.device) -> None:
    """Apply `threads` (EngineConfig): N sets torch's intra-op threads, 0 keeps torch's choice,
    None picks default_threads() for a CPU engine unless OMP_NUM_THREADS is set (a CUDA engine
    does little torch work on the CPU: torch's choice stays)."""
    if requested is None:
        requested = default_threads() if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS") else 0
    if requested > 0:
        torch.set_num_threads(requested)
    log.info("CPU threads: %d", torch.get_num_threads())


def check_kv_types(device: torch.device, *kv_types: Optional[str]) -> None:
    """Refuse an fp8 KV cache on a GPU older than Ada (compute capability 8.9): its kernels read
    float8 e4m3, which Triton compiles for sm_89 and later only (an RTX 3090 is sm_86)."""
    if device.type != "cuda" or "fp8" not in kv_types:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"--kv-type fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper); this one "
                          f"is {major}.{minor}: use q8_0 (34 bytes per 32 values against fp8's 32)")

