"""DFlash block-diffusion draft, weight- and config-compatible with the z-lab drafts.

The draft has no embedding and no lm_head: it borrows the target's. Its input is a noise block
[bonus, MASK x (bs-1)], embedded by the target (a ForwardInput's `embeds`), and the target's
hidden states ("context features") of the committed positions. Each layer's queries come from
the block only; keys/values come from the context (projected once, cached) and the block,
through the same k/v projections; no causal mask, so the block is predicted jointly in one
forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..config import MAX_BLOCK_SIZE
from ..errors import CheckpointError
from ..kernels.fused import qkv_rope_store
from .common import (Attention, DecoderLayer, LayerShape, Mix, RMSNorm, cache_attend, check_whole_head_rope,
                     int_problem, run_stack)
from .inputs import ForwardInput, split_groups
from .rope import RotaryTable
from .quant import linear_rows
from .kv_cache import KVCache, PoolArg
from ..checkpoint.presets import default_target_layer_ids


LAYER_TYPES = ("full_attention", "sliding_attention")
_REQUIRED = object()


@dataclass(frozen=True)
class DraftKeys:
    """A draft's config.json as the DFlash and DFlash2 readers take it, one rule for both: a
    key from `dflash_config` (which must be an object), else the top level; a key missing or
    out of its range is a CheckpointError naming it (`kind`: "draft", "DFlash2 draft")."""

    cfg: dict[str, Any]
    kind: str

    @property
    def dflash(self) -> dict[str, Any]:
        found = self.cfg.get("dflash_config") or {}
        if not isinstance(found, dict):
            raise self.fail("dflash_config", f"must be an object, found {found!r}")
        return found

    def fail(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{key}: {problem}")  # the loader names the file

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        for d in (self.dflash, self.cfg):
            if d.get(key) is not None:
                return d[key]
        if default is _REQUIRED:
            raise self.fail(f"dflash_config.{key}", f"missing (a {self.kind} needs it)")
        return default

    def name(self, key: str) -> str:
        """How an error names `key`: where value() finds it."""
        return f"dflash_config.{key}" if self.dflash.get(key) is not None else key

    def count(self, key: str, found: Any, lowest: int = 1, highest: Optional[int] = None) -> int:
        """`found`, the value of `key`: an integer (common.int_problem) of at least `lowest` and,
        where given, at most `highest`."""
        if found is None:
            raise self.fail(key, f"missing (a {self.kind} needs it)")
        problem = int_problem(found, key) or (f"must be at least {lowest}, found {found}" if found < lowest else None)
        if not problem and highest is not None and found > highest:
            problem = f"must be at most {highest}, found {found}"
        if problem:
            raise self.fail(key, problem)
        return found

    def windows(self, types: Any, layers: int) -> list[Optional[int]]:
        """Each layer's attention window (None: full attention) from its `layer_types`: a list of
        one of LAYER_TYPES a layer, the window (`sliding_window`, at least 1) given where a layer
        slides. What else was accepted ran those layers unwindowed, or as none."""
        if not isinstance(types, list) or len(types) != layers:
            raise self.fail("layer_types", f"must list num_hidden_layers ({layers}) layer types, found {types!r}")
        unknown = [t for t in types if t not in LAYER_TYPES]
        if unknown:
            raise self.fail("layer_types", f"{unknown!r} not among {', '.join(LAYER_TYPES)}")
        if "sliding_attention" not in types:
            return [None] * layers
        window = self.count("sliding_window", self.cfg.get("sliding_window"))
        return [window if t == "sliding_attention" else None for t in types]


@dataclass
class DraftConfig(LayerShape):
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    sliding_windows: list[Optional[int]]  # per layer: None = full attention

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "DraftConfig":
        """A DFlash draft's config; its layers' types, when not given, all full attention."""
        return cls(**draft_fields(DraftKeys(cfg, "draft"), lambda layers: ["full_attention"] * layers))

    @property
    def rotary_dim(self) -> int:
        """RoPE turns every dimension of a head (a partial_rotary_factor is refused where it would
        not: common.check_whole_head_rope)."""
        return self.head_dim

    def fit_problems(self, target: Any) -> list[str]:
        """Why this draft cannot run against the target of config `target` (none: it can): its
        width, the target layers it reads, its mask token. read_configs refuses a pair with any,
        so `flashtree plan` does too."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers")
        if self.num_target_layers and self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_layers}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target vocabulary "
                            f"(size {target.vocab_size})")
        return problems


def draft_fields(keys: DraftKeys, absent_types: Callable[[int], list[str]]) -> dict[str, Any]:
    """The fields every DFlash draft's config has, under DraftKeys' rules: a block of at least 2
    (the bonus and one proposed token: a block of 1 proposes nothing), target layer ids (from
    dflash_config, else the top level, as every DFlash key) that are a non-empty list of
    integers (an empty one passed, and made a draft of no context: its fc of no inputs was
    refused only as the weights loaded, as a shape naming no key; ids past the target's layers:
    DraftConfig.fit_problems), a mask token that is an integer, and the layers' windows
    (`layer_types`; absent: `absent_types(layers)`)."""
    cfg = keys.cfg
    try:
        shape = LayerShape.fields_from_hf(cfg)
        check_whole_head_rope(cfg, shape)
        layers = shape["num_layers"]
        types = cfg.get("layer_types")
        n_target = 0 if cfg.get("num_target_layers") is None else keys.count("num_target_layers",
                                                                              cfg["num_target_layers"])
        ids, ids_key = keys.value("target_layer_ids", None), keys.name("target_layer_ids")
        if ids is None:
            if not n_target:
                raise keys.fail("dflash_config.target_layer_ids", f"missing, and so is num_target_layers "
                                                                  f"(a {keys.kind} needs one of them)")
            ids = default_target_layer_ids(n_target, layers)
        if not isinstance(ids, list) or not ids:
            raise keys.fail(ids_key, f"must be a list of at least one layer id, found {ids!r} (the draft drafts "
                                     "from the target's hidden states at those layers: with none, from nothing)")
        return dict(shape, num_target_layers=n_target,
                    block_size=keys.count(keys.name("block_size"), keys.value("block_size", 16), lowest=2,
                                          highest=MAX_BLOCK_SIZE),
                    target_layer_ids=[keys.count(ids_key, i, lowest=0) for i in ids],
                    mask_token_id=keys.count(keys.name("mask_token_id"), keys.value("mask_token_id"), lowest=0),
                    sliding_windows=keys.windows(absent_types(layers) if types is None else types, layers))
    except KeyError as e:
        raise keys.fail(e.args[0], f"missing (a {keys.kind} needs it)") from None


def draft_layer(c: DraftConfig) -> DecoderLayer:
    attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                     True, c.rms_norm_eps)
    return DecoderLayer(attn, c.hidden_size, c.intermediate_size, c.rms_norm_eps)


class DFlashDraft(nn.Module):
    def __init__(self, c: DraftConfig, max_pos: int):
        super().__init__()
        self.config = c
        self.layers = nn.ModuleList(draft_layer(c) for _ in range(c.num_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RotaryTable(c.head_dim, c.rope, max_pos)

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str,
                  kv_type: Optional[str] = None, pool: PoolArg = None) -> KVCache:
        """Context K/V rows of every layer, K and V stored as `kv_type` says (None/auto: dtype),
        in `pool`'s pages (models/kv_cache.py: a pool shared with other sequences, or its rows)."""
        c = self.config
        return KVCache(c.num_layers, capacity, c.num_kv_heads, c.head_dim, dtype, device, kv_type, pool=pool)

    def write_context(self, inp: ForwardInput) -> None:
        """Project committed positions' target features `inp.embeds` [T, n*H] into every layer's
        K/V rows [length, length + T) of `inp.cache` (the caller commits them), at
        `inp.row_positions()`.

        Context K/V do not depend on earlier draft layers (each layer sees the same context
        vectors), so they are computed once per committed position and never again. A batch
        (ForwardInput.batch: several sequences' rows) projects all rows at once and stores each
        sequence's in its cache, one store a layer where they can share it (attention_groups)."""
        ctx = self.hidden_norm(self.fc(inp.embeds))
        groups = inp.attention_groups([p.cache for p in inp.sequences()])  # type: ignore[misc]
        positions = split_groups(inp.row_positions(), groups)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kv_proj = linear_rows(attn.qkv_proj, ctx, attn.kv_rows())
            for g, rows, pos in zip(groups, split_groups(kv_proj, groups), positions):
                qkv_rope_store(rows, pos, self.rope.cos, self.rope.sin, None, attn.k_norm.weight,
                               attn.eps, *g.cache.layer(i, g.table), g.lengths, 0, attn.kv_heads)

    def stack(self, block_emb: torch.Tensor, mix: Mix) -> torch.Tensor:
        """The draft's layers over block embeddings, attending through `mix`."""
        hidden, _ = run_stack(self.layers, block_emb, self.norm, mix)
        return hidden

    def forward(self, inp: ForwardInput) -> torch.Tensor:
        """Predict a block: `inp.embeds` [bs, H] (target embeddings of [bonus, MASK...]) at
        `inp.row_positions()` (length + [0, bs) unless given), attending to the committed context
        rows of `inp.cache` and the whole block: no causal mask, whatever `inp.block_mask` says,
        since the block is predicted jointly. Returns final-normed hidden [bs, H]."""
        attend = cache_attend(replace(inp, block_mask=None), self.rope, False, self.config.sliding_windows)
        return self.stack(inp.embeds, attend)

