"""Quantized linear kernels on the GPU at Qwen3-8B and Qwen3.5-27B layer shapes: our Triton kernels
as the engine routes them (kernels/quant.py kernel_for: the tensor-core GEMM, or for one row of
int8 the GEMV) at M=1 (the AR step) and M=23 (a 22-node tree's verify), int4 and int8 at group 128,
against the bf16 matmul and the copy-bandwidth floor, torch's own int4 kernel (tinygemm,
`aten._weight_int4pack_mm`, what torchao's int4 layout calls) on the same codes, and torchao's and
gemlite's kernels where they import.

    python benchmarks/quant_gemv.py [--quick | --sweep gemm|split|wide|scaled] [--m 1,23] [--iters 20]
        [--bits 4,8] [--group 128] [--tiled] [--models qwen3-8b,qwen3.5-27b,lm_heads] [--name quant_gemv]

--tiled times int4 in the layout the engine loads it in (reference.tile_int4: codes, scales and
minima in blocks of rows, what models/quant.py tile_for_kernels stores); without it int4 is
row-major, which the engine no longer uses but the peers (tinygemm, torchao, gemlite) are fed.

The floor of a call is the bytes it must read (codes, scales, minima, x) divided by the copy
bandwidth measured in the same run (flashtree.bench.measure.ceilings, read + written bytes).
Each timing replays, as one CUDA graph, calls over enough distinct weight copies that they exceed
the L2 cache several times, so no call reads a warm weight and no launch overhead is counted (the
engine replays its decode steps as graphs too); a candidate that cannot be captured is timed
eagerly and marked so. Our kernels are timed at their default launch parameters and over a sweep
(--quick times only ALTERNATIVES: the GEMM beside the routed GEMV for int8's one row;
each configuration is first checked against the definition, and one that is wrong or fails is
recorded with why instead of a time); every configuration's time and the best are recorded per
shape (rows[].ours_sweep, ours_best_config) to set the defaults from.
Correctness: each of our outputs is compared with the float32 definition (dequantize, matmul).

The device has no internet: to compare with the peers, carry wheels built for its torch, e.g.
`pip download torchao gemlite --no-deps -d wheels/` (torchao from the index matching the device's
torch and CUDA, e.g. download.pytorch.org/whl/cu130; gemlite is pure Python/Triton) and
`pip install --no-deps wheels/*` there first. Missing or failing peers are recorded, not fatal.

Writes benchmarks/results/<name>_<device>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from flashtree.bench.measure import ceilings, device_ms
from flashtree.bench.provenance import device_slug
from flashtree.kernels.quant import kernel_for
from flashtree.kernels.reference import quant_linear as reference
from flashtree.kernels.reference import tile_int4
from flashtree.kernels.reference import unpack_codes
from flashtree.kernels.triton_gemv import gemv
from flashtree.kernels.triton_quant import gemm

GROUP, L2_MULTIPLE = 128, 4
# (name, out_features N, in_features K, layers of the model that hold it)
SHAPES = {
    "qwen3-8b": [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
                 ("down", 4096, 12288, 36)],
    "qwen3.5-27b": [("attn_qkv", 14336, 5120, 16), ("attn_o", 5120, 6144, 16),
                    ("deltanet_in", 16480, 5120, 48), ("deltanet_out", 5120, 6144, 48),
                    ("gate_up", 34816, 5120, 64), ("down", 5120, 17408, 64)],
    # each model's lm_head, int8 under --quantize int4 too (models/quant.py HEAD_KIND); no step total
    "lm_heads": [("qwen3-8b", 151936, 4096, 1), ("qwen3.5-27b", 248320, 5120, 1)],
}
STEP_MODELS = [model for model in SHAPES if model != "lm_heads"]  # whose SHAPES are a decode step's linears
# The GEMV (kernels/triton_gemv.py): rows a program, words a row an iteration, warps, split (None:
# the launcher's choice, about two programs an SM), iterations loaded ahead. Placing int4
# nibbles directly (a float op less a code) was no faster, and was dropped.
GEMV_SWEEP = [dict(kernel="gemv", block_n=b, block_words=bw, num_warps=w, split=sp, num_stages=st)
              for b, bw, w, sp, st in (
    (16, 128, 4, None, 1), (16, 128, 4, None, 2), (16, 128, 4, None, 3), (16, 128, 4, None, 4),
    (32, 128, 4, None, 3), (8, 128, 4, None, 3), (16, 64, 4, None, 4), (16, 256, 4, None, 2),
    (16, 128, 4, 2, 3), (32, 128, 8, None, 3), (16, 128, 2, None, 4), (32, 128, 2, None, 3))]
GEMM_SWEEP = [dict(block_n=b, num_warps=w, num_stages=st, split=sp, asm=a) for b, w, st, sp, a in (
    (64, 4, 3, None, False), (64, 4, 5, None, False), (128, 8, 4, None, False), (128, 8, 3, None, False),
    (128, 8, 5, None, False), (64, 4, 4, 1, False), (64, 4, 4, 2, False), (64, 4, 4, None, True),
    (128, 8, 4, None, True), (64, 4, 3, 2, True))]
# Run even with --quick: for int8's one row the GEMM at its defaults beside the routed GEMV (int4's
# one row is routed to the GEMM: skipped as ours_default). "kernel" names the launcher.
ALTERNATIVES = {1: [dict(kernel="gemm")], 23: []}
KERNELS = {"gemv": gemv, "gemm": gemm}
# --sweep gemm: the GEMM's launches alone, as the AR step's kernel (M = 1) and as verify's
GEMM_AR_SWEEP = [dict(kernel="gemm", asm=True, block_n=b, num_warps=w, num_stages=st)
                 for b, w, st in itertools.product((16, 32), (1, 2), (3, 4))]
GEMM_TREE_SWEEP = [dict(asm=True, block_n=b, num_warps=w, num_stages=st)
                   for b, w, st in itertools.product((32, 64), (2, 4), (3, 4))]
# --sweep split: the GEMM with more programs along K than its launcher picks (float32 partials
# that the tile's last program adds: kernels/triton_split.py), so that more warps share an SM.
# Its sweeps are what GEMM_LAUNCH was picked from.
GEMM_AR_SPLIT_SWEEP = [dict(kernel="gemm", asm=True, block_n=b, num_warps=w, num_stages=st, split=sp)
                       for b, w, st, sp in ((64, 2, 3, 2), (64, 2, 3, 8), (32, 2, 4, 4), (64, 4, 3, 4))]
GEMM_TREE_SPLIT_SWEEP = [dict(asm=True, block_n=b, num_warps=w, num_stages=st, split=sp)
                         for b, w, st, sp in ((64, 2, 3, 2), (64, 2, 3, 8), (128, 4, 3, None), (64, 4, 3, 4))]
# --sweep wide: verify's GEMM on wider weight tiles, x's columns (loaded by every program from L2,
# at a tree's rows as many bytes as a 128-row tile's int4 codes) shared by more rows of W
GEMM_WIDE_SWEEP = [dict(asm=True, block_n=b, num_warps=w, num_stages=st)
                   for b, w, st in itertools.product((128, 256), (4, 8), (2, 3, 4))]
# int8 above one row: its codes scaled into weights or its per-group epilogue (kernels/triton_quant.py
# INT8_SCALED_BELOW picks by group), to time both at any --group
GEMM_SCALED_SWEEP = [dict(scale_codes=False), dict(scale_codes=True)]
MAX_REL_ERR = 2e-2  # a configuration whose output is further from the definition is not timed


def per_call_us(calls: list[Callable[[], Any]], iters: int) -> tuple[float, bool]:
    """Median device microseconds of one call, all `calls` replayed as one CUDA graph (eagerly
    if capture fails); and whether the graph was used."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, autotunes) off the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run, graphed = graph.replay, True
    except Exception:  # noqa: BLE001 - a peer that syncs or allocates on the host
        torch.cuda.synchronize()
        run, graphed = (lambda: [call() for call in calls]), False
    return 1000 * device_ms(run, iters) / len(calls), graphed


def quant_bytes(n: int, k: int, bits: int) -> int:
    return n * k * bits // 8 + 2 * 2 * n * (k // GROUP)


def tiled_int4_copies(n: int, k: int) -> tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]:
    """Enough copies of a random [n, k] int4 weight that a replay of all of them reads more than
    L2 holds (L2_MULTIPLE times 60 MB): row major (for the definition) and tiled as the engine
    places them on CUDA."""
    plain = make_weights(n, k, 4, max(2, int(L2_MULTIPLE * 60e6 // quant_bytes(n, k, 4)) + 1))
    return plain, [tile_int4(*w) for w in plain]


def shape_args(doc: str, rows: str, argv: Optional[list[str]]) -> argparse.Namespace:
    """The command line of a GEMM candidate's benchmark over the models' linears (bench_shapes):
    --iters, --models, --rows (`rows` by default), --out."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", default="qwen3.5-27b,qwen3-8b")
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return ap.parse_args(argv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius), a taken to float32."""
    return ((a.float() - b).norm() / b.norm()).item()


def bench_shapes(models: str, bench: Callable[[int, int], dict], fields: tuple[str, ...], result: dict,
                 path: Path) -> None:
    """Every linear of each model (SHAPES) through `bench(n, k)`, whose rows (by row count) land
    in result["rows"] and, times the layer's count, in result["totals_ms"] for the `fields`
    (microseconds a call, summed as ms a step); the JSON rewritten after each shape."""
    for model in models.split(","):
        for name, n, k, count in SHAPES[model]:
            for key, row in bench(n, k).items():
                result["rows"][f"{model} {name} {key}"] = row | {"layers": count}
                total = result["totals_ms"].setdefault(f"{model} {key}", {})
                for field in fields:
                    total[field[:-3]] = total.get(field[:-3], 0.0) + row[field] * count / 1e3
                print(model, name, key, {f: round(v, 4) for f, v in row.items()}, flush=True)
            path.write_text(json.dumps(result, indent=1))
    for key, total in result["totals_ms"].items():
        print(key, {f: round(v, 3) for f, v in total.items()})
    print(path)


def make_weights(n: int, k: int, bits: int, copies: int) -> list[tuple[torch.Tensor, ...]]:
    """Random codes and float16 scale/minimum (speed does not depend on the values)."""
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device="cuda")
        scale = (torch.rand(n, k // GROUP, device="cuda") * 1e-3 + 1e-4).half()
        minimum = (-torch.rand(n, k // GROUP, device="cuda") * 1e-2).half()
        out.append((codes, scale, minimum))
    return out


def ours(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], bits: int, iters: int,
         sweep: list[dict], tiled: bool = False) -> dict[str, Any]:
    """Our kernels on `weights` (row major; `tiled`: int4 in the engine's tiled layout, as
    the engine would store them, checked against the definition on the row-major codes)."""
    tiled = tiled and bits == 4
    kernel = kernel_for(x.shape[0], bits, tiled)  # the engine's choice
    want = reference(x.float(), *weights[0], None, bits, GROUP)
    if tiled:
        weights = [tile_int4(*w) for w in weights]
        sweep = [{**cfg, "tiled": True} for cfg in sweep if cfg.get("kernel", "gemm") == "gemm"]  # the GEMM's alone
    codes, scale, minimum = weights[0]
    got = kernel(x, codes, scale, minimum, None, bits, GROUP).float()
    row: dict[str, Any] = {"rel_err_vs_definition": rel_err(got, want)}
    row["ours_kernel"] = getattr(kernel, "func", kernel).__name__
    row["ours_tiled"] = tiled
    row["ours_default_us"], _ = per_call_us([lambda w=w: kernel(x, *w, None, bits, GROUP) for w in weights], iters)
    best = (row["ours_default_us"], "default")
    row["ours_sweep"] = {}
    for cfg in sweep:
        name = json.dumps(cfg)
        if {k: v for k, v in cfg.items() if k != "tiled"} == {"kernel": row["ours_kernel"]}:
            continue  # the routed launcher at its defaults: ours_default_us already
        cfg = dict(cfg)
        run = KERNELS[cfg.pop("kernel")] if "kernel" in cfg else kernel
        try:
            got = run(x, codes, scale, minimum, None, bits, GROUP, **cfg).float()
            err = rel_err(got, want)
            row.setdefault("sweep_rel_err", {})[name] = err
            if not err < MAX_REL_ERR:
                row["ours_sweep"][name] = f"wrong: rel_err {err:.3g}"
                continue
            us, _ = per_call_us([lambda w=w, cfg=cfg: run(x, *w, None, bits, GROUP, **cfg) for w in weights], iters)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
            row["ours_sweep"][name] = f"{type(e).__name__}: {e}"[:200]
            continue
        row["ours_sweep"][name] = us
        best = min(best, (us, name))
    row["ours_best_us"], row["ours_best_config"] = best
    return row


def torchao_us(x: torch.Tensor, n: int, k: int, bits: int, copies: int, iters: int) -> dict[str, Any]:
    try:
        import torchao
        from torchao import quantization as q

        config = (q.Int4WeightOnlyConfig(group_size=GROUP) if bits == 4 else q.Int8WeightOnlyConfig())
        layers = []
        for _ in range(copies):
            lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda")
            q.quantize_(lin, config)
            layers.append(lin)
        us, graphed = per_call_us([lambda m=m: m(x) for m in layers], iters)
        return {"torchao_us": us, "torchao_graphed": graphed, "torchao_version": torchao.__version__,
                "torchao_config": type(config).__name__}
    except Exception as e:  # noqa: BLE001 - not installed, or not for this torch
        return {"torchao_error": f"{type(e).__name__}: {e}"[:300]}


def tinygemm_us(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], bits: int, iters: int) -> dict[str, Any]:
    """torch's tinygemm int4 kernel over the same codes, checked against the definition. Its weight
    is (q - 8) * scale + zero with bfloat16 scale and zero [K/group, N, 2], and it packs the even
    index of a byte in the high nibble (ours are in runs of words: unpacked first)."""
    if bits != 4:
        return {}
    try:
        layers = []
        for codes, scale, minimum in weights:
            plain = unpack_codes(codes, bits)
            swapped = (plain[:, 0::2] << 4) | plain[:, 1::2]
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
            zeros = minimum.float() + 8 * scale.float()
            sz = torch.stack([scale.float(), zeros], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
            layers.append((packed, sz))
        want = reference(x.float(), *weights[0], None, bits, GROUP)
        got = torch.ops.aten._weight_int4pack_mm(x, layers[0][0], GROUP, layers[0][1]).float()
        us, graphed = per_call_us([lambda w=w: torch.ops.aten._weight_int4pack_mm(x, w[0], GROUP, w[1])
                                   for w in layers], iters)
        return {"tinygemm_us": us, "tinygemm_graphed": graphed,
                "tinygemm_rel_err": rel_err(got, want)}
    except Exception as e:  # noqa: BLE001 - e.g. a build without it
        return {"tinygemm_error": f"{type(e).__name__}: {e}"[:300]}


def gemlite_us(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]], bits: int, iters: int) -> dict[str, Any]:
    """gemlite's A16Wn over the same codes: its zero point is -minimum / scale (hqq's format)."""
    try:
        import gemlite
        from gemlite.helper import A16Wn

        layers = []
        for codes, scale, minimum in weights:
            s = scale.to(x.dtype)
            layers.append(A16Wn(device="cuda").from_weights(
                unpack_codes(codes, bits), s, (-minimum.float() / scale.float()).to(x.dtype), bits, GROUP))
        us, graphed = per_call_us([lambda m=m: m(x) for m in layers], iters)
        return {"gemlite_us": us, "gemlite_graphed": graphed,
                "gemlite_version": getattr(gemlite, "__version__", "?")}
    except Exception as e:  # noqa: BLE001
        return {"gemlite_error": f"{type(e).__name__}: {e}"[:300]}


def bench_shape(n: int, k: int, bits: int, m: int, bw_gbps: float, iters: int, sweep_kind: str,
                l2: int, tiled: bool = False) -> dict[str, Any]:
    copies = max(2, -(-L2_MULTIPLE * l2 // quant_bytes(n, k, bits)))
    weights = make_weights(n, k, bits, copies)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    floor_us = (quant_bytes(n, k, bits) + x.numel() * 2) / bw_gbps / 1e3
    row: dict[str, Any] = {"bits": bits, "M": m, "copies_per_graph": copies, "floor_us": floor_us}
    sweep = {"none": [], "all": (GEMV_SWEEP if bits == 8 else GEMM_AR_SWEEP) if m == 1 else GEMM_SWEEP,
             "gemm": GEMM_AR_SWEEP if m == 1 else GEMM_TREE_SWEEP,
             "split": GEMM_AR_SPLIT_SWEEP if m == 1 else GEMM_TREE_SPLIT_SWEEP,
             "wide": [] if m == 1 else GEMM_WIDE_SWEEP,
             "scaled": GEMM_SCALED_SWEEP if m > 1 and bits == 8 else []}[sweep_kind]
    row.update(ours(x, weights, bits, iters, sweep + ALTERNATIVES.get(m, ALTERNATIVES[23]), tiled))
    row["ours_fraction_of_floor"] = floor_us / row["ours_best_us"]
    row.update(tinygemm_us(x, weights, bits, iters))
    row.update(torchao_us(x, n, k, bits, copies, iters))
    row.update(gemlite_us(x, weights, bits, iters))
    del weights
    dense_copies = max(2, -(-L2_MULTIPLE * l2 // (n * k * 2)))
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(dense_copies)]
    row["bf16_us"], _ = per_call_us([lambda w=w: F.linear(x, w) for w in dense], iters)
    row["bf16_floor_us"] = (n * k * 2 + x.numel() * 2) / bw_gbps / 1e3
    del dense
    torch.cuda.empty_cache()
    return row


def totals(rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """One decode step's linears (every layer's, by count) per bits and M, and verify(23) / AR."""
    out: dict[str, Any] = {}
    counts = {name: count for name, _, _, count in SHAPES[model]}
    for bits in (4, 8):
        for m in (1, 23):
            sel = [r for r in rows if r["model"] == model and r["bits"] == bits and r["M"] == m]
            if not sel:
                continue
            step = {key: sum(counts[r["layer"]] * r[key] for r in sel)
                    for key in ("ours_best_us", "floor_us", "bf16_us", "tinygemm_us", "torchao_us", "gemlite_us")
                    if all(key in r for r in sel)}
            out[f"int{bits}_M{m}"] = {**step, "fraction_of_floor": step["floor_us"] / step["ours_best_us"]}
        ar, verify = out.get(f"int{bits}_M1"), out.get(f"int{bits}_M23")
        if ar and verify:
            out[f"int{bits}_verify23_over_ar"] = verify["ours_best_us"] / ar["ours_best_us"]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    global GROUP
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="our default launch parameters only, no sweep")
    ap.add_argument("--sweep", choices=("all", "gemm", "split", "wide", "scaled"), default="all",
                    help="without --quick: every kernel's sweep, the GEMM's launches alone, "
                         "the GEMM split further along K, verify's GEMM on wider tiles, or int8's "
                         "codes scaled against its per-group epilogue")
    ap.add_argument("--group", type=int, default=GROUP, help="the quantization group (GGUF's Q8_0 is 32, Q6_K 16)")
    ap.add_argument("--tiled", action="store_true",
                    help="int4 in the engine's tiled layout (reference.tile_int4), not row major")
    ap.add_argument("--m", default="1,23", help="comma-separated rows of x (1: the AR step, 23: verify)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bits", default="4,8", help="comma-separated code widths")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="quant_gemv", help="the result file's name before _<device>.json")
    args = ap.parse_args(argv)
    GROUP = args.group  # every helper here reads it
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2 ** 20)
    ceil = ceilings()
    bw = ceil["copy_bandwidth_GBps"]
    rows: list[dict[str, Any]] = []
    device = device_slug()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}_{device}.json"
    result = {"device": torch.cuda.get_device_name(), "sms": props.multi_processor_count, "l2_bytes": l2,
              "torch": torch.__version__, "triton": __import__("triton").__version__, "ceilings": ceil,
              "group": GROUP, "quick": args.quick, "tiled": args.tiled, "rows": rows}
    for model in args.models.split(","):
        for name, n, k, _ in SHAPES[model]:
            for bits, m in itertools.product([int(v) for v in args.bits.split(",")],
                                             [int(v) for v in args.m.split(",")]):
                row = {"model": model, "layer": name, "N": n, "K": k,
                       **bench_shape(n, k, bits, m, bw, args.iters, "none" if args.quick else args.sweep, l2,
                                      args.tiled)}
                print(json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in row.items()
                                  if not key.endswith("error") and key != "ours_sweep"}), flush=True)
                rows.append(row)
                result["totals"] = {model: totals(rows, model) for model in args.models.split(",")
                                    if model in STEP_MODELS}
                path.write_text(json.dumps(result, indent=1))  # after every row: a cut-off run keeps its rows
    print(json.dumps(result.get("totals", {}), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
