"""Building blocks shared by the target and the draft: RMSNorm, RoPE tables, SwiGLU, attention.

Everything works on one sequence at a time: activations are [T, hidden] (no batch axis), which is
what a batch-1 server needs and keeps the indexing of KV rows and tree nodes simple.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class LayerShape:
    """The decoder-layer shape that target and draft configs share, read the same way from a
    transformers config.json (missing required keys raise KeyError for the caller to name)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    attention_bias: bool

    @staticmethod
    def fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        return dict(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
                    num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                    num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                    head_dim=int(cfg.get("head_dim") or hidden // heads),
                    rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope_params(cfg),
                    attention_bias=bool(cfg.get("attention_bias", False)))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does (bit-compatible logits)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """The gated MLP of LLaMA/Qwen: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalise the RoPE settings of old (`rope_theta` + `rope_scaling`) and new
    (`rope_parameters`) transformers configs into one dict with `rope_type` and `rope_theta`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params["rope_type"] not in ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope type {params['rope_type']!r}; supported: {', '.join(ROPE_TYPES)}")
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and the attention scaling factor for the given RoPE type."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = params["rope_type"]
    scale = 1.0
    if kind == "linear":
        inv = inv / float(params["factor"])
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
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
        scale = float(params.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
    return inv, scale


class RotaryTable(nn.Module):
    """Precomputed cos/sin for every position up to `max_pos`; indexed by explicit positions, so
    tree nodes (position = start + depth) and compacted rows need no special handling."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_pos: int):
        super().__init__()
        inv, scale = rope_inv_freq(head_dim, params, max_pos)
        # float32 angles like transformers, so logits agree to float32 rounding
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.float())
        emb = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class AttentionProjections(nn.Module):
    """q/k/v/o projections (+ optional per-head q/k RMSNorm) under transformers' names, shared by
    the target's attention and the draft's."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.scale = head_dim ** -0.5

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        return apply_rope(self.q_norm(q) if self.qk_norm else q, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        return apply_rope(self.k_norm(k) if self.qk_norm else k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer: int,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Attend from x's rows over the cache's committed rows plus x's own (written after them)."""
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        keys, values = cache.write(layer, k, v)
        return self.o_proj(attention(q, keys, values, mask, self.scale))


class PreNormLayer(nn.Module):
    """The decoder layer of target and draft alike: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attn: nn.Module, hidden: int, inter: int, eps: float, mlp_bias: bool = False):
        super().__init__()
        self.self_attn = attn
        self.mlp = SwiGLU(hidden, inter, mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, layer: int,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-row cos/sin [T, D] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] (GQA), mask bool [T, S] (True = may attend) or None (all).

    Returns [T, Hq*D]."""
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if groups > 1:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def prefix_block_mask(prefix_len: int, block_mask: torch.Tensor) -> torch.Tensor:
    """[T, prefix_len + T] mask: every query sees the whole committed prefix, then `block_mask`
    (causal for prefill/chain, ancestors-and-self for a tree) inside the new block."""
    t = block_mask.shape[0]
    full = torch.ones(t, prefix_len + t, dtype=torch.bool, device=block_mask.device)
    full[:, prefix_len:] = block_mask
    return full
