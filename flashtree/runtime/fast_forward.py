"""The forwards of the CUDA path: target and draft layers over fused weights and fused kernels.

The plain models (models/qwen3.py, models/dflash.py) stay the definition; this is the same
arithmetic arranged for speed at batch 1, where a forward is bound by reading the weights once
and, without care, by the number of kernel launches:
- q/k/v and gate/up projections become one matrix each (the modules' parameters are re-pointed
  at slices of it, so no memory is added and the plain path still works);
- the residual add and the next RMSNorm, q/k norm + RoPE + the KV store, SiLU * up are one
  kernel each (kernels/fused.py);
- attention reads the committed length from a device tensor (kernels/attention.py), so these
  forwards contain no host synchronisation and can be captured in CUDA graphs.
Tests compare them with the plain models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import cache_attention
from ..kernels.fused import qkv_rope_store, rms_norm, silu_mul
from ..models.dflash import DFlashDraft
from ..models.qwen3 import CausalLM
from .kv_cache import KVCache


def _adjacent(parts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose consecutive row blocks are `parts`, if they already are such views."""
    storage = parts[0].untyped_storage()
    offset = end = parts[0].storage_offset()
    for p in parts:
        if (p.untyped_storage().data_ptr() != storage.data_ptr() or not p.is_contiguous()
                or p.storage_offset() != end):
            return None
        end += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return parts[0].new_empty(0).set_(storage, offset, (rows, *parts[0].shape[1:]))


def fuse_linears(mods: Sequence[nn.Linear]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One weight (and bias) holding the rows of `mods`; each module's parameters become views
    of it, so the fused and the separate forms share storage. Fusing twice reuses the first."""
    weights = [m.weight.detach() for m in mods]
    fused = _adjacent(weights)
    if fused is not None:
        biases = [m.bias.detach() for m in mods] if mods[0].bias is not None else None
        return fused, (_adjacent(biases) if biases is not None else None)
    weight = torch.cat(weights)
    bias = torch.cat([m.bias.detach() for m in mods]) if mods[0].bias is not None else None
    row = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


@dataclass
class FusedLayer:
    """One decoder layer's tensors in the fused layout (same for target and draft layers)."""
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_w: torch.Tensor
    qkv_b: Optional[torch.Tensor]
    o_w: torch.Tensor
    o_b: Optional[torch.Tensor]
    gu_w: torch.Tensor
    gu_b: Optional[torch.Tensor]
    down_w: torch.Tensor
    down_b: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    scale: float

    @classmethod
    def of(cls, layer: nn.Module) -> "FusedLayer":
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gu_w, gu_b = fuse_linears([mlp.gate_proj, mlp.up_proj])
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   layer.input_layernorm.eps, qkv_w, qkv_b, attn.o_proj.weight, attn.o_proj.bias,
                   gu_w, gu_b, mlp.down_proj.weight, mlp.down_proj.bias,
                   q_norm.weight if q_norm is not None else None,
                   k_norm.weight if k_norm is not None else None, attn.scale)


def run_layers(layers: Sequence[FusedLayer], x: torch.Tensor, positions: torch.Tensor,
               rope: nn.Module, cache: KVCache, length: torch.Tensor, heads: int, kv_heads: int,
               final_norm: nn.Module, block_mask: Optional[torch.Tensor], causal: bool,
               windows: Sequence[Optional[int]], feature_layers: Sequence[int] = ()
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [T, H] -> (final-normed hidden [T, H], features of `feature_layers` [T, n*H] or None).
    Writes the new tokens' K/V at cache rows [length, length + T); commits nothing."""
    feats: list[Optional[torch.Tensor]] = [None] * len(feature_layers)
    h, residual = rms_norm(x, layers[0].in_norm, layers[0].eps)
    for i, lay in enumerate(layers):
        qkv = F.linear(h, lay.qkv_w, lay.qkv_b)
        q = qkv_rope_store(qkv, positions, rope.cos, rope.sin, lay.q_norm, lay.k_norm, lay.eps,
                           cache.k[i], cache.v[i], length, heads, kv_heads)
        attn = cache_attention(q, cache.k[i], cache.v[i], length, lay.scale, block_mask, causal,
                               windows[i])
        h, residual = rms_norm(F.linear(attn, lay.o_w, lay.o_b), lay.post_norm, lay.eps, residual)
        down = F.linear(silu_mul(F.linear(h, lay.gu_w, lay.gu_b)), lay.down_w, lay.down_b)
        if i + 1 < len(layers):
            h, residual = rms_norm(down, layers[i + 1].in_norm, layers[i + 1].eps, residual)
        else:
            h, residual = rms_norm(down, final_norm.weight, final_norm.eps, residual)
        for slot, layer in enumerate(feature_layers):
            if layer == i:
                feats[slot] = residual
    features = torch.cat(feats, dim=-1) if feats else None  # type: ignore[arg-type]
    return h, features


class FastTarget:
    """CausalLM.forward's contract, with the cache length given as a device tensor."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.layers = [FusedLayer.of(layer) for layer in model.model.layers]
        self.windows = [None] * len(self.layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                length: torch.Tensor, block_mask: Optional[torch.Tensor], causal: bool,
                feature_layers: Sequence[int] = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        c = self.model.config
        return run_layers(self.layers, self.model.embed(ids), positions, self.model.rope, cache,
                          length, c.num_heads, c.num_kv_heads, self.model.model.norm, block_mask,
                          causal, self.windows, feature_layers)


class FastDraft:
    """DFlashDraft's forward and context append, with the cache length as a device tensor; the
    block's positions are its cache rows, length + i."""

    def __init__(self, draft: DFlashDraft, target: CausalLM):
        self.draft = draft
        self.target = target
        self.layers = [FusedLayer.of(layer) for layer in draft.layers]
        self.offsets = torch.arange(draft.rope.cos.shape[0], device=draft.fc.weight.device)

    def forward(self, block_ids: torch.Tensor, cache: KVCache, length: torch.Tensor) -> torch.Tensor:
        c = self.draft.config
        positions = self.offsets[:block_ids.shape[0]] + length
        hidden, _ = run_layers(self.layers, self.target.embed(block_ids), positions, self.draft.rope,
                               cache, length, c.num_heads, c.num_kv_heads, self.draft.norm, None,
                               False, c.sliding_windows)
        return hidden

    def write_context(self, features: torch.Tensor, cache: KVCache, length: torch.Tensor) -> None:
        """Project committed positions' target features into every layer's K/V rows
        [length, length + T) (the caller advances the cache)."""
        c = self.draft.config
        ctx, _ = rms_norm(F.linear(features, self.draft.fc.weight), self.draft.hidden_norm.weight,
                          self.draft.hidden_norm.eps)
        positions = self.offsets[:features.shape[0]] + length
        q_rows = c.num_heads * c.head_dim
        for i, lay in enumerate(self.layers):
            kv = F.linear(ctx, lay.qkv_w[q_rows:], lay.qkv_b[q_rows:] if lay.qkv_b is not None else None)
            qkv_rope_store(kv, positions, self.draft.rope.cos, self.draft.rope.sin, None, lay.k_norm,
                           lay.eps, cache.k[i], cache.v[i], length, 0, c.num_kv_heads)
