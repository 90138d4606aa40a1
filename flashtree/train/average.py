"""Average two checkpoints of one model, weight by weight (`flashtree train average`).

Why: two agent-stage rounds, the second continued from the first, each missed a different
client's held-out tasks (the first copied command outputs badly, the second the words in Codex's
shell quotes). The weights of a model and of its own continued fine-tune lie in one basin, and
their average keeps much of what each learnt (checkpoint averaging); it costs seconds on a CPU,
where another round costs minutes of GPU training. Only checkpoints with the same tensors, shapes
and dtypes are averaged; the config and tokenizer files are copied from the second.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def average_checkpoints(first: Path, second: Path, out: Path, weight: float = 0.5) -> dict[str, Any]:
    """Write `out` = (1 - weight) * first + weight * second for every tensor of every safetensors
    file (computed in float32, stored in the tensor's dtype). Refuses checkpoints that differ in
    their files, tensor names, shapes or dtypes, and an `out` that already exists."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new directory")
    files = sorted(p.name for p in second.glob("*.safetensors"))
    if not files or files != sorted(p.name for p in first.glob("*.safetensors")):
        raise ValueError(f"{first} and {second} do not hold the same safetensors files")
    mixed: dict[str, dict[str, torch.Tensor]] = {}
    for name in files:  # everything checked and mixed before anything is written
        a, b = load_file(first / name), load_file(second / name)
        if a.keys() != b.keys():
            raise ValueError(f"{name}: the two checkpoints hold different tensors")
        mixed[name] = {}
        for key, tb in b.items():
            ta = a[key]
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                raise ValueError(f"{name}: {key} is {tuple(ta.shape)} {ta.dtype} in one, {tuple(tb.shape)} {tb.dtype} "
                                 "in the other")
            mixed[name][key] = (ta.float() * (1 - weight) + tb.float() * weight).to(tb.dtype)
    shutil.copytree(second, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, tensors in mixed.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    return {"first": str(first), "second": str(second), "weight": weight, "out": str(out),
            "tensors": sum(len(t) for t in mixed.values())}
