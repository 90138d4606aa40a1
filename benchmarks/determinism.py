"""Does the same request get the same answer? Greedy output on random-token prompts (whose flat
distributions make near-ties common), taken in several ways, against the same prompt's cold AR
output, with and without `--deterministic` (docs/DETERMINISM.md).

The ways, per decode mode (ar, chain, ddtree at each budget):
- cold: a fresh prefill (every cache cleared first);
- repeat: the same prompt again (the live sequence's rows, an exact hit);
- extended: the prompt plus the first EXTEND output tokens (a partial hit); the rest must follow;
and for ar also:
- oom: a cold prefill whose first chunk meets an injected out-of-memory (the retry's halved chunks);
- `ar ubatch cold`: a cold prefill by an engine of --small-ubatch tokens a chunk.

A way that differs is named a tie or not: at its first differing token, the reference's own margin
between its two likeliest tokens (its logprobs) is a tie under --tie nats. Without the flag
differences are rounding (a row computed in other company); with it there must be none.

    python benchmarks/determinism.py --device cuda [--lengths 3000,12000,40000] [--flags off,on]

Writes benchmarks/results/determinism_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from flashtree import Engine, SamplingParams
from flashtree.bench.provenance import provenance
from flashtree.runtime import faults

EXTEND = 8  # output tokens the extended prompt takes from the cold answer


def answer(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (no stop token) and, at each, the margin between the two likeliest tokens."""
    res = engine.generate(prompt, SamplingParams(logprobs=2), max_tokens=n, stop_token_ids=[])
    margins = [top[0][1] - top[1][1] if len(top) > 1 else float("inf") for _, top in res.logprobs or []]
    return res.token_ids, margins


def compare(got: list[int], want: list[int], margins: list[float], tie: float) -> dict[str, Any]:
    """Equal, or where `got` first leaves `want` and whether the reference saw a tie there."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None and len(got) == len(want):
        return {"equal": True}
    first = min(len(got), len(want)) if first is None else first
    margin = margins[first] if first < len(margins) else float("inf")
    return {"equal": False, "first": first, "margin": round(margin, 5), "tie": margin < tie}


ALL_WAYS = ("cold", "repeat", "extended", "oom")


def ways(engine: Engine, prompt: list[int], n: int, head: list[int], which: tuple[str, ...]
         ) -> dict[str, tuple[list[int], float]]:
    """The tokens and seconds of each way in `which` (ALL_WAYS' order) for one engine; `head`:
    the reference's first EXTEND tokens, which the extended prompt takes."""
    runs = {"cold": lambda: answer(engine, prompt, n)[0],
            "repeat": lambda: answer(engine, prompt, n)[0],
            "extended": lambda: head + answer(engine, prompt + head, n - EXTEND)[0],
            "oom": lambda: answer(engine, prompt, n)[0]}
    out: dict[str, tuple[list[int], float]] = {}
    for way in which:
        if way in ("cold", "oom"):  # a fresh prefill
            engine.clear_caches()
        faults.configure("prefill:oom:1" if way == "oom" else "")
        t0 = time.perf_counter()
        try:
            out[way] = (runs[way](), time.perf_counter() - t0)
        finally:
            faults.configure("")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed)
    common = dict(target=args.target, draft=args.draft, device=args.device, dtype=args.dtype,
                  max_ctx=max(args.lengths) + args.tokens + 64, max_sequences=1)
    results: dict[str, Any] = {"name": f"determinism_{args.device}", **provenance(), "command": vars(args),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {}}
    vocab = None
    for flag in args.flags:
        deterministic = flag == "on"
        engines = [("ar", dict(mode="ar"), ALL_WAYS),
                   ("ar ubatch", dict(mode="ar", prefill_ubatch=args.small_ubatch), ("cold",)),
                   ("chain", dict(mode="chain"), ALL_WAYS[:3])]
        engines += [(f"ddtree:{b}", dict(mode="ddtree", budget=b), ALL_WAYS[:3]) for b in args.budgets]
        table: dict[str, Any] = {}
        reference: dict[int, tuple[list[int], list[float]]] = {}
        for label, kw, which in engines:
            engine = Engine.from_pretrained(**common, deterministic=deterministic, **kw)
            vocab = vocab or engine.target.config.vocab_size
            for length in args.lengths:
                seeded = g.manual_seed(args.seed + length)
                prompt = torch.randint(100, vocab - 100, (length,), generator=seeded).tolist()
                if length not in reference:  # the first engine is ar: its cold answer is the reference
                    engine.clear_caches()
                    reference[length] = answer(engine, prompt, args.tokens)
                want, margins = reference[length]
                for way, (tokens, seconds) in ways(engine, prompt, args.tokens, want[:EXTEND], which).items():
                    row = compare(tokens, want, margins, args.tie)
                    table.setdefault(f"{label} {way}", {})[length] = {**row, "seconds": round(seconds, 3)}
            engine.close()
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
        results["runs"][flag] = table
    return results


def render(results: dict[str, Any]) -> str:
    lines = []
    for flag, table in results["runs"].items():
        lengths = next(iter(table.values()))
        lines += [f"\n--deterministic {flag}", f"{'way':<22} " + " ".join(f"{n:>14}" for n in lengths)]
        for way, cells in table.items():
            shown = []
            for cell in cells.values():
                text = "equal" if cell["equal"] else f"@{cell['first']} {'tie' if cell['tie'] else 'NOT tie'}"
                shown.append(f"{text:>9} {cell['seconds']:4.1f}s")
            lines.append(f"{way:<22} " + " ".join(f"{s:>14}" for s in shown))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target (default: the embedded model)")
    p.add_argument("--draft", default=None, help="draft (default: the embedded draft)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[3000, 12000, 40000])
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens an answer takes")
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[8, 22])
    p.add_argument("--small-ubatch", type=int, default=37, help="the ubatch of the `ubatch` way")
    p.add_argument("--flags", type=lambda s: s.split(","), default=["off", "on"],
                   help="without (off) and with (on) --deterministic")
    p.add_argument("--tie", type=float, default=0.02, help="a margin under this many nats is a tie")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/determinism_<device>.json)")
    args = p.parse_args()
    results = run(args)
    out = Path(args.out or Path(__file__).parent / "results" / f"{results['name']}.json")
    out.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
