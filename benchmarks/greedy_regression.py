"""Greedy outputs of a pair on held-out prompts, to compare two checkouts or two targets token for token.

    PYTHONPATH=OLD_CHECKOUT python benchmarks/greedy_regression.py old.json
    PYTHONPATH=NEW_CHECKOUT python benchmarks/greedy_regression.py new.json --compare old.json
    python benchmarks/greedy_regression.py new.json --target NEW_TARGET --modes ar --compare old.json

Four prompts of each kind (code, chat, tool; --per-kind) from flashtree/assets/heldout_prompts.jsonl,
64 greedy tokens (--max-tokens) in `ar` and `ddtree` mode (--modes; CPU) of the embedded pair or
--target/--draft. With --compare it prints how many outputs equal the other run's and, per kind,
how many tokens each output shares with the other's before they part, and writes both into the
output JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashtree import Engine, SamplingParams

try:
    from flashtree.checkpoint import render_chat
except ImportError:  # checkouts from before the checkpoint package
    from flashtree.serve.chat import render_chat

PROMPTS = Path(__file__).resolve().parents[1] / "flashtree" / "assets" / "heldout_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare")
    ap.add_argument("--target", help="default: the embedded target")
    ap.add_argument("--draft", help="default: the embedded draft (with the embedded target)")
    ap.add_argument("--modes", default="ar,ddtree")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    by_kind: dict[str, list[dict]] = {}
    for line in PROMPTS.read_text().splitlines():
        record = json.loads(line)
        by_kind.setdefault(record["kind"], []).append(record)
    picked = [r for kind in sorted(by_kind) for r in by_kind[kind][:args.per_kind]]
    outputs = {}
    for mode in args.modes.split(","):
        engine = Engine.from_pretrained(args.target, args.draft, mode=mode, max_ctx=2048)
        for i, r in enumerate(picked):
            text = r["text"] if "text" in r else render_chat(engine.tokenizer, r["messages"], r.get("tools"))
            result = engine.generate(engine.tokenizer.encode(text), SamplingParams(temperature=0.0),
                                     max_tokens=args.max_tokens)
            outputs[f"{mode}-{i}"] = result.token_ids
    report = {"outputs": outputs, "kinds": [r["kind"] for r in picked]}
    if args.compare:
        other = json.loads(Path(args.compare).read_text())
        other = other.get("outputs", other)
        same = [k for k in outputs if outputs[k] == other.get(k)]
        shared: dict[str, list[int]] = {}
        for key, ids in outputs.items():
            theirs = other.get(key, [])
            n = next((j for j, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
            shared.setdefault(picked[int(key.rsplit("-", 1)[1])]["kind"], []).append(n)
        report.update(compared_with=args.compare, equal=len(same), total=len(outputs), shared_prefix=shared)
        print(f"{len(same)} of {len(outputs)} outputs equal; tokens shared before they part, per kind: {shared}")
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
