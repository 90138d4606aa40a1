"""Where the engine computes: the torch device it was asked for, and how many CPU threads torch
may use.

The device is checked before anything is loaded, so a machine without CUDA answers `--device
cuda` with one sentence instead of a traceback from deep inside a model load.

Threads: torch defaults to one OpenMP thread per core. For a small model every operator is too
short to split well, and whenever another process holds a core the threads spin-wait on each
other: the embedded 14M-parameter pair decodes at ~80 tok/s with one thread and ~45 with two on
an idle 2-core machine, and at 22 against 3.3 tok/s with two busy processes beside it
(README, "CPU threads"). So a small model on the CPU gets one thread unless OMP_NUM_THREADS or
`threads` says otherwise; a large one, whose matrix products do split well, keeps torch's choice.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..errors import ConfigError

log = logging.getLogger("flashtree.engine")

SMALL_MODEL_BYTES = 1 << 30  # weights below this run fastest on one CPU thread


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


def set_threads(requested: Optional[int], device: torch.device, model: torch.nn.Module) -> None:
    """Apply `threads` (EngineConfig) for an engine whose target is `model`: N sets torch's
    intra-op threads, 0 keeps torch's choice, None picks as the module docstring says."""
    if requested is None:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        small_on_cpu = device.type == "cpu" and weight_bytes < SMALL_MODEL_BYTES
        requested = 1 if small_on_cpu and not os.environ.get("OMP_NUM_THREADS") else 0
    if requested > 0:
        torch.set_num_threads(requested)
    log.info("CPU threads: %d", torch.get_num_threads())
