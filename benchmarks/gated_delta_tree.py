"""The Gated DeltaNet scan of a verified tree (kernels/triton_gated_delta.py) at a 27B hybrid's
shape (48 value heads, Dk = Dv = 128), replayed as a CUDA graph of 48 calls (one a DeltaNet layer),
over trees of 23 nodes (DDTree-shaped; the engine bench's chain of 15 and 7 children of the root;
22 children of the root; a chain) in verify's static buffers, and one row (the AR step), at several
launches (value columns a program, warps, and programs a state slice that a tree's segments are
dealt to): how much of verify's device time the tree scan takes, and which launch is fastest.
Each launch's outputs are compared with the default's (the same steps in the same order; only the
order of each reduction over Dk differs with the warps, about 1e-6).

    python benchmarks/gated_delta_tree.py [--iters 50]

Writes benchmarks/results/gated_delta_tree_<gpu>.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import torch

from flashtree.bench.measure import device_ms
from flashtree.bench.provenance import device_slug
from flashtree.kernels.gated_delta import TreeIndex
from flashtree.kernels.triton_gated_delta import scan
from flashtree.runtime.ddtree import build_tree

HEADS, DK, DV = 48, 128, 128
CALLS = 48  # scans a graph replays, one a layer
LAUNCHES = [dict(block_v=16, num_warps=1), dict(block_v=32, num_warps=4), dict(block_v=32, num_warps=1),
            dict(block_v=32, num_warps=2), dict(block_v=16, num_warps=2), dict(block_v=64, num_warps=4),
            dict(block_v=64, num_warps=2), dict(block_v=8, num_warps=1),
            dict(block_v=16, num_warps=1, segment_programs=4), dict(block_v=16, num_warps=1, segment_programs=16),
            dict(block_v=16, num_warps=1, segment_programs=23)]


def ddtree_parents(budget: int = 22, depth: int = 15, seed: int = 0) -> list[int]:
    """A best-first tree over peaked random draft distributions, as a step builds it."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, 1000, generator=gen) * 4, dim=-1)
    vals, ids = logp.topk(budget, dim=-1)
    return build_tree(0, vals, ids, budget, True, depth).parents


def flat_parents(budget: int = 22, depth: int = 15) -> list[int]:
    """What `flashtree bench` verifies: a chain-seeded tree over its random draft's flat
    distributions, a chain of `depth` and the rest children of the root."""
    return [-1] + list(range(depth)) + [0] * (budget - depth)


def inputs(t: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=dev).manual_seed(t)
    q = torch.randn(t, HEADS, DK, device=dev, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(t, HEADS, DK, device=dev, generator=gen), dim=-1)
    v = torch.randn(t, HEADS, DV, device=dev, generator=gen)
    g = -torch.rand(t, HEADS, device=dev, generator=gen)
    beta = torch.rand(t, HEADS, device=dev, generator=gen)
    state = torch.randn(HEADS, DK, DV, device=dev, generator=gen) * 0.1
    return q, k, v, g, beta, state


def time_launches(parents: Optional[list[int]], dev: torch.device, iters: int) -> dict[str, Any]:
    t = len(parents) if parents is not None else 1
    q, k, v, g, beta, state = inputs(t, dev)
    tree = None
    if parents is not None:  # in static buffers, as verify's graph holds a tree
        tree = TreeIndex.static(t, 4, dev)
        tree.fill_(TreeIndex.build(parents, 4, dev))
    final = None if tree is not None else torch.empty_like(state)
    want = scan(q, k, v, g, beta, state, tree, final)
    row: dict[str, Any] = {"rows": t, "parents": parents, "launches": {}}
    for launch in LAUNCHES:
        got = scan(q, k, v, g, beta, state, tree, final, **launch)
        graph = torch.cuda.CUDAGraph()  # replayed, as verify's graph runs it: no launch overhead
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                scan(q, k, v, g, beta, state, tree, final, **launch)
        us = 1000 * device_ms(graph.replay, iters) / CALLS
        row["launches"][json.dumps(launch)] = {"us": us, "max_abs_diff": (got - want).abs().max().item()}
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    chain = [-1] + list(range(22))
    result = {"device": torch.cuda.get_device_name(), "heads": HEADS, "dk": DK, "dv": DV,
              "cases": {"ddtree 23": time_launches(ddtree_parents(), dev, args.iters),
                        "flat 23": time_launches(flat_parents(), dev, args.iters),
                        "star 23": time_launches([-1] + [0] * 22, dev, args.iters),
                        "chain 23": time_launches(chain, dev, args.iters),
                        "one row": time_launches(None, dev, args.iters)}}
    for name, case in result["cases"].items():
        print(name, {k: round(v["us"], 1) for k, v in case["launches"].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gated_delta_tree_{device_slug()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
