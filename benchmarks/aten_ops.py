"""The ATen kernels (not ours) that one eager forward of a quantized target launches, by op: what a
decode step still runs outside the fused Triton kernels. On the GPU a captured step replays every
launch, so a handful of small ATen ops a layer costs microseconds each, times the layers.

    python benchmarks/aten_ops.py [--preset qwen3.5-27b] [--quantize int4] [--kv-type q4_0]

Prints and writes benchmarks/results/aten_ops_<preset>.json: per top-level ATen op its calls and
device microseconds in one AR forward (+ lm_head) at --context committed rows, random weights.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from flashtree.bench.measure import random_rows
from flashtree.bench.models import build_pair
from flashtree.models.inputs import ForwardInput
from flashtree.models.quantize import quantize_model
from flashtree.runtime.sequence import SequenceState

TOKEN = 5  # every committed and new token (random weights: which one does not matter)


def ar_forward(preset: str, quantize: str, kv_type: Optional[str], context: int,
               device: torch.device) -> Callable[[], None]:
    """One eager AR forward + lm_head of `preset` (random weights, quantized as `quantize` says)
    over `context` committed rows of random keys and values: the target alone, no draft and no
    captured graphs (their capture is what a decode benchmark pays for, not this count)."""
    pair = build_pair(preset, device, max_pos=context + 512)
    if quantize:
        quantize_model(pair.target, quantize)
    target = pair.target
    dtype = target.model.norm.weight.dtype
    state = SequenceState(target.new_cache(context + 64, dtype, device, 1, kv_type), None, device)
    random_rows(getattr(state.target, "kv", state.target))
    state.commit([TOKEN] * context)
    inp = ForwardInput(ids=torch.full((1,), TOKEN, device=device),
                       positions=torch.full((1,), context, device=device), cache=state.target,
                       lengths=state.length_dev)

    def forward() -> None:
        hidden, _ = target(inp)
        target.logits(hidden)

    return forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--quantize", default="int4", help="int4, int8 or '' (bf16)")
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    with torch.inference_mode():
        forward = ar_forward(args.preset, args.quantize, args.kv_type or None, args.context, torch.device("cuda"))
        forward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
    ops: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        nested = e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")
        us = getattr(e, "device_time_total", 0)
        if e.name.startswith("aten::") and not nested and us > 0:
            ops[e.name][0] += 1
            ops[e.name][1] += us
    rows = [{"op": name, "calls": n, "device_us": round(us, 1)}
            for name, (n, us) in sorted(ops.items(), key=lambda kv: -kv[1][1])]
    for r in rows:
        print(f"{r['device_us']:9.1f} us  x{r['calls']:4d}  {r['op']}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"preset": args.preset, "quantize": args.quantize, "kv_type": args.kv_type, "context": args.context,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ops": rows,
              "total_device_us": round(sum(r["device_us"] for r in rows), 1)}
    (args.out / f"aten_ops_{args.preset}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
