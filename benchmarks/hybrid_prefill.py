"""Prefill of a hybrid preset's target (random bf16 weights of the published shapes) with fla-core's
chunked Gated DeltaNet kernel and with our row-by-row scan alone, in one process: what the `gpu`
extra buys on long prompts, and how far the two final states are apart.

    python3 benchmarks/hybrid_prefill.py --preset qwen3.5-27b --tokens 16384 --ubatch 2048

Writes benchmarks/results/<preset>-prefill-ab.json (or --out)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashtree.bench.models import build_pair
from flashtree.kernels import gated_delta
from flashtree.models.inputs import ForwardInput


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ubatch", type=int, default=2048)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    model = build_pair(args.preset, dev, max_pos=args.tokens + 16).target
    state = model.new_cache(args.tokens, torch.bfloat16, dev)
    ids = torch.randint(0, model.config.vocab_size - 1, (args.tokens,), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))

    def prefill() -> float:
        state.ssm.zero_()
        state.conv.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for at in range(0, args.tokens, args.ubatch):
            part = ids[at:at + args.ubatch]
            model(ForwardInput.prefill(part, state, at))
            state.keep_rows(at, None)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000

    runs, finals = {}, {}
    default_rows = gated_delta.CHUNKED_MIN_ROWS
    for name, min_rows in (("fla", default_rows), ("scan", 10 ** 9)):
        if name == "fla" and gated_delta.chunked_rule() is None:
            runs[name] = "fla-core not installed"
            continue
        gated_delta.CHUNKED_MIN_ROWS = min_rows
        prefill()  # warm-up: Triton compiles
        ms = min(prefill() for _ in range(args.iters))
        runs[name] = {"ms": ms, "tokens_per_s": args.tokens / ms * 1000}
        finals[name] = state.ssm.clone()
    gated_delta.CHUNKED_MIN_ROWS = default_rows
    if len(finals) == 2:
        diff = (finals["fla"] - finals["scan"]).norm() / finals["scan"].norm()
        runs["final_state_rel_diff"] = diff.item()
    result = {"preset": args.preset, "tokens": args.tokens, "ubatch": args.ubatch,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
    out = args.out or Path(__file__).parent / "results" / f"{args.preset}-prefill-ab.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
