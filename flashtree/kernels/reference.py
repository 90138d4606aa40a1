"""The plain-PyTorch definitions of the kernels' arithmetic: what every Triton kernel here must
compute, and what runs where Triton does not (the CPU, float32, training with autograd).

They match transformers' numerics (norms in float32 and cast back, rotate-half RoPE, SDPA), so a
model built on them is bit-compatible enough with the reference implementations to compare
logits in float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back to x's dtype before the weight, as transformers."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-row cos/sin [T, D] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], eps: float,
              heads: int, kv_heads: int, head_dim: int
              ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The packed projection qkv [T, (heads + 2 kv_heads) * D] -> q [T, heads, D] (None when
    heads == 0), k, v [T, kv_heads, D]; q and k RMSNormed per head (if norm weights are given)
    and rotated by the RoPE table rows at `positions`."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
        if heads:
            q = rms_norm(q, q_norm, eps)
    c, s = cos[positions], sin[positions]
    return (apply_rope(q, c, s) if heads else None), apply_rope(k, c, s), v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
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
