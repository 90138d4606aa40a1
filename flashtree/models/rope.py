"""Rotary position embeddings: the RoPE settings of a config read and checked (rope_params), the
inverse frequencies of each scaling type (rope_inv_freq), and the cos/sin table the attention
reads by explicit position (RotaryTable)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError

# freq_factors: per-frequency divisors given as a list (what GGUF files hold for LLaMA-3's scaling)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")

# the numbers each rope type reads (rope_inv_freq): (those it needs, those it may have)
ROPE_KEYS = {"linear": (("factor",), ()),
             "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
             "yarn": (("factor",), ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"))}


def positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise the RoPE settings of old (`rope_theta` + `rope_scaling`) and new
    (`rope_parameters`) transformers configs into one dict with `rope_type` and `rope_theta`.

    Each must be an object, and each number its rope type reads (ROPE_KEYS) there and a positive
    finite number (a divisor, a length or a scale; `freq_factors`: a list of them), llama3's
    high_freq_factor above its low one (it divides by their difference). Else the RoPE table's
    set-up, after the config checks, failed with a KeyError, a TypeError or a division by zero: a
    ValueError naming the key instead (`rope_parameters.low_freq_factor: missing (llama3 rope
    needs it)`), which the loader prefixes with the file."""
    given = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{key}: must be an object, found {value!r}")
        given[key] = dict(value)
        if "type" in given[key] and "rope_type" not in given[key]:
            given[key]["rope_type"] = given[key].pop("type")
    # rope_scaling beside rope_parameters is a scaling added to the model's own settings (YaRN
    # turned on as a model card says): its keys win, as in transformers
    params = {**given["rope_parameters"], **given["rope_scaling"]}
    section = "rope_scaling" if given["rope_scaling"] else "rope_parameters"
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{section}.rope_type: unsupported rope type {kind!r}; supported: "
                              f"{', '.join(ROPE_TYPES)}")
    needed, optional = ROPE_KEYS.get(kind, ((), ()))
    for key in needed + optional:
        name = f"{section}.{key}"
        if params.get(key) is None:
            if key in needed:
                raise ValueError(f"{name}: missing ({kind} rope needs it)")
        elif not positive_number(params[key]):
            raise ValueError(f"{name}: must be a positive finite number, found {params[key]!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(f"rope high_freq_factor {params['high_freq_factor']} must be above low_freq_factor "
                         f"{params['low_freq_factor']}")
    factors = params.get("freq_factors")
    if kind == "freq_factors" and not (isinstance(factors, list) and all(map(positive_number, factors))):
        raise ValueError(f"rope freq_factors: must be a list of positive finite numbers, found {factors!r}")
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64, on the CPU) and the attention scaling factor for the given RoPE
    type."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = params["rope_type"]
    scale = 1.0
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "freq_factors":
        factors = torch.tensor(params["freq_factors"], dtype=torch.float64, device="cpu")
        if factors.shape != inv.shape:
            raise CheckpointError(f"{len(factors)} rope frequency factors for {len(inv)} frequencies")
        inv = inv / factors
    elif kind == "llama3":
        factor = float(params["factor"])
        lo, hi = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(medium, blended, scaled)
    elif kind == "yarn":
        factor = float(params["factor"])
        old_ctx = float(params.get("original_max_position_embeddings") or max_pos)
        beta_fast, beta_slow = float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1))

        def dim_of(rotations: float) -> float:
            return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_of(beta_fast)), 0)
        high = min(math.ceil(dim_of(beta_slow)), head_dim - 1)
        dims = torch.arange(head_dim // 2, dtype=torch.float64, device="cpu")
        ramp = ((dims - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
        scale = float(params.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    return inv, scale


class RotaryTable(nn.Module):
    """Precomputed cos/sin for every position up to `max_pos`; indexed by explicit positions, so
    tree nodes (position = start + depth) and compacted rows need no special handling.

    The table is computed on the CPU and then moved to the default device: inside a meta-device
    build (build_module, the memory plan) factory ops run torch's Python references, whose first
    use imports torch._dynamo, 2-3 s in every process that builds a model."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_pos: int):
        super().__init__()
        inv, scale = rope_inv_freq(head_dim, params, max_pos)
        # float32 angles like transformers, so logits agree to float32 rounding
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32, device="cpu"), inv.float())
        emb = torch.cat([angles, angles], dim=-1)
        where = torch.get_default_device()
        self.register_buffer("cos", (emb.cos() * scale).to(where), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(where), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]
