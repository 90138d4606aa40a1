"""`flashtree plan`: the engine's memory plan for a configuration, from the config.json files (or
a GGUF header) alone, before anyone downloads a GPU's worth of weights to find out it does not
fit. It prints every item's bytes, the total against the card, a verdict and the largest
--max-ctx that fits; exit status 0 when it fits, 1 when not.

This module is imported when the CLI builds its parser, so torch and the models are imported only
when the command runs (meta-device instances count the weights: no weight is read).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import EngineConfig, add_dataclass_flags, dataclass_from_args

# EngineConfig fields that do not change the device memory plan
NOT_PLANNED = ("device", "threads", "cache_dir", "host_cache_bytes", "disk_cache_bytes", "chain_seed",
               "cache_min_tokens", "cache_min_fraction", "prefill_ubatch_floor", "state_checkpoint_interval", "prefix_cache_slots")


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the memory plan of a configuration without loading any weight")
    add_dataclass_flags(p, EngineConfig, skip=NOT_PLANNED)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="the device the plan is for; cpu plans float32 and the CPU attention's score "
                        "buffers (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import resolve_model, resolve_model_dir
    from ..checkpoint.resolve import model_refs
    from ..checkpoint.weights import pick_dtype
    from ..errors import ConfigError
    from ..models.loader import read_configs
    from .engine import decode_mode
    from .memory_plan import CUDA_CONTEXT_ESTIMATE, GiB, available_memory, largest_max_ctx, planner

    cfg = dataclass_from_args(EngineConfig, args)
    cfg.validate()
    target_ref, draft_ref = model_refs(cfg.target, cfg.draft)
    # a directory (of a repo id: its config.json alone is fetched) or a GGUF file, whose header alone is read
    target = resolve_model(target_ref, cfg.offline, config_only=True)
    mode = decode_mode(cfg.mode, draft_ref)
    draft_dir = resolve_model_dir(draft_ref, cfg.offline, config_only=True) if mode != "ar" and draft_ref else None
    raw, lm, draft = read_configs(target, draft_dir)
    device = torch.device(args.device)
    dtype = pick_dtype(cfg.dtype, raw, device)
    context = CUDA_CONTEXT_ESTIMATE if device.type == "cuda" else 0
    if cfg.gpu_memory is not None:
        available = cfg.gpu_memory - context
    elif device.type == "cpu" or torch.cuda.is_available():
        available = available_memory(device, None)
    else:
        raise ConfigError("no CUDA device here to plan for: pass --gpu-memory (e.g. 24G) or --device cpu")
    plan_for = planner(lm, draft, dtype, device.type, cfg.quantize, available,
                       target if target.is_file() else None, cfg.quantize_draft)
    plan = plan_for(cfg)
    ceiling = max(cfg.max_ctx, lm.max_position_embeddings)
    best = largest_max_ctx(cfg, plan_for, ceiling) if available is not None else None
    about = {"target": str(target), "draft": str(draft_dir) if draft_dir else None, "device": device.type,
             "dtype": str(dtype).removeprefix("torch."), "max_ctx": cfg.max_ctx, "mode": mode,
             "k_type": cfg.kv_type, "v_type": cfg.v_type or cfg.kv_type, "quantize": cfg.quantize,
             "quantize_draft": cfg.quantize_draft, "draft_kv_type": cfg.draft_kv_type if draft_dir else None,
             "gpu_memory": cfg.gpu_memory, "cuda_context_estimate": context if cfg.gpu_memory else None,
             "largest_max_ctx": best}
    if args.json:
        print(json.dumps({**about, **plan.to_json()}))
        return 0 if plan.fits else 1
    print(f"memory plan: {target}" + (f" + draft {draft_dir}" if draft_dir else " (no draft)")
          + f", {about['dtype']} on {device.type}, --max-ctx {cfg.max_ctx}, K {about['k_type']} / "
          f"V {about['v_type']}" + (f", --quantize {cfg.quantize}" if cfg.quantize else "")
          + (f", --quantize-draft {cfg.quantize_draft}" if cfg.quantize_draft and draft_dir else "")
          + (f", --draft-kv-type {cfg.draft_kv_type}" if cfg.draft_kv_type != "auto" and draft_dir else ""))
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
             else "no --max-ctx fits with these settings (try --kv-type q4_0, --quantize int4)"))
    return 1
