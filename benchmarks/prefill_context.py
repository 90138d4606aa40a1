"""How one prefill chunk's time grows with the context it is prefilled over, and where it goes.

The 24 GB card's conversation prefilled its first 52K tokens at about 0.28 s a 512-token chunk,
and each later turn's 5K new tokens at about 1 s a chunk. This prefills a random-weight pair of
the preset's shape (the target quantized as `--quantize` says, the KV cache as `--kv-type`)
through the engine's own prefill step, a chunk at a time, timing every chunk, with a state
checkpoint every 2048 tokens as the engine keeps them; then profiles one chunk at the longest
context: device time by kernel, and the host time around it.

    python benchmarks/prefill_context.py [--tokens 61440] [--quantize int4] [--kv-type q4_0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from flashtree.bench.measure import PairBench
from flashtree.bench.models import build_pair
from flashtree.models.quantize import quantize_model
from flashtree.bench.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--tokens", type=int, default=61440)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--interval", type=int, default=2048, help="--state-checkpoint-interval")
    ap.add_argument("--cap-headroom-mb", type=int, help="also prefill with the allocator capped at the "
                    "uncapped prefill's peak plus this many MiB, counting the allocator's retries")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with torch.inference_mode():
        pair = build_pair(args.preset, "cuda", max_pos=args.tokens + 2 * args.ubatch + 512)
        if args.quantize:
            quantize_model(pair.target, args.quantize)
        pb = PairBench(pair, [22], args.tokens + 2 * args.ubatch, 3, args.kv_type)
        build_s = time.perf_counter() - t0
        dec, state = pb.dec["ddtree"], pb.state
        ids = torch.randint(0, pair.target_cfg["vocab_size"] - 1, (args.tokens + args.ubatch,),
                            generator=torch.Generator().manual_seed(0)).tolist()

        def prefill() -> list[dict[str, float]]:
            state.truncate(0)
            chunks = []
            while state.length < args.tokens:
                start = state.length
                torch.cuda.synchronize()
                c0 = time.perf_counter()
                dec.prefill_chunk(ids[start:start + args.ubatch])
                if state.length % args.interval == 0:
                    state.checkpoint()
                torch.cuda.synchronize()
                chunks.append({"context": start, "ms": round(1000 * (time.perf_counter() - c0), 2)})
            return chunks

        def allocator() -> dict[str, int]:
            stats = torch.cuda.memory_stats()
            return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}

        capped = None
        if args.cap_headroom_mb is not None:  # the allocator capped just above what prefill holds
            before = allocator()
            prefill()
            allowed = torch.cuda.max_memory_reserved() + args.cap_headroom_mb * 2 ** 20
            total = torch.cuda.mem_get_info()[1]
            torch.cuda.set_per_process_memory_fraction(allowed / total)
            mid = allocator()
            chunks = prefill()
            after = allocator()
            torch.cuda.set_per_process_memory_fraction(1.0)
            capped = {"allowed_bytes": allowed, "uncapped_counts": {k: mid[k] - before[k] for k in mid},
                      "capped_counts": {k: after[k] - mid[k] for k in mid},
                      "mean_chunk_ms": round(sum(c["ms"] for c in chunks) / len(chunks), 1)}
        chunks = prefill()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            c0 = time.perf_counter()
            dec.prefill_chunk(ids[state.length:state.length + args.ubatch])
            torch.cuda.synchronize()
            profiled_ms = 1000 * (time.perf_counter() - c0)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.device_type.name == "CUDA":
            kernels[ev.key][0] += ev.device_time_total / 1000
            kernels[ev.key][1] += ev.count
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    by_bucket: dict[int, list[float]] = defaultdict(list)
    for c in chunks:
        by_bucket[c["context"] // 8192 * 8192].append(c["ms"])
    result = {"benchmark": "prefill_context", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              **provenance(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args) | {"out": None},
              "build_s": round(build_s, 1), "capped": capped,
              "mean_chunk_ms_by_context": {k: round(sum(v) / len(v), 1) for k, v in sorted(by_bucket.items())},
              "profiled_chunk": {"context": state.length - args.ubatch, "wall_ms": round(profiled_ms, 1),
                                 "device_ms_total": round(sum(v[0] for v in kernels.values()), 1),
                                 "top_kernels": [{"kernel": k[:120], "ms": round(v[0], 2), "calls": v[1]}
                                                 for k, v in top]},
              "chunks": chunks}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_context_h200.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("build_s", "capped", "mean_chunk_ms_by_context")}, indent=1))


if __name__ == "__main__":
    main()
