"""The draft's candidates (kernels/triton_topk.py: each row's top K log-probs over the
vocabulary) on the GPU, at a draft block's rows and a shared phase's, over Qwen3's and
Qwen3.5's vocabularies, for several launches of the chunk kernel: logits a program and warps.

    python benchmarks/draft_topk.py [--launches 4096:4,4096:1,2048:1] [--rows 16,128] [--k 22]

Each launch is first checked against the default launch (the same ids; values within 1e-5),
then timed as the engine runs it: GRAPH_CALLS calls in one CUDA graph, the replay's median time
divided by them. The floor is the logits' float32 bytes read once at the copy bandwidth
measured in the same run (flashtree.bench.measure.ceilings, read + written bytes). Writes
benchmarks/results/<name>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flashtree.bench.measure import ceilings
from flashtree.bench.provenance import device_slug, provenance
from flashtree.kernels.triton_topk import CHUNK, CHUNK_WARPS, top_k_log_probs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import per_call_us  # noqa: E402  (the graph-replay timer the kernel benchmarks share)

VOCABS = {"qwen3": 151936, "qwen3.5": 248320}
GRAPH_CALLS = 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", default=f"{CHUNK}:{CHUNK_WARPS},4096:1,2048:1,1024:1,2048:2",
                    help="comma-separated chunk:warps of the chunk kernel; the first is the reference")
    ap.add_argument("--rows", default="16,128", help="rows of logits (a draft block; 8 blocks)")
    ap.add_argument("--k", type=int, default=22)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--name", default="draft_topk")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    launches = [tuple(int(v) for v in item.split(":")) for item in args.launches.split(",")]
    bandwidth = ceilings()["copy_bandwidth_GBps"]
    rows_out = []
    for (vocab_name, vocab), rows in ((v, int(r)) for v in VOCABS.items() for r in args.rows.split(",")):
        logits = torch.randn(rows, vocab, device="cuda") * 4
        ref_vals, ref_ids = top_k_log_probs(logits, args.k, *launches[0])
        floor_us = logits.numel() * 4 / (bandwidth * 1e3)
        timed = {}
        for chunk, warps in launches:
            vals, ids = top_k_log_probs(logits, args.k, chunk, warps)
            if not torch.equal(ids, ref_ids) or (vals - ref_vals).abs().max().item() > 1e-5:
                timed[f"{chunk}:{warps}"] = "differs from the reference launch"
                continue
            call = lambda c=chunk, w=warps: top_k_log_probs(logits, args.k, c, w)  # noqa: E731
            timed[f"{chunk}:{warps}"] = round(per_call_us([call] * GRAPH_CALLS, args.iters)[0], 2)
        row = {"vocab": vocab_name, "rows": rows, "k": args.k, "floor_us": round(floor_us, 2), "us": timed}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_slug()
    path = args.out / f"{args.name}_{device}.json"
    path.write_text(json.dumps({"benchmark": "draft_topk", **provenance(), "copy_gbps": bandwidth,
                                "rows": rows_out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
