"""Several sessions at once on one engine: aggregate tokens/s and per-step latency for 1, 2, 4 ...
sessions whose prompts share a system prompt, each session's generation advanced side by side
with the others (as the server's worker does), against the same sessions run one after another.

Today the live sequences decode in turn (one forward a step per sequence), so the aggregate
tokens/s stays near one session's: what several sessions gain is that none evicts another's
caches, and that a shared system prompt is copied between sequences instead of prefilled. A
batched step (all sequences' trees in one forward) is what would raise the aggregate; this
script is the measure it will be held to.

    python benchmarks/sessions.py --device cuda --sessions 1,2,4 --out benchmarks/results/sessions_embedded.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from flashtree import Engine
from flashtree.runtime.engine import ASSETS


def prompts(count: int, system: int, turn: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts: one shared system prompt of `system` tokens, then each its own turn."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(system)]
    return [shared + [rng.randrange(10, vocab) for _ in range(turn)] for _ in range(count)]


def run(engine: Engine, batch: list[list[int]], tokens: int, side_by_side: bool) -> dict:
    """Generate every prompt of `batch`; side by side (one boundary of each in turn) or one after
    another. Wall seconds, tokens, and the mean seconds between a session's consecutive yields."""
    engine.clear_caches()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    gaps: list[float] = []
    streams = [engine.stream(p, max_tokens=tokens, stop_token_ids=[]) for p in batch]
    if side_by_side:
        live = {i: iter(s) for i, s in enumerate(streams)}
        last = dict.fromkeys(live, t0)
        while live:
            for i, it in list(live.items()):
                if next(it, None) is None:
                    del live[i]
                    continue
                now = time.perf_counter()
                gaps.append(now - last[i])
                last[i] = now
    else:
        for s in streams:
            prev = time.perf_counter()
            for _ in s:
                now = time.perf_counter()
                gaps.append(now - prev)
                prev = now
    wall = time.perf_counter() - t0
    out = sum(len(s.result.token_ids) for s in streams)
    decode_gaps = gaps[len(gaps) // 4:]  # past the prefills
    return {"wall_s": wall, "tokens": out, "tokens_per_s": out / wall,
            "mean_gap_ms": 1e3 * sum(decode_gaps) / max(1, len(decode_gaps)),
            "cached_tokens": [s.result.stats.cached_tokens for s in streams]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sessions", default="1,2,4")
    ap.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
    ap.add_argument("--turn", type=int, default=256, help="each session's own prompt tokens")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each session generates")
    ap.add_argument("--mode", default="ddtree")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    engine = Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device=args.device,
                                    mode=args.mode, budget=22, max_ctx=args.system + args.turn + args.tokens + 64,
                                    max_sequences=max(counts))
    vocab = engine.target.config.vocab_size
    run(engine, prompts(1, 64, 16, vocab), 16, False)  # compiles, captures what start-up did not
    rows = []
    for n in counts:
        batch = prompts(n, args.system, args.turn, vocab)
        row = {"sessions": n, "side_by_side": run(engine, batch, args.tokens, True),
               "one_after_another": run(engine, batch, args.tokens, False)}
        rows.append(row)
        print(json.dumps(row))
    result = {"what": "sessions", "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "model": "embedded pair", "mode": args.mode, "system_tokens": args.system, "turn_tokens": args.turn,
              "tokens": args.tokens, "max_sequences": len(engine.sequences), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
