"""The optimisation loop both trainers share: AdamW, warmup + cosine schedule, autocast, gradient
clipping, a progress bar, periodic checkpoints and resume.

Batches are a pure function of the step number (the trainer's `loss_at(step)` draws them), so a
resumed run sees exactly the batches the interrupted one would have seen. A wall-clock budget can
set the step count from the measured speed (re-planned a few times early in the run): the final
count is stored in the checkpoint and the summary, so the same run can be repeated with
`--steps N` on any machine.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

# with a time budget, the step count is re-planned at these steps, and every _REPLAN_EVERY steps
# after them, from the speed since the last one: early steps pay for kernel selection and
# allocation (one per new batch shape), so early estimates are pessimistic (a run planned only
# from its first 300 steps used 62% of its budget) and later ones correct them
_REPLAN_AT = (10, 30, 100, 300)
_REPLAN_EVERY = 500


def _replan_due(step: int) -> bool:
    return step == 2 or step in _REPLAN_AT or (step > _REPLAN_AT[-1] and step % _REPLAN_EVERY == 0)


@dataclass
class LoopConfig:
    """Knobs of one optimisation run."""

    steps: int = 1000
    time_budget: Optional[float] = None  # seconds; when set, caps `steps` by the measured speed
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 500
    log_every: int = 10


@lru_cache(maxsize=2)
def _permutation(n_items: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def batch_indices(n_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Item indices of `step`'s batch: epochs of seeded shuffles, the ragged tail dropped."""
    per_epoch = max(1, n_items // batch_size)
    epoch, i = divmod(step, per_epoch)
    return _permutation(n_items, seed, epoch)[i * batch_size:(i + 1) * batch_size]


def lr_at(step: int, total: int, cfg: LoopConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio at `total`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; plain float32 elsewhere (CPU runs are smoke tests and tests)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_loop(params: list[torch.nn.Parameter], loss_at: Callable[[int], tuple[torch.Tensor, dict]],
               cfg: LoopConfig, ckpt_path: Path, modules: dict[str, torch.nn.Module],
               device: torch.device, desc: str = "train") -> dict[str, Any]:
    """Run the optimisation and return a summary (steps, losses, seconds).

    `loss_at(step)` returns the loss to minimise and a dict of scalars (floats or tensors, read
    only at log steps so the device is not synchronised every step) to log. `modules` are saved
    in the checkpoint by name and restored from it on resume.
    """
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    start, total, history = 0, cfg.steps, []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        for name, module in modules.items():
            module.load_state_dict(state["modules"][name])
        opt.load_state_dict(state["optimizer"])
        start, total, history = state["step"], state["total"], state["history"]
        tqdm.write(f"{desc}: resumed from {ckpt_path} at step {start}/{total}", file=sys.stderr)

    def save(step: int) -> None:
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"modules": {n: m.state_dict() for n, m in modules.items()}, "optimizer": opt.state_dict(),
                    "step": step, "total": total, "history": history, "config": asdict(cfg)}, tmp)
        tmp.replace(ckpt_path)

    mark: Optional[tuple[int, float]] = None  # (step, time) where the speed is measured from
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, mininterval=2.0)
    step = start
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        with autocast_for(device):
            loss, logs = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == total:
            entry = {"step": step, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                     **{k: float(v) for k, v in logs.items()}}
            history.append(entry)
            bar.set_postfix({k: round(v, 4) for k, v in entry.items() if k != "step"})
        if cfg.time_budget is not None and start == 0 and _replan_due(step):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if mark is not None:  # the rate since the last mark predicts the rest of the run
                per_step = (now - mark[1]) / (step - mark[0])
                total = max(step, min(cfg.steps, step + int((cfg.time_budget - (now - t0)) / per_step)))
                bar.total = total
                tqdm.write(f"{desc}: {per_step * 1000:.1f} ms/step -> {total} steps in {cfg.time_budget:.0f}s",
                           file=sys.stderr)
            mark = (step, now)
        if step % cfg.checkpoint_every == 0 and step < total:
            save(step)
    bar.close()
    save(step)
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "history": history}
