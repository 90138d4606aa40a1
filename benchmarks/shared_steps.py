"""Several sequences' decode steps: one after another (each its own captured device step, as
when they decode in turn) against one shared step (batch_step.py: each sequence's draft phase,
then one captured phase verifying every tree), on a published shape with random weights.

Random weights accept about one token a step on either path, so the comparison is time per
round (one step of every sequence) at the same trees' sizes; tokens/s at a real accept length
scale with it. The ceiling: a round can not take less than one verify of all the rows plus each
sequence's draft.

    python benchmarks/shared_steps.py --preset qwen3-8b --sequences 1,2,4 --out benchmarks/results/shared_steps_q8b.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashtree.bench.models import build_pair
from flashtree.models.quant import quantize_model
from flashtree.runtime.batch_step import SharedSteps, StepOrder
from flashtree.runtime.decoding import Decoder
from flashtree.runtime.graphs import ModelRunner
from flashtree.runtime.sampling import Sampler, SamplingParams
from flashtree.runtime.sequence import SequenceState


def sequences(pair, count: int, context: int, budget: int, kv_type):
    target, draft = pair.target, pair.draft
    dev, dtype, bs = target.model.norm.weight.device, target.model.norm.weight.dtype, draft.config.block_size
    out = []
    g = torch.Generator().manual_seed(0)
    for _ in range(count):
        state = SequenceState(target.new_cache(context + 1024, dtype, dev, budget + 1, kv_type),
                              draft.new_cache(context + 1024, dtype, dev), dev)
        runner = ModelRunner(target, draft, state, draft.config.target_layer_ids, [1, budget + 1], bs, True)
        dec = Decoder(target, draft, state, runner, "ddtree", budget, bs, True)
        prompt = torch.randint(0, target.config.vocab_size, (context,), generator=g).tolist()
        with torch.inference_mode():
            for start in range(0, context, 2048):
                logits = dec.prefill_chunk(prompt[start:start + 2048])
        out.append((dec, int(logits.argmax())))
    return out


def rounds(seqs, shared: bool, n: int, sampler: Sampler) -> float:
    """Mean ms of a round: one step of every sequence."""
    bonus = {id(d): b for d, b in seqs}
    steps = SharedSteps()
    times = []
    for i in range(n + 2):  # the first two capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if shared:
            orders = [StepOrder(d, bonus[id(d)], sampler, d.block_size) for d, _ in seqs]
            steps.run(orders)
            for o in orders:
                assert o.error is None, o.error
                bonus[id(o.decoder)] = o.result.tokens[-1]
        else:
            for d, _ in seqs:
                bonus[id(d)] = d.step(bonus[id(d)], sampler, d.block_size).tokens[-1]
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    steps.close()
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--quantize", choices=["int8", "int4"])
    ap.add_argument("--kv-type")
    ap.add_argument("--sequences", default="1,2,4")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pair = build_pair(args.preset, "cuda", max_pos=args.context + 1024)
    if args.quantize:
        quantize_model(pair.target, args.quantize, torch.device("cuda"))
        quantize_model(pair.draft, args.quantize, torch.device("cuda"))
    sampler = Sampler(SamplingParams(), pair.target.config.vocab_size, torch.device("cuda"), [])
    rows = []
    for count in [int(n) for n in args.sequences.split(",")]:
        seqs = sequences(pair, count, args.context, args.budget, args.kv_type)
        turn, together = rounds(seqs, False, args.rounds, sampler), rounds(seqs, True, args.rounds, sampler)
        row = {"sequences": count, "in_turn_ms": round(turn, 3), "shared_ms": round(together, 3),
               "speedup": round(turn / together, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del seqs
        torch.cuda.empty_cache()
    result = {"what": "shared_steps", "device": torch.cuda.get_device_name(), "preset": args.preset,
              "quantize": args.quantize, "kv_type": args.kv_type, "context": args.context, "budget": args.budget,
              "rounds": args.rounds, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
