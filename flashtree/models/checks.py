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
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .common import LayerShape
from .qwen35 import HybridConfig
from .qwen3 import LMConfig


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _counts(cfg: LayerShape) -> list[tuple[str, int]]:
    """(config.json key, value) of every count and size that must be at least 1."""
    counts = [("num_hidden_layers", cfg.num_layers), ("hidden_size", cfg.hidden_size),
              ("intermediate_size", cfg.intermediate_size), ("num_attention_heads", cfg.num_heads),
              ("num_key_value_heads", cfg.num_kv_heads), ("head_dim", cfg.head_dim)]
    if isinstance(cfg, (LMConfig, HybridConfig)):
        counts += [("vocab_size", cfg.vocab_size), ("max_position_embeddings", cfg.max_position_embeddings)]
    if isinstance(cfg, HybridConfig):
        counts += [("linear_num_key_heads", cfg.linear_key_heads), ("linear_num_value_heads", cfg.linear_value_heads),
                   ("linear_key_head_dim", cfg.linear_key_dim), ("linear_value_head_dim", cfg.linear_value_dim),
                   ("linear_conv_kernel_dim", cfg.conv_kernel)]
    return counts


def check_config(cfg: LayerShape, source: str) -> None:
    """Refuse a config that makes no working model: a count or size below 1 (no layers, no
    heads), key/value heads that do not divide the query heads (each serves a whole group), a
    norm epsilon or RoPE base or scaling factor that is not a positive finite number, or a
    rotary width that is not an even number of a head's dimensions (RoPE turns pairs)."""
    def fail(field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field}: {problem}")

    for field, value in _counts(cfg):
        if value < 1:
            raise fail(field, f"must be at least 1, found {value}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise fail("num_key_value_heads", f"{cfg.num_kv_heads} does not divide num_attention_heads {cfg.num_heads}")
    if not _positive(cfg.rms_norm_eps):
        raise fail("rms_norm_eps", f"must be a positive finite number, found {cfg.rms_norm_eps}")
    for key, field in (("rope_theta", "rope_theta"), ("factor", "rope_scaling.factor")):
        if key in cfg.rope and not _positive(cfg.rope[key]):
            raise fail(field, f"must be a positive finite number, found {cfg.rope[key]!r}")
    rotary = cfg.rotary_dim if isinstance(cfg, HybridConfig) else cfg.head_dim
    if rotary < 2 or rotary % 2 or rotary > cfg.head_dim:
        raise fail("head_dim", f"RoPE turns {rotary} of its {cfg.head_dim} dimensions, which must be an even "
                               "number from 2 to head_dim")
    if isinstance(cfg, HybridConfig) and cfg.linear_value_heads % cfg.linear_key_heads:
        raise fail("linear_num_key_heads", f"{cfg.linear_key_heads} does not divide linear_num_value_heads "
                                           f"{cfg.linear_value_heads}")
    if isinstance(cfg, HybridConfig) and cfg.num_experts and not 1 <= cfg.experts_per_token <= cfg.num_experts:
        raise fail("num_experts_per_tok", f"{cfg.experts_per_token} is not from 1 to num_experts {cfg.num_experts}")


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
