"""Greedy outputs of the embedded pair on held-out prompts, to compare two checkouts token for token.

    PYTHONPATH=OLD_CHECKOUT python benchmarks/greedy_regression.py old.json
    PYTHONPATH=NEW_CHECKOUT python benchmarks/greedy_regression.py new.json --compare old.json

Four prompts of each kind (code, chat, tool) from flashtree/assets/heldout_prompts.jsonl, 64 greedy
tokens in `ar` and `ddtree` mode (CPU, float32). With --compare it prints how many outputs equal
the other run's and writes both into the output JSON.
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
    args = ap.parse_args()
    by_kind: dict[str, list[dict]] = {}
    for line in PROMPTS.read_text().splitlines():
        record = json.loads(line)
        by_kind.setdefault(record["kind"], []).append(record)
    picked = [r for kind in sorted(by_kind) for r in by_kind[kind][:4]]
    outputs = {}
    for mode in ("ar", "ddtree"):
        engine = Engine.from_pretrained(mode=mode, max_ctx=2048)
        for i, r in enumerate(picked):
            text = r["text"] if "text" in r else render_chat(engine.tokenizer, r["messages"], r.get("tools"))
            result = engine.generate(engine.tokenizer.encode(text), SamplingParams(temperature=0.0), max_tokens=64)
            outputs[f"{mode}-{i}"] = result.token_ids
    report = {"outputs": outputs}
    if args.compare:
        other = json.loads(Path(args.compare).read_text())
        other = other.get("outputs", other)
        same = [k for k in outputs if outputs[k] == other.get(k)]
        report.update(compared_with=args.compare, equal=len(same), total=len(outputs))
        print(f"{len(same)} of {len(outputs)} outputs equal")
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
