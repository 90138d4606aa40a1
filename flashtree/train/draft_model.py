"""The DFlash draft during training: flashtree's own inference model, run batched with a mask.

Training runs `flashtree.models.dflash.DFlashDraft` itself: its context projection
(`write_context`) and its layer stack (`stack`, the one forward the engine runs), so what is
trained is exactly what the engine runs and the saved state dict is the z-lab layout by
construction. Only where attention finds its keys differs: inference attends through a
per-sequence KV cache, training packs many blocks of many sequences into one masked attention
call (`masked_attend`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..kernels.reference import split_qkv
from ..models.common import Mix
from ..models.dflash import DFlashDraft, DraftConfig
from ..models.inputs import ForwardInput
from ..models.kv_cache import KVCache


def draft_config(target: dict[str, Any], num_layers: int, intermediate_size: int, block_size: int,
                 layer_ids: list[int], mask_token_id: int) -> dict[str, Any]:
    """config.json of a draft for `target` (its config.json as a dict): a Qwen3 config whose
    width, heads and RoPE match the target's, plus the DFlash fields."""
    keep = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "vocab_size", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling",
            "hidden_act", "attention_bias"]
    cfg = {k: target[k] for k in keep if target.get(k) is not None}
    cfg.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    cfg.update({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "block_size": block_size, "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id},
    })
    return cfg


def new_draft(config: dict[str, Any], max_pos: int, seed: int = 0) -> DFlashDraft:
    """A freshly initialised draft (linear weights N(0, 0.02), norms at one, as transformers does)."""
    gen = torch.Generator().manual_seed(seed)
    draft = DFlashDraft(DraftConfig.from_hf(config), max_pos)
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                if module.bias is not None:
                    module.bias.zero_()
    return draft


def masked_attend(draft: DFlashDraft, context: KVCache, batch: int, block_pos: torch.Tensor,
                  mask: torch.Tensor) -> Mix:
    """Attention of the flattened blocks [B*Q] over their sequence's context rows (`context`,
    B*T rows written by write_context) and their own block, as `mask` [B, Q, T+Q] allows."""

    def mix(i: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        qkv = attn.qkv_proj(h)
        qn, kn = attn.norm_weights
        rope = draft.rope
        q, k, v = split_qkv(qkv, block_pos, rope.cos, rope.sin, qn, kn, attn.eps, attn.heads,
                            attn.kv_heads, attn.head_dim)
        heads, dim, rows = attn.kv_heads, attn.head_dim, context.capacity  # a cache alone: its rows in order
        keys = torch.cat([context.k[i, :rows].view(batch, -1, heads, dim), k.view(batch, -1, heads, dim)], 1)
        values = torch.cat([context.v[i, :rows].view(batch, -1, heads, dim), v.view(batch, -1, heads, dim)], 1)
        # norms compute in float32, projections in the autocast dtype: attend in the latter
        dtype = v.dtype
        qh, kh, vh = (z.transpose(1, 2).to(dtype) for z in (q.view(batch, -1, attn.heads, dim), keys, values))
        groups = attn.heads // heads
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.unsqueeze(1), scale=attn.scale)
        return attn.o_proj(out.transpose(1, 2).reshape(qkv.shape[0], -1))

    return mix


def block_forward(draft: DFlashDraft, features: torch.Tensor, ctx_pos: torch.Tensor, block: torch.Tensor,
                  block_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Predict many noise blocks of many sequences in one pass.

    features [B,T,n*H]: target layer outputs of every position; ctx_pos [B,T]; block [B,Q,H]:
    target embeddings of the blocks' tokens, at positions block_pos [B,Q]; mask [B,Q,T+Q] bool,
    True where a query may attend (keys: the T context positions, then the Q block positions).
    Returns final-normed hidden states [B,Q,H] for the target's lm_head.
    """
    b, t, _ = features.shape
    q_len, hidden = block.shape[1], block.shape[2]
    c = draft.config
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else block.dtype
    context = KVCache(c.num_layers, b * t, c.num_kv_heads, c.head_dim, dtype, block.device)
    start = torch.zeros(1, dtype=torch.int32, device=block.device)
    draft.write_context(ForwardInput(embeds=features.reshape(b * t, -1), positions=ctx_pos.reshape(-1),
                                     cache=context, lengths=start))
    attend = masked_attend(draft, context, b, block_pos.reshape(-1), mask)
    return draft.stack(block.reshape(b * q_len, hidden), attend).view(b, q_len, hidden)


def save_draft(draft: DFlashDraft, config: dict[str, Any], out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors (layers.*, fc, hidden_norm, norm)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
