"""Host-side work of one DDTree step, per part, in microseconds.

A speculative step's device work is one draft forward and one target forward; everything between
them runs in Python on the host while the GPU waits: building the tree from the draft's top-k,
the tree's ancestor mask (the verify attention mask), the accept walk. On the H200 that host work
is most of what separates tree verify from an AR step (docs/PERFORMANCE.md), so it is measured
on its own, on whatever CPU runs this, against the ceiling of an empty Python call.

    python benchmarks/host_step.py [--budgets 8,22,64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from flashtree.runtime.ddtree import Tree, build_tree
from flashtree.bench.provenance import provenance


def per_call_us(fn: Callable[[], object], seconds: float = 0.5) -> float:
    """Median of five timed batches of calls, each batch about seconds / 5 long."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    reps = max(1, int(n * seconds / 5 / 0.05))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1e6)
    return round(sorted(times)[2], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="8,22,64")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151_936, help="draft vocabulary (Qwen3's by default)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(args.block_size - 1, args.vocab) * 3, dim=-1)
    rows = {}
    for budget in (int(b) for b in args.budgets.split(",")):
        vals, ids = logp.topk(budget, dim=-1)
        tree = build_tree(0, vals, ids, budget)
        drawn = list(tree.tokens[1:]) + [0]  # every draw a child: the longest walk
        rows[budget] = {
            "nodes": tree.size,
            "build_tree_us": per_call_us(lambda: build_tree(0, vals, ids, budget)),
            "ancestor_mask_us": per_call_us(tree.ancestor_mask),
            "walk_us": per_call_us(lambda: Tree(tree.tokens, tree.parents, tree.depths).walk(drawn)),  # + children
            "upload_lists_us": per_call_us(lambda: (torch.tensor(tree.tokens), torch.tensor(tree.depths))),
        }
    result = {
        "benchmark": "host_step", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "ceiling": {"empty_call_us": per_call_us(lambda: None)},
        "budgets": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["budgets"], indent=1))


if __name__ == "__main__":
    main()
