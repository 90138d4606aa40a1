"""Hybrid causal LM of the Qwen3.5 / 3.6 / 3.8 family: Gated DeltaNet (linear attention) layers and
gated full-attention layers, following the config's `layer_types`.

Parameter names follow transformers' `Qwen3_5ForCausalLM` (`model.layers.N.linear_attn.*`,
`model.layers.N.self_attn.*`); the published vision-language checkpoints (`qwen3_5`, text weights
under `model.language_model.*`) load too, their vision tower and MTP weights left out.

A Gated DeltaNet layer carries, per sequence, a recurrent state [heads, k_dim, v_dim] (float32)
and the window of its depthwise causal convolution [K-1, channels]. Over a tree the layer runs a
parent-indexed scan: each node continues its parent's state and conv window, not the previous
row's. Each node's delta-rule inputs (k, v, g, beta: a few KB) and conv window are kept
(HybridState), not its state (heads x k_dim x v_dim floats): once the walk has accepted a path,
the live state becomes the fold of that path's inputs, the very steps the forward took, so it
is exact without a replay forward. A prefill chunk runs the same recurrence as a sequence and
keeps only the final state. The full-attention layers are the dense models' (queries with an output
gate, q/k norm, RoPE on the first `partial_rotary_factor` of each head) over the usual KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ..errors import CheckpointError
from ..kernels.attention import cache_attention
from ..kernels.gated_delta import (DeltaBatch, DeltaRows, TreeIndex, delta_inputs, delta_inputs_batch,
                                   gated_delta_rule, gated_delta_tree_batch, gated_output)
from ..kernels.fused import gated_qkv_store
from .common import (LanguageModel, LayerShape, Mix, RMSNorm, SwiGLU, embedding_table, packed_linear, read_bool,
                     read_float, read_int, run_stack)
from .inputs import ForwardInput, split_groups
from .moe import SparseMoE
from .kv_cache import KVCache, PoolArg
from .state import HybridState

WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # vision-language checkpoints: the text model under text_config
LINEAR, FULL = "linear_attention", "full_attention"
SILU_GATES = ("silu", "swish")  # output_gate_type values that mean the SiLU gate this model computes


def check_output_gate(text: dict[str, Any]) -> None:
    """`output_gate_type` names the activation of the Gated DeltaNet layers' gated output norm
    (norm(x) * act(z)). Qwen3.5 / 3.6 omit it and Qwen3.8 writes "swish": both mean SiLU, which is
    what this model computes. Another value (vLLM also knows "sigmoid") would change every
    DeltaNet layer's output while still producing plausible text, so it is refused, not ignored."""
    gate = text.get("output_gate_type", "silu")
    if gate not in SILU_GATES:
        raise CheckpointError(f"output_gate_type: {gate!r} is not supported (the Gated DeltaNet output gate "
                              f"is SiLU: {' or '.join(map(repr, SILU_GATES))}, or the key absent)")


def full_every(interval: int, layers: int) -> list[str]:
    """The layer types of a config without `layer_types`: every `full_attention_interval`-th
    layer full attention, the others DeltaNet. An interval below 1 has no such layers (0 was a
    ZeroDivisionError): a ValueError naming the key."""
    if interval < 1:
        raise ValueError(f"full_attention_interval: must be at least 1, found {interval}")
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


@dataclass
class HybridConfig(LayerShape):
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: list[str]
    rotary_dim: int
    conv_kernel: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    num_experts: int = 0              # 0: a dense SwiGLU MLP; else the MoE of models/moe.py
    experts_per_token: int = 0
    expert_size: int = 0              # each routed expert's intermediate size
    shared_expert_size: int = 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "HybridConfig":
        """A `qwen3_5[_moe]_text` config, or a vision-language one through its text_config."""
        mtype = cfg.get("model_type")
        text = cfg.get("text_config") or {} if mtype in WRAPPERS else cfg
        if not isinstance(text, dict):
            raise ValueError(f"text_config: must be an object, found {text!r}")
        moe = read_int(text, "num_experts", 0) if mtype.startswith("qwen3_5_moe") else 0
        if moe:  # every layer's MLP is the MoE: the dense intermediate size is the shared expert's
            text = {"intermediate_size": text.get("shared_expert_intermediate_size"), **text}
        try:
            layers = read_int(text, "num_hidden_layers")
            types = text.get("layer_types") or full_every(read_int(text, "full_attention_interval", 4), layers)
            if not isinstance(types, list) or len(types) != layers or set(types) - {LINEAR, FULL}:
                raise CheckpointError(f"layer_types must list {layers} of {LINEAR!r} / {FULL!r}")
            check_output_gate(text)
            shape = LayerShape.fields_from_hf(text)
            rope = text.get("rope_parameters") or {}
            factor = read_float(rope, "partial_rotary_factor", read_float(text, "partial_rotary_factor", 0.25))
            if not math.isfinite(factor):  # int() of it raised OverflowError: a traceback
                raise ValueError(f"partial_rotary_factor: must be a finite number, found {factor}")
            tie = read_bool(cfg, "tie_word_embeddings", read_bool(text, "tie_word_embeddings", False))
            return cls(**shape, model_type=mtype, vocab_size=read_int(text, "vocab_size"),
                       max_position_embeddings=read_int(text, "max_position_embeddings", 32768),
                       tie_word_embeddings=tie, layer_types=list(types),
                       rotary_dim=int(shape["head_dim"] * factor),
                       conv_kernel=read_int(text, "linear_conv_kernel_dim", 4),
                       linear_key_heads=read_int(text, "linear_num_key_heads"),
                       linear_value_heads=read_int(text, "linear_num_value_heads"),
                       linear_key_dim=read_int(text, "linear_key_head_dim"),
                       linear_value_dim=read_int(text, "linear_value_head_dim"),
                       num_experts=moe, experts_per_token=read_int(text, "num_experts_per_tok") if moe else 0,
                       expert_size=read_int(text, "moe_intermediate_size") if moe else 0,
                       shared_expert_size=read_int(text, "shared_expert_intermediate_size") if moe else 0)
        except KeyError as e:
            raise CheckpointError(f"{e.args[0]}: missing (the model needs it)") from None

    def counts(self) -> list[tuple[str, int]]:
        return super().counts() + [
            ("vocab_size", self.vocab_size), ("max_position_embeddings", self.max_position_embeddings),
            ("linear_num_key_heads", self.linear_key_heads), ("linear_num_value_heads", self.linear_value_heads),
            ("linear_key_head_dim", self.linear_key_dim), ("linear_value_head_dim", self.linear_value_dim),
            ("linear_conv_kernel_dim", self.conv_kernel)]

    def problems(self) -> list[tuple[str, str]]:
        """Each key head serves a whole group of value heads; a token takes 1 to all experts."""
        found = []
        if self.linear_value_heads % self.linear_key_heads:
            found.append(("linear_num_key_heads", f"{self.linear_key_heads} does not divide linear_num_value_heads "
                                                  f"{self.linear_value_heads}"))
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            found.append(("num_experts_per_tok", f"{self.experts_per_token} is not from 1 to num_experts "
                                                 f"{self.num_experts}"))
        return found

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj makes each head's query and its gate."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        hd = c.head_dim
        packed_linear(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                      [2 * c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], c.hidden_size,
                      c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * hd, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps, offset=1.0)
        self.scale = hd ** -0.5
        self.rotary_dim = c.rotary_dim

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVCache, layer: int,
               lengths: torch.Tensor, block_mask: Optional[torch.Tensor],
               table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One sequence's rows: store their keys/values at rows [length, length + T) of `kv`'s
        `layer`, attend over the committed rows and the new ones (causal without `block_mask`),
        and gate; the output projection is the caller's (it runs over a batch's rows at once).
        qkv [T, ...] is qkv_proj's output, rope the rows' (cos, sin). With `table` (several
        sequences' page tables, ForwardInput.attention_at_once) the rows are every sequence's,
        `lengths` and `block_mask` theirs."""
        k_rows, v_rows = kv.layer(layer, table)
        q, gate = gated_qkv_store(qkv, rope[0], rope[1], self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                  k_rows, v_rows, lengths, self.heads, self.kv_heads, self.rotary_dim)
        return cache_attention(q, k_rows, v_rows, lengths, self.scale, block_mask, block_mask is None) * gate


class DeltaScan(NamedTuple):
    """One sequence's part of a DeltaNet layer's forward: its committed conv window [K-1, C] and
    state [Hv, Dk, Dv], its tree (None: a sequence), where its rows' delta-rule inputs go, and
    where a sequence's final state goes (None for a tree)."""
    window: torch.Tensor
    state: torch.Tensor
    tree: Optional[TreeIndex]
    rows: DeltaRows
    final: Optional[torch.Tensor]


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule (transformers' Qwen3_5GatedDeltaNet weights)."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.key_heads, self.value_heads = c.linear_key_heads, c.linear_value_heads
        self.key_dim, self.value_dim = c.linear_key_dim, c.linear_value_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        packed_linear(self, "in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                      [2 * keys + values, values, self.value_heads, self.value_heads], c.hidden_size, False)
        self.conv1d = nn.Conv1d(2 * keys + values, 2 * keys + values, c.conv_kernel,
                                groups=2 * keys + values, bias=False, padding=c.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = RMSNorm(self.value_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(values, c.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, scans: Sequence[DeltaScan], split: Callable[[torch.Tensor], Sequence[torch.Tensor]],
                together: Optional[DeltaBatch] = None) -> torch.Tensor:
        """h [T, H] -> output [T, H]: the projections over all rows, the convolution and the delta
        rule per sequence (`split` cuts rows into the sequences' of `scans`), each after its
        committed conv window [K-1, C] and state [Hv, Dk, Dv]. Its rows' delta-rule inputs and
        conv windows go to its DeltaRows (every node's with a tree, whose states are the folds of
        their paths: HybridState), a sequence's final state to its `final`. With `together`
        (the layer's DeltaBatch: ForwardInput.scans_at_once) every sequence's tree is in one
        launch of each kernel, with the same results."""
        proj = self.in_proj(h)
        weight = self.conv1d.weight[:, 0]
        if together is not None:
            first = scans[0]
            q = delta_inputs_batch(proj, together, first.window, weight, self.A_log, self.dt_bias, self.key_heads,
                                   self.key_dim, self.value_dim, first.rows)
            out = gated_delta_tree_batch(q, together, first.state, first.rows)
        else:
            outs = []
            for scan, part in zip(scans, split(proj)):
                q = delta_inputs(part, scan.window, weight, self.A_log, self.dt_bias, self.key_heads, self.key_dim,
                                 self.value_dim, scan.tree, scan.rows)
                rows = scan.rows
                outs.append(gated_delta_rule(q, rows.k, rows.v, rows.g, rows.beta, scan.state, scan.tree,
                                             scan.final)[0])
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        z = proj[:, self.conv1d.weight.shape[0]:][:, :self.value_heads * self.value_dim]
        return self.out_proj(gated_output(out, z, self.norm.weight, self.norm.eps, h.dtype))


class HybridLayer(nn.Module):
    def __init__(self, c: HybridConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = GatedAttention(c)
        self.mlp = (SparseMoE(c.hidden_size, c.num_experts, c.experts_per_token, c.expert_size,
                              c.shared_expert_size) if c.num_experts
                    else SwiGLU(c.hidden_size, c.intermediate_size))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=1.0)


class HybridBackbone(nn.Module):
    def __init__(self, c: HybridConfig):
        super().__init__()
        self.embed_tokens = embedding_table(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(c, kind) for kind in c.layer_types)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=1.0)


class HybridCausalLM(LanguageModel):
    def __init__(self, c: HybridConfig, max_pos: int):
        super().__init__(c, HybridBackbone(c), c.rotary_dim, max_pos)
        # the MoE groups rows by expert on the host: no CUDA graphs (models/moe.py)
        self.capturable = not c.num_experts
        # layer i's index among the layers of its kind: its rows in the KV cache / the states
        self.slot = {layer: n for kind in (c.attention_layers, c.linear_layers) for n, layer in enumerate(kind)}

    def forward(self, inp: ForwardInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """CausalLM.forward's contract over `inp.cache`, a HybridState, plus `inp.tree` for a
        tree (None: the rows are a sequence, as a prefill chunk). The attention layers write K/V
        rows after the committed length; the DeltaNet layers read the committed states and leave
        what the commit needs in the state's scratch (a tree's per-node inputs, a sequence's final
        states): nothing is committed here."""
        return run_stack(self.model.layers, self.embed(inp.ids), self.model.norm, self._mixer(inp),
                         inp.feature_layers)

    def _mixer(self, inp: ForwardInput) -> Mix:
        """Each layer's token mixer over `inp`'s sequences: projections over all rows, the cache
        attention or the DeltaNet scan of each sequence over its own state (one launch for all
        where they can share it: attention_groups, scans_at_once)."""
        parts = inp.sequences()
        cos, sin = self.rope(inp.row_positions())  # once for every attention layer
        groups = inp.attention_groups([p.cache.kv for p in parts])
        together = inp.scans_at_once()
        ropes = list(zip(split_groups(cos, groups), split_groups(sin, groups)))

        def mix(i: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            n = self.slot[i]
            if layer.kind == LINEAR:
                scans = [DeltaScan(p.cache.conv[n], p.cache.ssm[n], p.tree,
                                   p.cache.delta_rows(n, p.rows.shape[0], p.tree is not None),
                                   p.cache.pending_ssm[n] if p.tree is None else None) for p in parts]
                return layer.linear_attn(h, scans, inp.split, together.at(n) if together is not None else None)
            attn = layer.self_attn
            outs = [attn.attend(qkv, rope, g.cache, n, g.lengths, g.block_mask, g.table)
                    for g, qkv, rope in zip(groups, split_groups(attn.qkv_proj(h), groups), ropes)]
            return attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

        return mix

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str,
                  max_nodes: int = 64, k_type: Optional[str] = None, v_type: Optional[str] = None,
                  pool: PoolArg = None) -> HybridState:
        """KV rows of the attention layers (stored as k_type/v_type say) and the recurrent
        states of the DeltaNet layers (float32 and the model's dtype, whatever the KV type)."""
        c = self.config
        return HybridState(len(c.attention_layers), capacity, c.num_kv_heads, c.head_dim, dtype, device,
                           len(c.linear_layers), c.linear_value_heads, c.linear_key_dim,
                           c.linear_value_dim, c.conv_channels, c.conv_kernel - 1, max_nodes, k_type, v_type, pool)


def text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's weights under Qwen3_5[Moe]ForCausalLM's names. The vision-language checkpoints
    keep them under `model.language_model.`; their vision tower (`model.visual.`) and the
    multi-token-prediction layer (`mtp.`, which `--draft mtp` loads as a draft: models/mtp.py) are
    left out."""
    wrapped = "model.language_model."
    out = {}
    for key, tensor in state.items():
        if key.startswith(("model.visual.", "mtp.")):
            continue
        out["model." + key[len(wrapped):] if key.startswith(wrapped) else key] = tensor
    return out
