"""Named model shapes (presets.py) with random weights, built directly on the device (benchmarks,
GPU tests), with a draft of the kind asked for: the preset's DFlash draft, a DFlash2 draft of the
published layout on the same shape, or the target's own MTP layer (Qwen3.5-family presets).

Decode speed depends on the shapes, not the values, so a published model's shape with random
bf16 weights measures what the real one would, without reading 16 GB from disk. The weights are
drawn from a seeded device generator in a fixed parameter order, so two processes (ours and a
peer's) built with the same seed hold identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.common import RMSNorm
from ..models.rope import RotaryTable
from ..models.dflash import DFlashDraft
from ..models.dflash2 import DFlash2Draft, draft_config as draft_config_of, new_draft
from ..models.loader import target_config as target_config_of
from ..models.mtp import MTPConfig, MTPDraft
from ..models.quant import GroupQuantized
from ..models.registry import TargetConfig, TargetModel, architecture_of
from ..checkpoint.presets import (PRESETS, check_draft_kind, dflash2_config_for, draft_config,
                                  draft_config_for, target_config)

__all__ = ["PRESETS", "RandomPair", "build_pair", "draft_config", "draft_config_for", "target_config"]

def init_random_(module: nn.Module, seed: int, std: float, head_std: float) -> None:
    """Normal weights (norm scales near 1) from a seeded generator, in parameter-name order."""
    params = dict(module.named_parameters())
    gen = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if p.dim() == 1:
                p.normal_(1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, head_std if name.startswith("lm_head") else std, generator=gen)


def usual_ranges_(module: nn.Module) -> None:
    """After init_random_: zero-centred norms (scale 1 + w) near 1 as the others, and a
    DeltaNet's decays and gates in their usual range."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, RMSNorm) and m.offset:
                m.weight.sub_(m.offset)
        for name, p in module.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.sub_(1.0)


def _on_device(factory, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Construct on the meta device in `dtype`, then allocate (uninitialised) on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    return module.to_empty(device=device)


def kind_of(draft: nn.Module) -> str:
    """A draft module's kind, as `flashtree bench --draft-kind` names it."""
    if isinstance(draft, MTPDraft):
        return "mtp"
    return "dflash2" if isinstance(draft, DFlash2Draft) else "dflash"


def preset_draft(kind: str, tcfg: dict[str, Any], lm: TargetConfig) -> tuple[Any, dict[str, Any]]:
    """The config of a preset's draft of `kind` and the dict a run records of it: the DFlash or
    DFlash2 draft's config.json, or for the target's MTP layer its declaration and block."""
    if kind == "mtp":
        mtp = MTPConfig.of_config(tcfg, lm)  # type: ignore[arg-type]  (check_draft_kind: a hybrid)
        return mtp, {"mtp_num_hidden_layers": tcfg["mtp_num_hidden_layers"], "block_size": mtp.block_size,
                     "target_layer_ids": mtp.target_layer_ids}
    raw = dflash2_config_for(tcfg) if kind == "dflash2" else draft_config_for(tcfg)
    return draft_config_of(raw), raw


@dataclass
class RandomPair:
    preset: str
    target: TargetModel
    draft: DFlashDraft
    target_cfg: dict[str, Any]
    draft_cfg: dict[str, Any]

    @property
    def draft_kind(self) -> str:
        return kind_of(self.draft)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the target's weights: all, and those one decode forward reads (every weight
        but the embedding table, of which it reads a row; with tied embeddings the lm_head reads it
        whole); the draft's own (it reads the target's embedding row and lm_head too)."""
        def size(m: nn.Module) -> int:  # parameters, and a quantized layer's codes, scales, minima (once)
            quantized = {id(b): b for q in m.modules() if isinstance(q, GroupQuantized) for b in q.buffers(recurse=False)}
            return sum(t.numel() * t.element_size() for t in (*m.parameters(), *quantized.values()))
        total = size(self.target)
        read = total if self.target.config.tie_word_embeddings else total - size(self.target.model.embed_tokens)
        return {"target_total": total, "target_read_per_forward": read, "draft": size(self.draft)}


def build_pair(preset: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
               max_pos: int = 40960, seed: int = 0, std: float = 0.02,
               head_std: float = 0.02, draft_kind: str = "dflash") -> RandomPair:
    """The preset's target and a draft of `draft_kind` (presets.DRAFT_KINDS; a preset without an
    MTP layer refuses mtp: ValueError), random: the target from `seed`, the draft from seed + 1,
    so a preset's target is the same whatever its draft."""
    check_draft_kind(preset, draft_kind)
    device = torch.device(device)
    tcfg = target_config(preset)
    lm = target_config_of(tcfg)
    target = _on_device(lambda: architecture_of(lm).model(lm, max_pos), device, dtype)
    if lm.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    init_random_(target, seed, std, head_std)
    usual_ranges_(target)
    target.rope = RotaryTable(lm.rotary_dim, lm.rope, max_pos).to(device)
    dc, dcfg = preset_draft(draft_kind, tcfg, lm)
    draft = _on_device(lambda: new_draft(dc, max_pos), device, dtype)
    init_random_(draft, seed + 1, std, head_std)
    usual_ranges_(draft)
    draft.rope = RotaryTable(dc.rotary_dim, dc.rope, max_pos).to(device)
    return RandomPair(preset, target.eval(), draft.eval(), tcfg, dcfg)
