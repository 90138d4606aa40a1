"""Fused per-layer ops (RMSNorm with the residual add; q/k norm + RoPE + KV store, also in the
gated-attention form of Qwen3.5; SiLU-gate):
Triton on CUDA, else their definitions from reference.py. Also the dense linear, which the
deterministic mode takes to its own kernel."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import deterministic, use_triton
from .reference import rms_norm_offset, split_gated_qkv, split_qkv
from .kv_storage import QBLOCK, KVSide, QuantRows, sequence_side, side_capacity, store_kv, unpaged


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, offset: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s), s) with s = x + residual (or x): the residual add and the next layer's norm
    in one pass, as the decoder-layer boundary needs. x, residual [T, H]. `offset` 1.0: the
    weight is zero-centered (scale 1 + weight)."""
    if use_triton(x):
        from .triton_fused import rms_norm as kernel

        return kernel(x, weight, eps, residual, offset)
    total = x + residual if residual is not None else x
    return rms_norm_offset(total, weight, eps, offset), total


def qkv_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], eps: float,
                   k_cache: KVSide, v_cache: KVSide, length: torch.Tensor,
                   heads: int, kv_heads: int) -> Optional[torch.Tensor]:
    """Split the fused projection qkv [T, (heads + 2 kv_heads) * D]; RMSNorm q and k per head (if
    norm weights are given), rotate them by the RoPE table rows at `positions`, store k and v at
    cache rows [length, length + T) of k_cache/v_cache [capacity, kv_heads, D] (quantized as
    they are stored, for QuantRows; through a page table, for Paged); return q [T, heads, D]
    (None when heads == 0: the draft's context projection has no queries). Several sequences'
    rows at once (`length` [S], tables [S, pages]; kernels.attention.cache_attention): each
    sequence's run of T // S rows at its own rows, one launch on CUDA."""
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    if use_triton(qkv) and all(_kernel_stores(side, dim // 2) for side in (k_cache, v_cache)):
        from .triton_fused import qkv_rope_store as kernel

        return kernel(qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, length,
                      heads, kv_heads, dim)
    q, k, v = split_qkv(qkv, positions, cos, sin, q_norm, k_norm, eps, heads, kv_heads, dim)
    end = int(length.max()) + qkv.shape[0] // length.numel()
    capacity = side_capacity(k_cache)
    if end > capacity:
        raise RuntimeError(f"KV cache overflow: {end} rows > capacity {capacity}")
    _store_each(k_cache, v_cache, length, k, v)
    return q


def gated_qkv_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, k_cache: KVSide, v_cache: KVSide,
                    length: torch.Tensor, heads: int, kv_heads: int, rotary_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.split_gated_qkv, with k and v stored at cache rows [length, length + T) of
    k_cache/v_cache [capacity, kv_heads, D] (`length` a device tensor: no host sync, capturable;
    quantized as they are stored, for QuantRows). Returns (q [T, heads, D], sigmoid(gate)
    [T, heads*D]); one launch on CUDA (a block type's head in whole blocks). Over a quantized
    cache the eager definition was about 30 launches an attention layer, which the one launch
    replaces (a large part of a quantized-cache AR forward; `flashtree bench --kv-type q4_0`
    measures it). Several sequences at once as qkv_rope_store takes them."""
    dim = q_norm.shape[0]  # the head dim (the q/k norms are per head)
    if use_triton(qkv) and all(_kernel_stores(side, dim) for side in (k_cache, v_cache)):
        from .triton_fused import gated_qkv_store as kernel

        return kernel(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, length, heads, kv_heads,
                      rotary_dim)
    q, k, v, gate = split_gated_qkv(qkv, cos, sin, q_norm, k_norm, eps, heads, kv_heads, dim, rotary_dim)
    _store_each(k_cache, v_cache, length, k, v)
    return q, gate


def _store_each(k_cache: KVSide, v_cache: KVSide, length: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [S T, kv_heads, D] at rows [length[s], length[s] + T) of each of `length`'s S
    sequences (a device index: no host sync, so a CUDA graph can capture it)."""
    sequences = length.numel()
    t = k.shape[0] // sequences
    for s in range(sequences):
        rows = torch.arange(t, device=k.device) + length.reshape(-1)[s]
        store_kv(sequence_side(k_cache, s), rows, k[s * t:(s + 1) * t])
        store_kv(sequence_side(v_cache, s), rows, v[s * t:(s + 1) * t])


def _kernel_stores(side: KVSide, unit: int) -> bool:
    """Whether a Triton store writes this side: plain and cast rows always; block types where the
    kernel's unit of a head (`unit` dims: half a head for the dense kernel, the whole head for
    the gated one) is whole blocks."""
    rows, _ = unpaged(side)
    return not isinstance(rows, QuantRows) or rows.scale is None or unit % QBLOCK == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused projection gate_up [T, 2I] -> [T, I]."""
    if use_triton(gate_up):
        from .triton_fused import silu_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight^T + bias: F.linear, or in the deterministic mode, where the Triton kernels run,
    kernels/triton_invariant.py, whose rows do not follow the rows beside them."""
    if deterministic() and use_triton(x):
        from .triton_invariant import invariant_linear

        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)
