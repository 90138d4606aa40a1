"""What structured output's token masks cost per decode step, in milliseconds.

The embedded pair generates under two grammars (a bounded JSON schema, and any JSON object) in
ar mode (one mask per step: the root's) and in ddtree mode with a budget of 22 (one mask per
node: the tree build asks the grammar whether each candidate may follow its parent, and the verify
gets every node's mask). The mask work is timed where the decoder calls it (GrammarConstraint.admits
in the build, .root_mask and .tree_masks, including the bit unpacking to a [N, V] bool tensor on the
device, and apply_mask, the -inf fill of the logits), next to the whole step, and the tree's nodes
are counted (with the grammar the draft's 22 best candidates are mostly refused). The vocabulary is the embedded tokenizer's (8192 tokens); llguidance's
mask time grows with the grammar's state and the vocabulary's token trie, not with the model.

    python benchmarks/grammar_mask.py [--device cpu] [--prompts 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import llguidance
import torch

from flashtree import Engine, SamplingParams
from flashtree.checkpoint import render_chat
from flashtree.runtime import decoding, grammar
from flashtree.serve.structured import ANY_OBJECT, JSON_OPTIONS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "temp", "note"],
          "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"},
                         "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                         "note": {"type": "string", "maxLength": 40}}}
PROMPTS = ["What's the weather like in Paris?", "Check the weather in Tokyo.", "Is Python a programming language?",
           "Tell me the current weather for Berlin.", "Write a JSON object describing a cat.",
           "What is 123 * 45?", "How is the weather in Madrid today?", "Give me a short note about Rome."]


class Timers:
    """Wraps functions to add up their wall time (and a per-call value) into lists."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.nodes: list[int] = []  # nodes of each verified tree

    def wrap(self, name: str, fn: Callable[..., Any], count_nodes: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kw)
            self.times.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
            if count_nodes:
                self.nodes.append(out[0].size)
            return out
        return timed


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"calls": len(values), "mean_ms": round(statistics.fmean(values), 4),
            "p50_ms": round(ordered[len(ordered) // 2], 4), "p90_ms": round(ordered[int(len(ordered) * 0.9)], 4)}


def run(engine: Engine, grammar_text: str, prompts: list[str], temperature: float) -> dict[str, Any]:
    timers = Timers()
    cls = grammar.GrammarConstraint
    originals = (cls.admits, cls.root_mask, cls.tree_masks, decoding.apply_mask)
    cls.admits = timers.wrap("admits", cls.admits)
    cls.root_mask = timers.wrap("root_mask", cls.root_mask)
    cls.tree_masks = timers.wrap("tree_masks", cls.tree_masks, count_nodes=True)
    decoding.apply_mask = timers.wrap("apply_mask", decoding.apply_mask)
    steps, decode_s, finished = 0, 0.0, 0
    try:
        for i, question in enumerate(prompts):
            text = render_chat(engine.tokenizer, [{"role": "user", "content": question}], None, True,
                               {"enable_thinking": False})
            result = engine.generate(engine.tokenizer.encode(text), SamplingParams(temperature=temperature, seed=i),
                                     max_tokens=96, grammar=grammar_text)
            steps += result.stats.steps
            decode_s += result.stats.decode_s
            finished += result.finish_reason == "stop"
    finally:
        cls.admits, cls.root_mask, cls.tree_masks, decoding.apply_mask = originals
    mask_ms = sum(sum(values) for values in timers.times.values())
    out: dict[str, Any] = {"steps": steps, "finished": finished, "outputs": len(prompts),
                           "step_ms_mean": round(decode_s * 1e3 / max(steps, 1), 3),
                           "mask_ms_per_step": round(mask_ms / max(steps, 1), 4),
                           "mask_share_of_step": round(mask_ms / max(decode_s * 1e3, 1e-9), 4)}
    out.update({name: summary(values) for name, values in timers.times.items()})
    if timers.nodes:
        out["tree_nodes_mean"] = round(statistics.fmean(timers.nodes), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    grammars = {name: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
                for name, schema in (("json_schema", SCHEMA), ("json_object", ANY_OBJECT))}
    prompts = PROMPTS[:args.prompts]
    results: dict[str, Any] = {}
    vocab = None
    for mode in ("ar", "ddtree"):
        engine = Engine.from_pretrained(mode=mode, budget=22, device=args.device, max_ctx=2048)
        vocab = engine.target.config.vocab_size
        engine.generate(engine.tokenizer.encode("warm up"), max_tokens=4, grammar=grammars["json_object"])
        for name, text in grammars.items():
            results[f"{mode}/{name}"] = run(engine, text, prompts, args.temperature)
            print(mode, name, json.dumps(results[f"{mode}/{name}"]))
        del engine
    report = {"benchmark": "grammar_mask", "model": "embedded (flashtree-tiny)", "vocab_size": vocab,
              "budget": 22, "temperature": args.temperature, "prompts": len(prompts),
              "llguidance": llguidance.__version__, "schema": SCHEMA,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "device": args.device, "threads": torch.get_num_threads()},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"grammar_mask_{args.device}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
