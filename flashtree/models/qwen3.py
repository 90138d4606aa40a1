"""Dense causal LM of the Qwen3 / LLaMA-3.x family (GQA, RoPE, SwiGLU; Qwen3 adds q/k RMSNorm).

Parameter names follow transformers (`model.layers.N.self_attn.q_proj.weight`, ...), so a
published checkpoint's state dict loads as is. The forward's one argument, a ForwardInput
(models/inputs.py), carries explicit positions, the committed length as a device tensor and an
in-block attention mask, which is all that tree verification needs (positions = start + depth,
mask = ancestors-and-self) and all that CUDA-graph capture needs (no host value changes between
replays).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..errors import CheckpointError
from .common import (Attention, DecoderLayer, LanguageModel, LayerShape, RMSNorm, cache_attend,
                     check_whole_head_rope, embedding_table, read_bool, read_int, run_stack)
from .inputs import ForwardInput
from .kv_cache import KVCache, PoolArg


@dataclass
class LMConfig(LayerShape):
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LMConfig":
        """Read a transformers config.json dict of a dense architecture (models/registry.py).
        Sliding-window layers are refused: every layer here attends to the whole context, which
        would answer otherwise than the model does past its window."""
        mtype = cfg.get("model_type")
        if read_bool(cfg, "use_sliding_window", False):
            raise CheckpointError("use_sliding_window: true: sliding-window attention in a target is not supported "
                                  "(every layer would attend to the whole context)")
        types = cfg.get("layer_types")
        if types is not None and (not isinstance(types, list) or set(types) - {"full_attention"}):
            raise CheckpointError(f"layer_types: {reprlib.repr(types)}: only full_attention layers are supported in "
                                  "a dense target")
        layers = read_int(cfg, "num_hidden_layers", None)
        if types is not None and layers is not None and layers >= 1 and len(types) != layers:
            # transformers refuses such a config too: which of the two numbers is right is unknown
            # (fewer than 1 layer: check_config's own error)
            raise CheckpointError(f"layer_types: lists {len(types)} layers, but num_hidden_layers is {layers}")
        try:
            shape = LayerShape.fields_from_hf(cfg)
            check_whole_head_rope(cfg, shape)
            return cls(
                **shape,
                model_type=mtype,
                vocab_size=read_int(cfg, "vocab_size"),
                max_position_embeddings=read_int(cfg, "max_position_embeddings", 32768),
                tie_word_embeddings=read_bool(cfg, "tie_word_embeddings", False),
                mlp_bias=read_bool(cfg, "mlp_bias", False),
                qk_norm=mtype == "qwen3",
            )
        except KeyError as e:
            raise CheckpointError(f"{e.args[0]}: missing (the model needs it)") from None

    @property
    def rotary_dim(self) -> int:
        """RoPE turns every dimension of a head (a partial_rotary_factor is refused where it would
        not: common.check_whole_head_rope)."""
        return self.head_dim

    def counts(self) -> list[tuple[str, int]]:
        return super().counts() + [("vocab_size", self.vocab_size),
                                   ("max_position_embeddings", self.max_position_embeddings)]


def decoder_layer(c: LMConfig) -> DecoderLayer:
    attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                     c.qk_norm, c.rms_norm_eps)
    return DecoderLayer(attn, c.hidden_size, c.intermediate_size, c.rms_norm_eps, c.mlp_bias)


class Backbone(nn.Module):
    """Named `model` inside CausalLM so parameter names match transformers checkpoints."""

    def __init__(self, c: LMConfig):
        super().__init__()
        self.embed_tokens = embedding_table(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CausalLM(LanguageModel):
    def __init__(self, c: LMConfig, max_pos: int):
        super().__init__(c, Backbone(c), c.head_dim, max_pos)

    def forward(self, inp: ForwardInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the T new tokens `inp.ids` after the `inp.lengths` committed cache rows; their K/V
        land in rows [length, length + T), which the caller then commits, compacts or drops.

        Returns the final-normed hidden states [T, H] and, if `inp.feature_layers` is given, the
        concatenated outputs of those decoder layers [T, len*H] (DFlash context features)."""
        attend = cache_attend(inp, self.rope)
        return run_stack(self.model.layers, self.embed(inp.ids), self.model.norm, attend, inp.feature_layers)

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str,
                  max_nodes: int = 1, k_type: Optional[str] = None, v_type: Optional[str] = None,
                  pool: PoolArg = None) -> KVCache:
        """The sequence's KV rows (`max_nodes`: unused, attention needs no per-node state),
        stored as the --kv-type/--v-type kinds say (None: as computed), in `pool`'s pages
        (models/kv_cache.py: a pool shared with other sequences, or its rows)."""
        c = self.config
        return KVCache(c.num_layers, capacity, c.num_kv_heads, c.head_dim, dtype, device, k_type, v_type, pool)
