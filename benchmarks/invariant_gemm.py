"""The deterministic mode's dense linear (kernels/triton_invariant.py) over launches: which fixed
tile, K step, warps, stages and split of K stream the 8B's bf16 weights fastest at one row (an AR
step), 23 (a tree's verify) and 128 (a prefill slice), beside cuBLAS (torch's linear, whose tiles
follow the row count) in the same run, and the weights' bytes over the copy bandwidth (the floor).

Each call is replayed in a CUDA graph over copies of the weights larger than L2 together; totals
weight each shape by its layers (the lm_head once). Every launch is checked for what the mode
promises: a row's bits are the same at every row count.

    python benchmarks/invariant_gemm.py [--iters 20] [--quick]

Writes benchmarks/results/invariant_gemm_<device>.json."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import per_call_us  # noqa: E402

import flashtree.kernels as kernels  # noqa: E402
from flashtree.bench.measure import ceilings  # noqa: E402
from flashtree.bench.provenance import device_slug, provenance  # noqa: E402
from flashtree.kernels.triton_invariant import DET_LAUNCH, InvariantLaunch, invariant_linear  # noqa: E402

SHAPES = [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
          ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1)]  # Qwen3-8B: name, out, in, layers
ROWS = (1, 23, 128)
L2_BYTES = 60e6
# (launch, kernels.DET_SPLIT_K); the first is the engine's
SWEEP = [(DET_LAUNCH, kernels.DET_SPLIT_K)] + [
    (InvariantLaunch(block_n=n, block_k=k, warps=w, stages=s, programs=p), split) for n, k, w, s, p, split in (
        (64, 64, 4, 3, 1 << 20, 1024), (64, 64, 4, 3, 1 << 20, 2048), (64, 64, 4, 3, 256, 1024),
        (64, 64, 4, 3, 512, 1024), (64, 64, 4, 4, 384, 1024), (64, 128, 4, 3, 384, 1024),
        (64, 128, 4, 4, 384, 1024), (128, 64, 4, 3, 384, 1024), (128, 128, 8, 3, 384, 1024))]


def time_launch(cfg: InvariantLaunch | None, split_k: int, iters: int, rows: tuple[int, ...]) -> dict:
    """Per shape and row count: microseconds a call (cfg None: cuBLAS) and whether a row's bits
    held at every row count."""
    kernels.DET_SPLIT_K = split_k
    out = {}
    for name, n, k, _ in SHAPES:
        copies = max(2, int(L2_BYTES // (n * k * 2)) + 1)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]

        def linear(x, w):
            return F.linear(x, w) if cfg is None else invariant_linear(x, w, None, cfg)

        x_all = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
        first = linear(x_all[:1], weights[0])
        per = {}
        for m in rows:
            x = x_all[:m].contiguous()
            us, _ = per_call_us([lambda w=w: linear(x, w) for w in weights], iters)
            per[str(m)] = {"us": us, "row_invariant": bool(torch.equal(linear(x, weights[0])[:1], first))}
        out[name] = per
        del weights
    return out


def totals(shapes: dict, rows: tuple[int, ...]) -> dict:
    layers = {name: count for name, _, _, count in SHAPES}
    return {str(m): sum(shapes[name][str(m)]["us"] * layers[name] for name in layers) / 1e3 for m in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="the engine's launch and cuBLAS only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    ceiling = ceilings()
    bw = ceiling["copy_bandwidth_GBps"]
    floor_ms = {str(m): sum((n * k * 2 + m * (n + k) * 2) * count for _, n, k, count in SHAPES) / bw / 1e6
                for m in ROWS}
    cublas = time_launch(None, kernels.DET_SPLIT_K, args.iters, ROWS)
    result = {"device": torch.cuda.get_device_name(), **provenance(), "ceilings": ceiling, "floor_ms": floor_ms,
              "cublas": {"shapes": cublas, "total_ms": totals(cublas, ROWS)}, "launches": []}
    print(f"floor ms {floor_ms}  cuBLAS ms {result['cublas']['total_ms']}")
    for cfg, split_k in SWEEP[:1] if args.quick else SWEEP:
        shapes = time_launch(cfg, split_k, args.iters, ROWS)
        row = {"launch": dataclasses.asdict(cfg), "split_k": split_k, "engine": (cfg, split_k) == SWEEP[0],
               "shapes": shapes, "total_ms": totals(shapes, ROWS),
               "row_invariant": all(r["row_invariant"] for per in shapes.values() for r in per.values())}
        result["launches"].append(row)
        print(row["launch"], split_k, {m: round(v, 3) for m, v in row["total_ms"].items()},
              "invariant" if row["row_invariant"] else "NOT INVARIANT", flush=True)
    name = device_slug()
    path = Path(args.out) / f"invariant_gemm_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
