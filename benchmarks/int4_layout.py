"""Does the int4 GEMM's bandwidth depend on where its bytes lie, and on how its loads are issued?
Row major, a 64-row program's step reads 64 scattered 64-byte pieces of codes and 128 scattered
2-byte scales and minima; tiled (kernels/reference.py tile_rows, what the engine places on CUDA
since models/quant.py tile_for_kernels), one contiguous 4 KB of codes and 256 bytes of scales and
minima. This times the engine's GEMM over both layouts on the 27B's linears at M = 1 and 23, at
its default launch and a sweep of launches (rows a program, warps, pipeline stages, split), and
load-only kernels of both layouts (what the access pattern alone allows), against the copy
bandwidth of the same run. Every launch's largest difference from the engine's default output is
recorded: zero where the split along K is the same (the same arithmetic in the same order), a
float32 rounding of the partial sums' order where it is not. `totals` weights each shape by its
layers in a 27B step.

docs/PERFORMANCE.md shows the measurements.

    python benchmarks/int4_layout.py [--iters 20]

Writes benchmarks/results/int4_layout_<device>.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import SHAPES, per_call_us, quant_bytes, rel_err, tiled_int4_copies  # noqa: E402

from flashtree.bench.measure import ceilings  # noqa: E402
from flashtree.bench.provenance import device_slug, provenance  # noqa: E402
from flashtree.kernels.reference import INT4_RUN  # noqa: E402
from flashtree.kernels.reference import quant_linear as reference  # noqa: E402
from flashtree.kernels.triton_int4 import tiled_at  # noqa: E402
from flashtree.kernels.triton_quant import gemm, gemm_launch  # noqa: E402
from flashtree.kernels.triton_split import MAX_SPLIT, split_for, split_range  # noqa: E402

GROUP = 128
# (block_n, num_warps, num_stages, split) beside the default launch; None: the launcher's split
LAUNCHES = [(64, 2, 1, None), (64, 4, 1, None), (64, 2, 2, None), (64, 4, 2, None), (64, 4, 3, None),
            (128, 4, 1, None), (128, 4, 2, None), (128, 8, 1, None), (128, 8, 2, None), (64, 8, 1, None),
            (32, 2, 1, None), (64, 2, 3, None), (128, 4, 3, None), (64, 4, 1, 2), (64, 4, 1, 8)]


@triton.jit
def _load_kernel(C, S, MN, OUT, N, K, BLOCK_N: tl.constexpr, TILED: tl.constexpr):
    """Reads what the GEMM reads (codes, scales, minima) in its grid, order and addresses
    (triton_int4.tiled_at), and does nothing with it but an xor, so that the loads are kept."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    n_steps = K // INT4_RUN
    t_lo, t_hi = split_range(n_steps)
    acc = tl.zeros([BLOCK_N, INT4_RUN // 4], dtype=tl.int32)
    sacc = tl.zeros([BLOCK_N], dtype=tl.int32)
    j = tl.arange(0, INT4_RUN // 4)
    for t in range(t_lo, t_hi):
        w = tl.load(C + tiled_at(rn, N, K // 4, t, INT4_RUN // 4, TILED)[:, None] + j[None, :], mask=n_ok[:, None])
        at = tiled_at(rn, N, n_steps, t, 1, TILED)
        s = tl.load(S + at, mask=n_ok)
        m = tl.load(MN + at, mask=n_ok)
        acc ^= w.to(tl.int32)
        sacc ^= s.to(tl.int16, bitcast=True).to(tl.int32) ^ m.to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(OUT + tl.program_id(1) * N + rn, tl.sum(acc, axis=1) ^ sacc, mask=n_ok)


def load_only(weights: tuple, k: int, block_n: int, split: int, tiled: bool, num_warps: int, num_stages: int,
              sink: torch.Tensor) -> None:
    codes, scale, minimum = weights
    n = scale.shape[0]
    _load_kernel[(triton.cdiv(n, block_n), split)](codes.view(torch.int16), scale, minimum, sink, n, k,
                                                   BLOCK_N=block_n, TILED=tiled, num_warps=num_warps,
                                                   num_stages=num_stages)


def bench(n: int, k: int, m: int, bw: float, iters: int) -> dict:
    layouts = dict(zip(("row", "tiled"), tiled_int4_copies(n, k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    floor_us = quant_bytes(n, k, 4) / bw / 1e3
    engine = gemm(x, *layouts["row"][0], None, 4, GROUP).float()
    want = reference(x.float(), *layouts["row"][0], None, 4, GROUP)
    res: dict = {"floor_us": floor_us, "engine rel_err": rel_err(engine, want),
                 "engine max_abs": engine.abs().max().item()}
    chosen = gemm_launch(4, m)
    default = (chosen["block_n"], chosen["num_warps"], chosen["num_stages"], None)
    for name, weights in layouts.items():
        tiled = name == "tiled"
        for launch in [default] + [c for c in LAUNCHES if c != default]:
            b, w_, s_, sp = launch
            key = f"{name} bn{b}w{w_}s{s_}" + (f"split{sp}" if sp else "") + (" (default)" if launch == default else "")

            def call(c: tuple, b=b, w_=w_, s_=s_, sp=sp, tiled=tiled) -> torch.Tensor:
                return gemm(x, *c, None, 4, GROUP, block_n=b, split=sp, num_warps=w_, num_stages=s_, tiled=tiled)

            try:
                res[f"{key} max_abs_diff"] = (call(weights[0]).float() - engine).abs().max().item()
                res[f"{key} us"], _ = per_call_us([lambda c=c: call(c) for c in weights], iters)
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is recorded
                res[f"{key} error"] = repr(exc)[:200]
    sink = torch.empty(MAX_SPLIT * n, dtype=torch.int32, device="cuda")  # any split's outputs
    for name, weights in layouts.items():
        for b, w_, s_ in ((64, 2, 3), (64, 2, 1), (64, 4, 1), (128, 4, 3), (128, 4, 1)):
            sp = split_for(None, triton.cdiv(n, b), k // GROUP, x.device, 4, 4)
            res[f"load {name} bn{b}w{w_}s{s_} us"], _ = per_call_us(
                [lambda c=c: load_only(c, k, b, sp, name == "tiled", w_, s_, sink) for c in weights], iters)
    for key in [key for key in res if key.endswith(" us")]:
        res[key.replace(" us", " of floor")] = floor_us / res[key]
    return res


LAYERS = {name: layers for name, _, _, layers in SHAPES["qwen3.5-27b"]}


def totals(rows: dict) -> dict:
    """Per row count, milliseconds of every timed variant (and the floor) over a 27B step's int4
    linears, each shape weighted by its layers."""
    out: dict = {}
    for key, row in rows.items():
        name, m = key.rsplit(" ", 1)
        step = out.setdefault(m, {})
        for what, us in [("floor", row["floor_us"])] + [(k[:-3], v) for k, v in row.items() if k.endswith(" us")]:
            step[what] = step.get(what, 0.0) + LAYERS[name] * us / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    ceil = ceilings()
    bw = ceil["copy_bandwidth_GBps"]
    out = {**provenance(), "ceilings": ceil, "rows": {}}
    for name, n, k, _ in SHAPES["qwen3.5-27b"]:
        for m in (1, 23):
            out["rows"][f"{name} M{m}"] = r = bench(n, k, m, bw, args.iters)
            shown = {kk: round(v, 3) for kk, v in r.items() if "of floor" in kk or "err" in kk}
            print(name, m, shown, flush=True)
    out["totals_ms"] = totals(out["rows"])
    for m, t in out["totals_ms"].items():
        print(m, sorted((round(v, 2), what) for what, v in t.items())[:12])
    bad = {key: v for row in out["rows"].values() for key, v in row.items() if key.endswith("diff") and v != 0}
    print("outputs that differ from the engine's default launch (another split along K sums in another order):",
          bad or "none")
    path = args.out / f"int4_layout_{device_slug()}.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
