"""Time to first token for a long agent prompt: cold, warm from the live sequence, and restored
from a device, host or disk snapshot (the disk case after an engine restart).

    python benchmarks/ttft.py [--target DIR --draft DIR | --preset qwen3-8b] [--tokens 17000] [--device cpu|cuda]

`--preset` writes a random-weights checkpoint pair of a bench preset's shape (flashtree bench's
presets, with the embedded model's tokenizer) to a temporary directory and loads it like any
other, so the snapshot sizes and copy times are those of the real model's shape.

Writes benchmarks/results/ttft_<device>_<model>.json. Restores are compared with their ceiling:
the snapshot's bytes over the measured copy rate of the same path (device copy, host->device).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from flashtree import Engine
from flashtree.config import parse_bytes
from flashtree.bench.provenance import provenance


def corpus_ids(engine: Engine, n: int) -> list[int]:
    """A realistic long prompt: Python standard-library source, tokenized."""
    text, stdlib = "", Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        text += f.read_text(errors="ignore")
        if len(text) > n * 6:
            break
    ids = engine.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"only {len(ids)} tokens of corpus; ask for fewer")
    return ids[:n]


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int, str]:
    """Seconds to the first token, prompt tokens served from a cache, and where they came from."""
    hits = {t: s["hits"] for t, s in engine.cache.stats().items()}
    sync(engine)
    t0 = time.perf_counter()
    stream = engine.stream(prompt, max_tokens=1, stop_token_ids=[])
    next(iter(stream))
    sync(engine)
    elapsed = time.perf_counter() - t0
    for _ in stream:
        pass
    cached = stream.result.stats.cached_tokens
    tier = next((t for t, s in engine.cache.stats().items() if s["hits"] > hits[t]), "live" if cached else "none")
    return elapsed, cached, tier


def warm_up(engine: Engine, ids: list[int]) -> None:
    """Run every path once (a prefill, then a decode-sized extension of the live sequence) so that
    one-time costs (kernel compilation and autotuning, CUDA graph capture) stay out of the timings;
    `ids` must share no prefix with the measured prompt."""
    ttft(engine, ids)
    ttft(engine, ids + [ids[0]])


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def copy_rate(device: torch.device, src: str) -> float:
    """Bytes/s of a 256 MiB copy into `device` from `src` ('device' or 'host')."""
    n = 256 << 20
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    source = torch.empty(n, dtype=torch.uint8, device=device if src == "device" else "cpu")
    if src == "host" and device.type == "cuda":
        source = source.pin_memory()
    dst.copy_(source)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best


def write_random_pair(preset: str, device: str, root: Path) -> tuple[str, str]:
    """Save a random pair of `preset`'s shape as real checkpoint directories under `root`."""
    import shutil

    from safetensors.torch import save_file

    from flashtree.bench.models import build_pair
    from flashtree.runtime.engine import ASSETS

    pair = build_pair(preset, device)
    dirs = []
    for name, module, cfg in (("target", pair.target, pair.target_cfg), ("draft", pair.draft, pair.draft_cfg)):
        out = root / name
        out.mkdir(parents=True)
        state = {k: v.contiguous() for k, v in module.state_dict().items() if k != "lm_head.weight"
                 or not cfg.get("tie_word_embeddings")}
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
        dirs.append(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ASSETS / "target" / f, Path(dirs[0]) / f)
    return dirs[0], dirs[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--preset", help="random weights of a bench preset's shape, e.g. qwen3-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, default=17000)
    ap.add_argument("--prefill-ubatch", type=int, default=None,
                    help="default: the memory plan's choice, as the server's (512 before it chose)")
    ap.add_argument("--prefix-cache-bytes", type=parse_bytes, default=parse_bytes("16G"),
                    help="device tier budget: large enough that the device row measures the device tier")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flashtree-ttft-") as scratch:  # a preset's pair is 16 GB
        measure(args, Path(scratch))


def measure(args: argparse.Namespace, scratch: Path) -> None:
    cache_dir = str(scratch / "cache")
    if args.preset:
        args.target, args.draft = write_random_pair(args.preset, args.device or "cuda", scratch / "pair")
    opts = dict(max_ctx=args.tokens + 256, device=args.device, prefill_ubatch=args.prefill_ubatch,
                cache_dir=cache_dir, prefix_cache_slots=4, prefix_cache_bytes=args.prefix_cache_bytes)
    engine = Engine.from_pretrained(args.target, args.draft, **opts)
    prompt = corpus_ids(engine, args.tokens)
    other = prompt[:64] + list(reversed(prompt[64:1064]))  # a sub-agent's diverging prompt
    rows = {}
    warm_up(engine, other[64:600])
    engine.clear_caches()
    rows["cold"] = ttft(engine, prompt)
    rows["warm_live"] = ttft(engine, prompt[:-1] + [prompt[0], prompt[-1]])
    ttft(engine, other)                                   # live state -> device snapshot
    rows["device_snapshot"] = ttft(engine, prompt + [prompt[1]])
    ttft(engine, other)
    engine.cache.drop_device_tier(spill=True)             # every snapshot -> host tier
    rows["host_snapshot"] = ttft(engine, prompt + [prompt[2]])
    del engine
    # an engine whose device and host tiers hold nothing writes its snapshot to disk; then restart
    engine = Engine.from_pretrained(args.target, args.draft, **{**opts, "prefix_cache_slots": 0,
                                                                 "host_cache_bytes": 0})
    ttft(engine, prompt)
    ttft(engine, other)                                   # live state -> disk
    del engine
    engine = Engine.from_pretrained(args.target, args.draft, **opts)
    warm_up(engine, other[64:600])
    rows["disk_snapshot_after_restart"] = ttft(engine, prompt + [prompt[3]])
    snap_bytes = engine.state.bytes_per_token() * args.tokens
    result = {
        "benchmark": "ttft", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "device": str(engine.device),
                    "gpu": torch.cuda.get_device_name() if engine.device.type == "cuda" else None,
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "model": {"path": engine.model_path, "layers": engine.target.config.num_layers,
                  "hidden": engine.target.config.hidden_size, "dtype": str(engine.dtype),
                  "mode": engine.mode},
        "prompt_tokens": args.tokens, "prefill_ubatch": engine.config.prefill_ubatch, "snapshot_bytes": snap_bytes,
        "ceilings": {"device_copy_GBps": copy_rate(engine.device, "device") / 1e9,
                     "host_to_device_GBps": copy_rate(engine.device, "host") / 1e9},
        "ttft_s": {k: round(v[0], 4) for k, v in rows.items()},
        "cached_tokens": {k: v[1] for k, v in rows.items()},
        "served_from": {k: v[2] for k, v in rows.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"ttft_{engine.device.type}_{args.preset or engine.model_id}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ttft_s"], indent=1), json.dumps(result["cached_tokens"]), json.dumps(result["served_from"]),
          file=sys.stdout)


if __name__ == "__main__":
    main()
