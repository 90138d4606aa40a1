"""`flashtree plan`: the engine's memory plan for a configuration, from the config.json files (or
a GGUF header) alone, before anyone downloads a GPU's worth of weights to find out it does not
fit. It prints every item's bytes, the total against the card, a verdict and the largest
--max-ctx that fits; exit status 0 when it fits, 1 when not. With no checkpoint at hand,
--preset plans a published shape (flashtree.checkpoint.presets, the table `flashtree bench` builds
from) with its matching DFlash draft, as a directory holding those config.json files would be.

This module is imported when the CLI builds its parser, so torch and the models are imported only
when the command runs (meta-device instances count the weights: no weight is read).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from ..checkpoint.presets import PRESETS
from ..config import MTP_DRAFT, EngineConfig, add_dataclass_flags, dataclass_from_args

if TYPE_CHECKING:
    from ..models.dflash import DraftConfig
    from ..models.registry import TargetConfig

# EngineConfig fields that do not change the device memory plan
NOT_PLANNED = ("device", "threads", "cache_dir", "host_cache_bytes", "disk_cache_bytes", "chain_seed", "dflash2_tree",
               "cache_min_tokens", "cache_min_fraction", "prefill_ubatch_floor", "state_checkpoint_interval", "prefix_cache_slots")


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the memory plan of a configuration without loading any weight")
    add_dataclass_flags(p, EngineConfig, skip=NOT_PLANNED)
    p.add_argument("--preset", choices=list(PRESETS), metavar="NAME",
                   help="plan a published shape instead of --target/--draft, no checkpoint needed: its "
                        "target and the matching 5-layer DFlash draft; one of " + ", ".join(PRESETS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the device the plan is for; cpu plans float32 and the CPU attention's score "
                        "buffers (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run_plan)


class Models(NamedTuple):
    """What a plan is for: the names it prints, the configurations it counts, the decode mode,
    and the GGUF file whose tensors are counted as stored (None for a checkpoint directory)."""
    target: str
    draft: Optional[str]
    raw: dict[str, Any]
    lm: "TargetConfig"
    draft_cfg: Optional["DraftConfig"]
    mode: str
    gguf: Optional[Path]
    draft_gguf: Optional[Path] = None


def read_models(cfg: EngineConfig, preset: Optional[str]) -> Models:
    """A preset's target config and its DFlash draft's (none under --mode ar), or the configs of
    --target and --draft (the embedded pair by default), as the engine would load them."""
    from ..checkpoint import resolve_model
    from ..checkpoint.resolve import model_refs
    from ..errors import ConfigError
    from ..models.dflash import DraftConfig
    from ..models.loader import read_configs, target_config
    from .engine import decode_mode

    if preset is not None:
        if cfg.target is not None or cfg.draft is not None:
            raise ConfigError("--preset names the target and its draft: give it without --target and --draft")
        from ..checkpoint.presets import draft_config, target_config as preset_config

        raw = preset_config(preset)
        draft = DraftConfig.from_hf(draft_config(preset)) if cfg.mode != "ar" else None
        return Models(f"preset {preset}", "the preset's DFlash shape" if draft else None, raw, target_config(raw),
                      draft, cfg.mode, None)
    target_ref, draft_ref = model_refs(cfg.target, cfg.draft)
    # a directory (of a repo id: its config.json alone is fetched) or a GGUF file, whose header alone is read
    target = resolve_model(target_ref, cfg.offline, config_only=True)
    mode = decode_mode(cfg.mode, draft_ref)
    mtp = mode != "ar" and draft_ref == MTP_DRAFT
    draft_dir = (target if mtp else resolve_model(draft_ref, cfg.offline, config_only=True)
                 ) if mode != "ar" and draft_ref else None
    raw, lm, draft = read_configs(target, draft_dir, mtp)
    return Models(str(target), str(draft_dir) if draft_dir else None, raw, lm, draft, mode,
                  target if target.is_file() else None, draft_dir if draft_dir and draft_dir.is_file() else None)


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint.weights import pick_dtype
    from ..errors import ConfigError
    from .memory_plan import (CUDA_CONTEXT_ESTIMATE, GiB, auto_settings, available_memory, largest_max_ctx,
                              planner, smaller_settings)

    cfg = dataclass_from_args(EngineConfig, args)
    cfg.validate()
    models = read_models(cfg, args.preset)
    lm, draft_name = models.lm, models.draft
    device = torch.device(args.device)
    dtype = pick_dtype(cfg.dtype, models.raw, device)
    context = CUDA_CONTEXT_ESTIMATE if device.type == "cuda" else 0
    if cfg.gpu_memory is not None:
        available = cfg.gpu_memory - context
    elif device.type == "cpu" or torch.cuda.is_available():
        available = available_memory(device, None)
    else:
        raise ConfigError("no CUDA device here to plan for: pass --gpu-memory (e.g. 24G) or --device cpu")
    plan_for = planner(lm, models.draft_cfg, dtype, device.type, cfg.quantize, available, models.gguf,
                       cfg.quantize_draft, models.draft_gguf)
    ceiling = max(cfg.max_ctx, lm.max_position_embeddings)
    # the largest context for the sequences asked for; without --max-sequences, for one
    one = replace(cfg, max_sequences=cfg.max_sequences or 1)
    best = largest_max_ctx(one, plan_for, ceiling) if available is not None else None
    cfg = auto_settings(cfg, plan_for, device.type)
    plan = plan_for(cfg)
    about = {"target": models.target, "draft": draft_name, "preset": args.preset, "device": device.type,
             "dtype": str(dtype).removeprefix("torch."), "max_ctx": cfg.max_ctx, "max_sequences": cfg.max_sequences,
             "mode": models.mode,
             "k_type": cfg.kv_type, "v_type": cfg.v_type or cfg.kv_type, "quantize": cfg.quantize,
             "quantize_draft": cfg.quantize_draft, "draft_kv_type": cfg.draft_kv_type if draft_name else None,
             "prefill_ubatch": plan.layout.prefill_ubatch,
             "gpu_memory": cfg.gpu_memory, "cuda_context_estimate": context if cfg.gpu_memory else None,
             "largest_max_ctx": best}
    if args.json:
        print(json.dumps({**about, **plan.to_json()}))
        return 0 if plan.fits else 1
    print(f"memory plan: {models.target}" + (f" + draft {draft_name}" if draft_name else " (no draft)")
          + f", {about['dtype']} on {device.type}, --max-ctx {cfg.max_ctx}, --max-sequences "
          f"{cfg.max_sequences}, K {about['k_type']} / "
          f"V {about['v_type']}" + (f", --quantize {cfg.quantize}" if cfg.quantize else "")
          + (f", --quantize-draft {cfg.quantize_draft}" if cfg.quantize_draft and draft_name else "")
          + (f", --draft-kv-type {cfg.draft_kv_type}" if cfg.draft_kv_type != "auto" and draft_name else ""))
    print(plan.describe())
    if cfg.gpu_memory is not None:
        print(f"  (available = --gpu-memory {cfg.gpu_memory / GiB:.3f} GiB"
              + (f" - {context / GiB:.3f} GiB estimated for the CUDA context)" if context else ")"))
    if available is None:
        print("verdict: unknown (no memory figure on this host; pass --gpu-memory)")
        return 0
    if plan.fits:
        print(f"verdict: fits, {(available - plan.required) / GiB:.3f} GiB to spare before the prefix cache's "
              f"device tier; the largest --max-ctx that fits: {best}")
        return 0
    print(f"verdict: does not fit, short by {(plan.required - available) / GiB:.3f} GiB; "
          + (f"the largest --max-ctx that fits with these settings: {best}" if best
             else "no --max-ctx fits with these settings (try " + ", ".join(smaller_settings(plan, cfg)) + ")"))
    return 1
