"""Building blocks shared by the target and the draft, and the one decoder-stack forward.

Activations are rows [T, hidden] with no batch axis: one sequence's, or several sequences' rows
side by side, which the forward's input (inputs.ForwardInput) maps to their caches; so the
indexing of KV rows and tree nodes stays a row's own, however many sequences share a forward.

Weights are packed at load (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so a layer reads
each matrix in one GEMV; checkpoints keep transformers' names both ways (load and state_dict).
The ops are the fused kernels (kernels/fused.py, kernels/attention.py): Triton on CUDA, their
PyTorch definitions elsewhere, so one forward serves the CPU, CUDA graphs and draft training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import CheckpointError
from ..kernels.attention import cache_attention
from ..kernels.fused import qkv_rope_store, rms_norm, silu_mul
from .inputs import ForwardInput, split_groups
from .rope import RotaryTable, rope_params


# The most a config may give of a count, far above any published model's (the largest have about
# 130 layers, 128 heads, 512 experts, 512-wide heads, 16K-wide hidden states, 262K-token
# vocabularies and 10M positions). A config beyond them is corrupt, and is refused as it is read:
# the parsers list a type per layer and the memory plan builds a module per layer and expert, so
# 10**9 layers would hang both for minutes and take gigabytes before any check saw the number.
COUNT_LIMITS = {"num_hidden_layers": 1024, "num_target_layers": 1024, "num_attention_heads": 1024,
                "num_key_value_heads": 1024, "linear_num_key_heads": 1024, "linear_num_value_heads": 1024,
                "num_experts": 16384, "num_experts_per_tok": 16384, "max_position_embeddings": 1 << 30}
OTHER_LIMIT = 1 << 24  # any other count, size or token id (widths, the vocabulary)
_ABSENT = object()


def int_problem(value: Any, key: str) -> Optional[str]:
    """What is wrong with `value` as config key `key`'s integer (a count, a size, a token id), or
    None. Not an int is refused rather than converted: int() makes 6.5 layers 6, true 1 and "6" 6,
    a model the file does not describe (a bool is no int here, though Python says it is). Nor a
    value beyond its COUNT_LIMITS (keyed by the last part of a dotted key)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, found {value!r}"
    limit = COUNT_LIMITS.get(key.rsplit(".", 1)[-1], OTHER_LIMIT)
    if value > limit:
        return f"{value} is implausibly large (more than {limit}, far above any published model)"
    return None


def read_int(cfg: dict[str, Any], key: str, default: Any = _ABSENT) -> int:
    """cfg[key] as int_problem allows it; absent or null: `default` (none: a KeyError, which the
    config's reader names as a missing key). A bad value is a ValueError naming the key, which
    the loader (loader._checked) prefixes with the file."""
    value = cfg.get(key)
    if value is None:
        if default is _ABSENT:
            raise KeyError(key)
        return default
    problem = int_problem(value, key)
    if problem:
        raise ValueError(f"{key}: {problem}")
    return value


def read_float(cfg: dict[str, Any], key: str, default: float) -> float:
    """cfg[key] as a number (absent or null: `default`); a string or a boolean is a ValueError
    naming the key (float() would take "1e-6", and true as 1.0: a model the file does not
    describe)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}: must be a number, found {value!r}")
    return float(value)


def read_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """cfg[key] as a boolean (absent or null: `default`); anything else is a ValueError naming
    the key (bool("false") is True: an untied lm_head silently tied)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: must be true or false, found {value!r}")
    return value


ACTIVATIONS = ("silu", "swish")  # the MLP activation every model here runs (the same function)


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
        act = cfg.get("hidden_act")
        if act is not None and act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: {act!r} is not supported (these models run {ACTIVATIONS[0]})")
        heads, hidden = read_int(cfg, "num_attention_heads"), read_int(cfg, "hidden_size")
        return dict(hidden_size=hidden, intermediate_size=read_int(cfg, "intermediate_size"),
                    num_layers=read_int(cfg, "num_hidden_layers"), num_heads=heads,
                    num_kv_heads=read_int(cfg, "num_key_value_heads", heads),
                    head_dim=read_int(cfg, "head_dim", hidden // heads if heads else 0),
                    rms_norm_eps=read_float(cfg, "rms_norm_eps", 1e-6), rope=rope_params(cfg),
                    attention_bias=read_bool(cfg, "attention_bias", False))

    def counts(self) -> list[tuple[str, int]]:
        """(config.json key, value) of every count and size that must be at least 1 (checks.py);
        a config with more counts adds its own."""
        return [("num_hidden_layers", self.num_layers), ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size), ("num_attention_heads", self.num_heads),
                ("num_key_value_heads", self.num_kv_heads), ("head_dim", self.head_dim)]

    def problems(self) -> list[tuple[str, str]]:
        """(config.json key, what is wrong) under the rules of a config's own fields, which
        checks.py applies besides the shared ones: none here."""
        return []


def check_whole_head_rope(cfg: dict[str, Any], shape: dict[str, Any]) -> None:
    """Refuse a `partial_rotary_factor` (at the top level, or in `rope_parameters` or
    `rope_scaling`) that turns other than every dimension of a head where the RoPE scaling is
    linear, llama3 or yarn, in a model whose RoPE turns the whole head (a Qwen3 or LLaMA
    target, a DFlash draft; `shape`: its LayerShape fields). transformers, which defines these
    models, sizes such a scaling's table for int(head_dim * factor) dimensions and then fails to
    apply it to the head (a shape error in every forward): there is no output to match, and
    flashtree ignored the factor, serving a model no reference runs. With default RoPE
    transformers ignores the factor (its table always spans the head), and so does flashtree:
    accepted. A Qwen3.5 hybrid's RoPE does turn its first partial_rotary_factor (qwen35.py)."""
    for section in ("rope_scaling", "rope_parameters", None):
        where = cfg if section is None else cfg.get(section) or {}
        if where.get("partial_rotary_factor") is not None:
            key = "partial_rotary_factor" if section is None else f"{section}.partial_rotary_factor"
            factor = read_float({key: where["partial_rotary_factor"]}, key, 1.0)
            break
    else:
        return
    if not math.isfinite(factor):
        raise CheckpointError(f"{key}: must be a finite number, found {factor}")
    kind, head_dim = shape["rope"]["rope_type"], shape["head_dim"]
    if kind != "default" and int(head_dim * factor) != head_dim:
        raise CheckpointError(f"{key}: {factor:g} with {kind} RoPE scaling is not supported: this model's RoPE "
                              f"turns all {head_dim} dimensions of a head, and transformers sizes a {kind} table "
                              f"for {int(head_dim * factor)} of them, which it then cannot apply; remove the key "
                              "(default RoPE ignores it)")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does (bit-compatible logits).
    `offset` 1.0 is the zero-centered form (the scale is 1 + weight; Qwen3.5)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, _ = add_norm(x.reshape(-1, x.shape[-1]), self)
        return normed.view(x.shape)


def embedding_table(vocab: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its random init: a model's weights come from a checkpoint (or
    bench.models' init_random_), and nn.Embedding's own normal_ on the meta device, where every
    model is built, imports torch._dynamo: 2-3 s in each process that builds one (a server's
    worker, at every start and restart)."""
    return nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim))


def add_norm(x: torch.Tensor, norm: RMSNorm, residual: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = x + residual: the residual add and the next norm, one fused op."""
    return rms_norm(x, norm.weight, norm.eps, residual, norm.offset)


def _pack_on_load(packed: str, parts: Sequence[str]) -> Callable[..., None]:
    """A load_state_dict pre-hook: the checkpoint's separate `parts` (transformers' names) are
    concatenated into the module's `packed` parameter."""

    def hook(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}.{kind}" for p in parts]
            if all(n in state for n in names):
                state[f"{prefix}{packed}.{kind}"] = torch.cat([state.pop(n) for n in names])

    return hook


def _unpack_on_save(packed: str, parts: Sequence[str], rows: Callable[[], list[int]]) -> Callable[..., None]:
    """A state_dict post-hook: the packed parameter is reported as views under the parts' names,
    so saved drafts and shape checks see the checkpoint layout."""

    def hook(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
        for kind in ("weight", "bias"):
            key = f"{prefix}{packed}.{kind}"
            if key in state:
                for name, part in zip(parts, state.pop(key).split(rows())):
                    state[f"{prefix}{name}.{kind}"] = part

    return hook


def packed_linear(module: nn.Module, packed: str, parts: Sequence[str], sizes: list[int],
                  in_features: int, bias: bool) -> None:
    """Give `module` one Linear `packed` holding the rows of `parts` (sizes in that order)."""
    setattr(module, packed, nn.Linear(in_features, sum(sizes), bias=bias))
    module.packed_parts = {**getattr(module, "packed_parts", {}), packed: tuple(parts)}  # loaders' map
    module.register_load_state_dict_pre_hook(_pack_on_load(packed, parts))
    module.register_state_dict_post_hook(_unpack_on_save(packed, parts, lambda: sizes))


class SwiGLU(nn.Module):
    """The gated MLP of LLaMA/Qwen: down(silu(gate(x)) * up(x)), gate and up packed."""

    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        packed_linear(self, "gate_up_proj", ("gate_proj", "up_proj"), [inter, inter], hidden, bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class Attention(nn.Module):
    """Packed q/k/v and o projections (+ optional per-head q/k RMSNorm) under transformers'
    names, for the target's attention and the draft's alike. Where keys and values are kept is
    the caller's `attend` (run_stack)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 qk_norm: bool, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        packed_linear(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                      [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], hidden, bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.eps = eps
        self.scale = head_dim ** -0.5

    @property
    def norm_weights(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if self.q_norm is None:
            return None, None
        return self.q_norm.weight, self.k_norm.weight

    def kv_rows(self) -> slice:
        """The rows of qkv_proj that make keys and values (the draft's context projection)."""
        return slice(self.heads * self.head_dim, None)


class LanguageModel(nn.Module):
    """What every target shares around its layers: the backbone `model` (embed_tokens, layers,
    norm, under transformers' names), the lm_head (tied to the embedding where the config says),
    and the RoPE table for `rotary_dim` dimensions of a head."""

    capturable = True  # its decode forward has no host sync (CUDA graphs can replay it)

    def __init__(self, config: Any, backbone: nn.Module, rotary_dim: int, max_pos: int):
        super().__init__()
        self.config = config
        self.model = backbone
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryTable(rotary_dim, config.rope, max_pos)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over already-normed hidden states; logits are float32 for sampling."""
        return self.lm_head(hidden).float()


class DecoderLayer(nn.Module):
    """The decoder layer of target and draft alike: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attn: Attention, hidden: int, inter: int, eps: float, mlp_bias: bool = False):
        super().__init__()
        self.self_attn = attn
        self.mlp = SwiGLU(hidden, inter, mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


Mix = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


def run_stack(layers: Sequence[nn.Module], x: torch.Tensor, final_norm: RMSNorm, mix: Mix,
              feature_layers: Sequence[int] = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The forward of a stack of pre-norm decoder layers, the one definition every path runs.

    x [T, H] (embeddings) -> (final-normed hidden [T, H], the concatenated outputs of
    `feature_layers` [T, n*H] or None). `mix(i, layer, h)` is layer i's token mixer on its
    normed input (attention, or a Gated DeltaNet), output projection included: it decides where
    keys, values and recurrent states come from (a sequence's caches, or a training batch's
    context). Each layer then adds its MLP; the residual adds and the next norms are fused."""
    feats: list[Optional[torch.Tensor]] = [None] * len(feature_layers)
    h, residual = add_norm(x, layers[0].input_layernorm)
    for i, layer in enumerate(layers):
        h, residual = add_norm(mix(i, layer, h), layer.post_attention_layernorm, residual)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        h, residual = add_norm(layer.mlp(h), nxt, residual)
        for slot, wanted in enumerate(feature_layers):  # a layer may be listed twice
            if wanted == i:
                feats[slot] = residual
    return h, (torch.cat(feats, dim=-1) if feats else None)  # type: ignore[arg-type]


def cache_attend(inp: ForwardInput, rope: "RotaryTable", causal: bool = True,
                 windows: Optional[Sequence[Optional[int]]] = None) -> Mix:
    """Attention over each sequence's KV cache as a token mixer: the q/k/v and output projections
    run over all of `inp`'s rows (a batch's too: the weights are read once), and for each
    sequence the new rows' keys/values are stored at its cache rows [length, length + T) (not
    committed: the caller decides what to keep) and each new row sees the committed rows plus
    what its `block_mask` (or `causal`, or neither: all) allows among the new ones. `length` is
    a device tensor, so the forward has no host sync and can be captured. A batch's sequences
    share each layer's store and attention launch where they can (ForwardInput.attention_groups),
    else each runs its own."""
    groups = inp.attention_groups([p.cache for p in inp.sequences()])
    positions = split_groups(inp.row_positions(), groups)

    def mix(i: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        qn, kn = attn.norm_weights
        outs = []
        for g, qkv, pos in zip(groups, split_groups(attn.qkv_proj(h), groups), positions):
            k_rows, v_rows = g.cache.layer(i, g.table)
            q = qkv_rope_store(qkv, pos, rope.cos, rope.sin, qn, kn, attn.eps,
                               k_rows, v_rows, g.lengths, attn.heads, attn.kv_heads)
            outs.append(cache_attention(q, k_rows, v_rows, g.lengths, attn.scale,
                                        g.block_mask, causal and g.block_mask is None,
                                        windows[i] if windows is not None else None))
        return attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    return mix
