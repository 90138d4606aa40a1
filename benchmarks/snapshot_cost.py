"""What one prefix-cache snapshot of a long hybrid conversation costs, and where the time goes.

An agent's next turn usually diverges from the live sequence right after the previous prompt
(the client re-renders the assistant's turn), so the engine may snapshot the live state before
it prefills the new tokens: every target KV row, the draft's rows, the recurrent states and
their checkpoints. On a 24 GB card that copy does not fit the device tier and goes to pinned host
memory with a CRC-32. This builds the state the card demonstration holds at its last turn (the
27B hybrid's shape, q4_0 KV, bf16 draft KV, 8 state checkpoints, no weights: a snapshot copies
state, not weights) and times `PrefixCache.save` as the engine calls it, three turns in a row, and
its parts on their own: allocating pinned memory, the device-to-host copies, the CRC-32, and
what a restore from pinned or pageable memory takes. Pinned memory is allocated as the engine has
torch do it (prefix_cache.pin_in_threads), or with `--torch-default-pinning` as torch does by
itself (one cudaHostAlloc).

    python benchmarks/snapshot_cost.py [--tokens 62000] [--kv-type q4_0] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from flashtree.bench.models import draft_config_for, target_config as preset_config
from flashtree.models.dflash import DFlashDraft, DraftConfig
from flashtree.models.loader import target_config
from flashtree.models.qwen35 import HybridCausalLM
from flashtree.runtime.disk_tier import fast_checksum
from flashtree.runtime.prefix_cache import PINNED_ALLOCATION, PrefixCache, pin_in_threads
from flashtree.runtime.sequence import SequenceState
from flashtree.bench.provenance import provenance

DEVICE_TIER = 1_464_336_384  # the card's plan left the device tier this much (card_24g_h200.json)


def build_state(preset: str, tokens: int, kv_type: str, device: torch.device, interval: int) -> SequenceState:
    """The live state after a prompt of `tokens` tokens, prefilled as the engine does it: a state
    checkpoint every `interval` tokens (the last 8 kept) and one at the end."""
    raw = preset_config(preset)
    interval_full = raw["full_attention_interval"]
    raw["layer_types"] = ["full_attention" if (i + 1) % interval_full == 0 else "linear_attention"
                          for i in range(raw["num_hidden_layers"])]
    with torch.device("meta"):
        target = HybridCausalLM(target_config(raw), 16)
        draft = DFlashDraft(DraftConfig.from_hf(draft_config_for(raw)), 16)
    capacity = tokens + 256
    state = SequenceState(target.new_cache(capacity, torch.bfloat16, device, 23, kv_type, kv_type),
                          draft.new_cache(capacity, torch.bfloat16, device), device, 8)
    g = torch.Generator(device=device).manual_seed(0)
    for t in [state.target.k, state.target.v, state.draft.k, state.draft.v, *state.target.states().values()]:
        raw_bytes = t.view(torch.uint8)  # the bytes' values do not matter to a copy or a CRC
        raw_bytes.copy_(torch.randint(0, 256, raw_bytes.shape, generator=g, device=device, dtype=torch.uint8))
    while state.length < tokens:
        state.commit(list(range(min(interval, tokens - state.length))))
        state.checkpoint()
    return state


def seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--tokens", type=int, default=62000)
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--interval", type=int, default=2048, help="--state-checkpoint-interval")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--name", help="the result file's suffix (default: h200 on CUDA, else cpu)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--torch-default-pinning", action="store_true", help="do not call pin_in_threads()")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not args.torch_default_pinning:
        pin_in_threads()
    state = build_state(args.preset, args.tokens, args.kv_type, device, args.interval)
    # the KV rows gathered from their pages once (a device tier's copy), the states as they are
    views = {name: v if isinstance(v, torch.Tensor) else v.clone() for name, v in state.rows(state.length).items()}
    nbytes = sum(v.nbytes for v in views.values())
    pin = device.type == "cuda"
    parts = {
        "alloc_pinned_s" if pin else "alloc_s": seconds(lambda: [torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
                                                                 for v in views.values()], device),
    }
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in views.items()}
    parts["copy_to_host_s"] = seconds(lambda: [host[k].copy_(v) for k, v in views.items()], device)
    parts["crc32_s"] = seconds(lambda: fast_checksum(host), device)
    if pin:  # the other ways: pageable host memory (a restore then goes through staging)
        parts["restore_from_pinned_s"] = seconds(lambda: [v.copy_(host[k], non_blocking=True)
                                                          for k, v in views.items()], device)
        del host
        paged: dict[str, torch.Tensor] = {}
        parts["pageable_alloc_and_copy_s"] = seconds(
            lambda: paged.update({k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in views.items()}), device)
        parts["restore_from_pageable_s"] = seconds(lambda: [v.copy_(paged[k]) for k, v in views.items()], device)
        del paged
    else:
        del host
    cache = PrefixCache(device, 4, DEVICE_TIER, 8 * 1024 ** 3, None, 0, "bench")
    saves = []
    for turn in range(3):  # each turn's state ends in a different completion: a new entry each time
        state.commit([10_000 + turn] * 64)
        saves.append(seconds(lambda: cache.save(state), device))
        state.truncate(args.tokens)
    result = {
        "benchmark": "snapshot_cost", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if pin else "cpu"},
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "pinning": "torch default" if args.torch_default_pinning or not pin else PINNED_ALLOCATION,
        "preset": args.preset, "tokens": args.tokens, "kv_type": args.kv_type,
        "snapshot_bytes": nbytes, "tensors": len(views),
        "parts": parts, "save_s_per_turn": saves, "tiers_after": cache.stats(),
        "save_GBps": [round(nbytes / s / 1e9, 2) for s in saves],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"snapshot_cost_{args.name or ('h200' if pin else 'cpu')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
