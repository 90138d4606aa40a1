"""Does prefetching the next linear's weights into L2, while the small kernels between two linears
run, shorten a decode forward? A stand-in of the 27B int4 forward's linears: each layer's four
int4 GEMMs (tiled, groups of 128, the engine's launch) with small kernels between them that read
almost nothing (what RMSNorm, the DeltaNet scan and SiLU cost in time, not in bytes), replayed as
one CUDA graph over more layers than L2 holds. Variants:
- "base": GEMMs and small kernels;
- "prefetch P MB, a kernel": after each GEMM a small kernel issues bulk L2 prefetches
  (kernels/triton_prefetch.py) of the next GEMM's first P MB of codes, and the small kernels
  run while they fill L2;
- "prefetch P MB, in the GEMM": the GEMM's programs issue them as they end (no launch);
- "linears alone": no small kernels (what the gaps cost).

    python benchmarks/l2_prefetch.py [--rows 1,23] [--layers 12] [--gap-kernels 1,3] [--iters 30]

Writes benchmarks/results/l2_prefetch_<device>.json: each variant's time a layer and its share of
the floor, the layer's weight bytes at the copy bandwidth measured in the same run."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import make_weights  # noqa: E402

from flashtree.kernels.reference import tile_int4  # noqa: E402
from flashtree.kernels.triton_prefetch import prefetch_l2  # noqa: E402
from flashtree.kernels.triton_quant import gemm  # noqa: E402
from flashtree.bench.measure import ceilings, device_ms  # noqa: E402
from flashtree.bench.provenance import device_slug  # noqa: E402

LAYER = [("deltanet_in", 16480, 5120), ("deltanet_out", 5120, 6144), ("gate_up", 34816, 5120),
         ("down", 5120, 17408)]
def gap(small: torch.Tensor, kernels: int) -> None:
    for _ in range(kernels):
        small.mul_(1.0001).add_(0.0001)


def forward(x: torch.Tensor, weights: list, small: torch.Tensor, gap_kernels: int, prefetch_mb: float,
            fused: bool) -> None:
    for i, (w, n, k) in enumerate(weights):
        ahead = (weights[i + 1][0][0], int(prefetch_mb * 2**20)) if prefetch_mb and i + 1 < len(weights) else None
        gemm(x[:, :k], *w, None, 4, 128, tiled=True, prefetch=ahead if fused else None)
        if ahead is not None and not fused:
            prefetch_l2(*ahead)
        gap(small, gap_kernels)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,23")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--gap-kernels", default="1,3", help="pairs of small kernels between two GEMMs, comma-separated")
    p.add_argument("--prefetch-mb", default="4,8,16,32")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    weights = []
    for _ in range(args.layers):
        for name, n, k in LAYER:
            weights.append((tile_int4(*make_weights(n, k, 4, 1)[0]), n, k))
    small = torch.zeros(2048, device="cuda")
    layer_bytes = sum(t.numel() * t.element_size() for w, _, _ in weights[:len(LAYER)] for t in w)
    ceiling = ceilings()
    floor_us = layer_bytes / ceiling["copy_bandwidth_GBps"] / 1e3  # a layer's weights at the copy bandwidth
    out = {"device": torch.cuda.get_device_name(), "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size,
           "ceilings": ceiling, "layer_weight_bytes": layer_bytes, "layer_floor_us": floor_us,
           "layers": args.layers, "runs": {}}
    for rows, gaps in itertools.product([int(r) for r in args.rows.split(",")],
                                        [int(g) for g in args.gap_kernels.split(",")]):
        x = torch.randn(rows, 17408, device="cuda", dtype=torch.bfloat16)
        variants = {"base": (gaps, 0.0, False), "linears alone": (0, 0.0, False)}
        for mb in args.prefetch_mb.split(","):
            variants[f"prefetch {mb} MB, a kernel"] = (gaps, float(mb), False)
            variants[f"prefetch {mb} MB, in the GEMM"] = (gaps, float(mb), True)
        res = {}
        for name, (gk, mb, fused) in variants.items():
            forward(x, weights, small, gk, mb, fused)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward(x, weights, small, gk, mb, fused)
            us = 1000 * device_ms(graph.replay, args.iters) / args.layers
            res[name] = {"us_a_layer": us, "of_floor": floor_us / us}
            print(f"rows {rows}, gap pairs {gaps}, {name}: {us:.2f} us a layer ({floor_us / us:.0%} of the floor)",
                  flush=True)
        out["runs"][f"rows {rows}, gap pairs {gaps}"] = res
    path = Path(__file__).resolve().parent / "results" / f"l2_prefetch_{device_slug()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
