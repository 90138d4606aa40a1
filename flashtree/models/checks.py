"""Refusing, at load, a model that could not serve: a config whose shape or constants make no
working model, and weights holding a NaN or an infinity.

Such a model loads without complaint and then fails every request (a stack of no layers indexes
past its end) or, worse, answers every request with "" and finish_reason stop (one NaN weight, a
NaN norm epsilon or a RoPE base at or below zero makes every logit NaN). So the loader
(models/loader.py) checks every checkpoint, safetensors or GGUF, target or draft, here, once:
the config when it is read (so `flashtree plan` refuses it too), the weights once loaded, where
they lie (the device, or the host copy that --quantize stages). Each refusal is a CheckpointError naming the checkpoint, the field or tensor, and what is
wrong.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .dflash import DraftConfig
from .registry import TargetConfig


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_config(cfg: Union[TargetConfig, DraftConfig], source: str) -> None:
    """Refuse a config that makes no working model: a count or size below 1 (no layers, no
    heads), key/value heads that do not divide the query heads (each serves a whole group), a
    norm epsilon or RoPE base or scaling factor that is not a positive finite number, a
    rotary width that is not an even number of a head's dimensions (RoPE turns pairs), or what
    the config's own rules refuse (its `counts` and `problems`: a hybrid's DeltaNet heads)."""
    def fail(field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field}: {problem}")

    for field, value in cfg.counts():
        if value < 1:
            raise fail(field, f"must be at least 1, found {value}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise fail("num_key_value_heads", f"{cfg.num_kv_heads} does not divide num_attention_heads {cfg.num_heads}")
    if not _positive(cfg.rms_norm_eps):
        raise fail("rms_norm_eps", f"must be a positive finite number, found {cfg.rms_norm_eps}")
    for key, field in (("rope_theta", "rope_theta"), ("factor", "rope_scaling.factor")):
        if key in cfg.rope and not _positive(cfg.rope[key]):
            raise fail(field, f"must be a positive finite number, found {cfg.rope[key]!r}")
    rotary = cfg.rotary_dim
    if rotary < 2 or rotary % 2 or rotary > cfg.head_dim:
        raise fail("head_dim", f"RoPE turns {rotary} of its {cfg.head_dim} dimensions, which must be an even "
                               "number from 2 to head_dim")
    problems = cfg.problems()
    if problems:
        raise fail(*problems[0])


def check_finite(model: nn.Module, source: str) -> None:
    """Refuse a model holding a NaN or an infinity in any floating-point parameter or buffer:
    a dense weight, a quantized weight's scales and minimums, the RoPE table.

    Each tensor is reduced once where it lies to its smallest and largest value (one pass,
    aminmax): both are finite only if every value is, since a NaN makes both NaN and an infinity
    is one of them. So one read of each weight clears it, with no temporary the size of the
    weight (torch.isfinite(t).all() would first write a byte per value: 1.3 GB for the bfloat16
    embedding of a 248K x 5120 vocabulary). Only a tensor that fails is looked at value by
    value, to count what is wrong in it."""
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        if not t.is_floating_point() or t.numel() == 0 or torch.isfinite(torch.stack(t.aminmax())).all():
            continue
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{source}: {name}: {bad} of its {t.numel()} values are not finite (NaN or infinity)")
