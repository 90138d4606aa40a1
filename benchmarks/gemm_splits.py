"""How many programs along K should the int4 GEMM run? Its launcher splits K (kernels/
triton_split.py) so that layers with few output tiles still fill the GPU, and adds the float32
partials in the same launch. This times the engine's GEMM (tiled int4, as placed on CUDA, at its
default rows, warps and stages) over every power-of-two split and the launcher's own choice, for
every int4 linear of the 27B and 8B shapes at one row (the AR step) and 23 (a tree's verify),
each call replayed in a CUDA graph over more weight bytes than L2 holds, against the copy
bandwidth of the same run. Totals weight each shape by its layers. Each split's largest
difference from the launcher's default output is recorded (another split sums its partials in
another order). "split_before" is the launcher's rule before 2026-12-03 (about 4 programs an SM,
at least 4 splits, not rounded to a power of two).

Measured on the H200 (results/quant_gemm_h200_splits.json, docs/PERFORMANCE.md).

    python benchmarks/gemm_splits.py [--iters 20] [--models qwen3.5-27b,qwen3-8b]

Writes benchmarks/results/quant_gemm_<device>_splits.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import SHAPES, per_call_us, quant_bytes, tiled_int4_copies  # noqa: E402

from flashtree.bench.measure import ceilings  # noqa: E402
from flashtree.bench.provenance import device_slug, provenance  # noqa: E402
from flashtree.kernels.triton_quant import gemm, gemm_launch, gemm_split  # noqa: E402
from flashtree.kernels.triton_split import MAX_SPLIT, split_for  # noqa: E402

GROUP = 128
ROWS = (1, 23)


def bench(n: int, k: int, bw: float, iters: int) -> dict:
    """One shape's rows: per row count, the launcher's split and each split's time and share of
    the floor."""
    _, weights = tiled_int4_copies(n, k)
    floor_us = quant_bytes(n, k, 4) / bw / 1e3
    out = {}
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        launch = gemm_launch(4, m)
        programs = triton.cdiv(n, launch["block_n"])
        default = gemm_split(4, m, n, k, GROUP, x.device)
        engine = gemm(x, *weights[0], None, 4, GROUP, tiled=True).float()
        row: dict = {"floor_us": floor_us, "programs": programs, "steps": k // GROUP, "default_split": default,
                     "split_before": split_for(None, programs, k // GROUP, x.device, 4, 4)}
        splits = sorted({default, row["split_before"]} | {1 << i for i in range(MAX_SPLIT.bit_length())})
        for split in [s for s in splits if s <= k // GROUP]:
            got = gemm(x, *weights[0], None, 4, GROUP, tiled=True, split=split).float()
            us, _ = per_call_us([lambda w=w, s=split: gemm(x, *w, None, 4, GROUP, tiled=True, split=s)
                                 for w in weights], iters)
            row[f"split {split}"] = {"us": us, "of_floor": floor_us / us,
                                     "max_abs_diff": (got - engine).abs().max().item()}
        out[f"M{m}"] = row
    return out


def totals(rows: dict, layers: dict) -> dict:
    """Per model and row count, ms over a step's int4 linears: the floor, the launcher's splits,
    the best split of each shape, and each split applied to every shape."""
    out: dict = {}
    for key, row in rows.items():
        model, name, m = key.split(" ")
        t = out.setdefault(f"{model} {m}", {})
        times = {s: v["us"] for s, v in row.items() if s.startswith("split ")}
        scale = layers[model][name] / 1e3
        t["floor"] = t.get("floor", 0.0) + scale * row["floor_us"]
        t["default"] = t.get("default", 0.0) + scale * times[f"split {row['default_split']}"]
        t["before"] = t.get("before", 0.0) + scale * times[f"split {row['split_before']}"]
        t["best of each shape"] = t.get("best of each shape", 0.0) + scale * min(times.values())
        for s, us in times.items():
            t[s] = t.get(s, 0.0) + scale * us
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", default="qwen3.5-27b,qwen3-8b")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    ceil = ceilings()
    out = {**provenance(), "ceilings": ceil, "rows": {}}
    models = args.models.split(",")
    for model in models:
        for name, n, k, _ in SHAPES[model]:
            for m, row in bench(n, k, ceil["copy_bandwidth_GBps"], args.iters).items():
                out["rows"][f"{model} {name} {m}"] = row
                print(model, name, m, "default", row["default_split"],
                      {s: round(v["us"], 2) for s, v in row.items() if s.startswith("split ")}, flush=True)
    layers = {model: {name: count for name, _, _, count in SHAPES[model]} for model in models}
    out["totals_ms"] = totals(out["rows"], layers)
    for key, t in out["totals_ms"].items():
        print(key, {s: round(v, 3) for s, v in t.items()})
    path = args.out / f"quant_gemm_{device_slug()}_splits.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
