"""The cache attention of one prefill chunk at long context: our Triton kernel's launch parameters
swept, against torch's flash attention on the same bf16 keys (the ceiling: the same FLOPs with no
dequantizing and no mask).

An agent's turn prefills a few thousand new tokens over a long committed context; at 60K tokens
the card demonstration's chunks took about 1 s each, most of it attention. Each configuration
is checked against the default launch's output first (relative error < 1e-2) and timed with CUDA
events (median of --iters); TFLOP/s counts 4 * T * context * D per query head.

    python benchmarks/prefill_attention.py [--quick] [--out benchmarks/results]

With --decode it sweeps the decode steps' launches instead (a 22-node tree's 23 rows and the AR
step's one over a q4_0 cache at 4K, the 27B's and the 8B's heads by default: row blocks, key
blocks, warps and 8 to 64 splits) and writes decode_attention_h200.json. A decode step's
attention takes microseconds, less than launching it from Python, so these are timed as the engine runs them: GRAPH_CALLS calls captured in a CUDA
graph, the replay's time divided by them. `--launches JSON` times the listed launches (each a
dict of plan()'s keys to replace) beside plan()'s own instead of a sweep: an A/B of one knob.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from flashtree.kernels.kv_storage import QuantRows, quantize_kv, scale_dtype
from flashtree.kernels.triton_attention import MODE_CAUSAL, attention
from flashtree.bench.provenance import provenance

SHAPES = {"qwen3.5-27b": (24, 4, 256), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim
PREFILL_DEFAULTS = {"tokens": "512", "contexts": "8192,61440", "kv_types": "bf16,q4_0",
                    "models": "qwen3.5-27b,qwen3-8b"}
DECODE_DEFAULTS = {"tokens": "23,1", "contexts": "4096", "kv_types": "q4_0", "models": "qwen3.5-27b,qwen3-8b"}
GRAPH_CALLS = 20  # calls of a decode step's attention in one timed CUDA graph


def median_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graph_ms(fn: Callable[[], Any], iters: int) -> float:
    """One call of fn as captured in a CUDA graph: GRAPH_CALLS calls a graph, the median replay."""
    return calls_ms([fn] * GRAPH_CALLS, iters)


def calls_ms(calls: list[Callable[[], Any]], iters: int) -> float:
    """One call's time: the calls (after one warm-up of each, eager and on a side stream)
    captured in one CUDA graph, the median replay over their count."""
    for call in dict.fromkeys(calls):
        call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in dict.fromkeys(calls):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay, iters) / len(calls)


def sweep(dim: int, quick: bool, decode: bool = False, rows: int = 0,
          splits: tuple[int, ...] = (8, 16, 32, 64)) -> list[Optional[dict[str, int]]]:
    """None (plan()'s choice) and the launches worth trying for head dim `dim` (for a decode
    step's `rows` query rows a KV head with `decode`: row blocks up to the rows' power of two,
    each split at least a key block, so that nsplit alone sets the splits (`splits`), a tree
    of 256-wide heads with its value dims in one program or two, and a tree's rows as full
    blocks and a tail block; `quick`: key blocks of 64 and
    4 or 8 warps only)."""
    out: list[Optional[dict[str, int]]] = [None]
    if decode:
        block_ms = [b for b in (16, 32, 64, 128) if b <= max(16, 1 << (rows - 1).bit_length()) and b * dim <= 16384]
        parts = (1, 2) if dim > 128 and rows > 64 else (1,)  # a wide tree's value dims in one or two programs
        block_ns, warp_counts = ((64,), (4, 8)) if quick else ((32, 64), (2, 4, 8))
        for bm, bn, warps, nsplit, vp in itertools.product(block_ms, block_ns, warp_counts, splits, parts):
            out.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": 2, "nsplit": nsplit,
                        "min_chunk": 64, "v_parts": vp})
        if rows > 64:  # a tree's rows as full blocks of 64 or 128 and a tail block (row_launches)
            for bm, nsplit, vp in itertools.product((64, 128), splits, parts):
                for warps in ((4, 8) if bm == 64 else (8, 16)):
                    out.append({"block_m": bm, "block_n": 64, "warps": warps, "stages": 2, "nsplit": nsplit,
                                "min_chunk": 64, "v_parts": vp, "tail": 1})
        return out
    block_ms = (64,) if dim > 128 else (64, 128)
    for bm, bn, warps, stages, nsplit in itertools.product(block_ms, (16, 32, 64), (4, 8), (1, 2, 3), (1, 2)):
        if quick and (stages == 1 or (bn == 16 and warps == 8)):
            continue
        out.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "nsplit": nsplit})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", help="comma-separated new tokens (the prefill ubatch; default 512, --decode 23,1)")
    ap.add_argument("--contexts", help="default 8192,61440; --decode 4096")
    ap.add_argument("--kv-types", help="default bf16,q4_0; --decode q4_0")
    ap.add_argument("--models", help="default qwen3.5-27b,qwen3-8b; --decode qwen3.5-27b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="fewer launches in the sweep")
    ap.add_argument("--no-sweep", action="store_true", help="plan()'s launch alone")
    ap.add_argument("--decode", action="store_true", help="the decode steps' launches")
    ap.add_argument("--splits", default="8,16,32,64", help="--decode: the key splits swept")
    ap.add_argument("--launches", type=json.loads, metavar="JSON",
                    help="instead of the sweep: these launches, each a dict of plan()'s keys to replace "
                         "(e.g. '[{\"stages\": 3}]'), beside plan()'s own")
    ap.add_argument("--name", help="the result file's name (default decode_attention_h200 or prefill_attention_h200)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    defaults = DECODE_DEFAULTS if args.decode else PREFILL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    rows = []
    for model, kv_type, ctx, t in itertools.product(args.models.split(","), args.kv_types.split(","),
                                                    [int(c) for c in args.contexts.split(",")],
                                                    [int(n) for n in args.tokens.split(",")]):
        heads, kv_heads, dim = SHAPES[model]
        torch.manual_seed(ctx)
        k = torch.randn(ctx + t, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
        scales = scale_dtype(kv_type, k.dtype)  # a bfloat16 model's cache's (q4_0's in bfloat16)
        kc, vc = (k, v) if kv_type == "bf16" else (QuantRows(kv_type, *quantize_kv(k, kv_type, scales)),
                                                   QuantRows(kv_type, *quantize_kv(v, kv_type, scales)))
        length = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        flops = 4 * t * (ctx + t / 2) * dim * heads
        ours = partial(attention, q, kc, vc, length, dim ** -0.5, MODE_CAUSAL, None, None)  # ours(launch)
        base = ours(None)
        results = []
        timer = graph_ms if args.decode else median_ms
        splits = tuple(int(n) for n in args.splits.split(","))
        launches = ([None] if args.no_sweep else [None, *args.launches] if args.launches
                    else sweep(dim, args.quick, args.decode, t * heads // kv_heads, splits))
        for launch in launches:
            try:
                err = ((ours(launch).float() - base.float()).norm() / base.float().norm()).item()
                if err > 1e-2:
                    results.append({"launch": launch, "error": f"relative error {err:.3g}"})
                    continue
                ms = timer(partial(ours, launch), args.iters)
            except Exception as e:  # a launch that does not compile or fit in shared memory
                results.append({"launch": launch, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            results.append({"launch": launch, "ms": round(ms, 4), "TFLOPs": round(flops / ms / 1e9, 1)})
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        flash_ms = timer(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True), args.iters)
        timed = [r for r in results if "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        row = {"model": model, "kv_type": kv_type, "context": ctx, "tokens": t, "heads": heads,
               "kv_heads": kv_heads, "head_dim": dim, "default": results[0], "best": best,
               "flash_bf16_ms": round(flash_ms, 4), "flash_TFLOPs": round(flops / flash_ms / 1e9, 1),
               "best_vs_flash": round(best["ms"] / flash_ms, 2), "sweep": results}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("model", "kv_type", "context", "tokens", "default", "best",
                                              "flash_bf16_ms", "best_vs_flash")}), flush=True)
        del k, v, kc, vc, ours
    name = args.name or ("decode_attention_h200" if args.decode else "prefill_attention_h200")
    result = {"benchmark": name.removesuffix("_h200"), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              **provenance(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}{'_planned' if args.no_sweep else ''}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
