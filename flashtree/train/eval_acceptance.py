"""Measure acceptance length (AL) of a target/draft pair with the real flashtree engine.

Also reported, from the autoregressive pass: per prompt kind, the share of answers that ended with
a stop token within max_tokens (for agent-framed prompts: does the target answer and stop).

For each decoding mode (chain, and ddtree at each budget) every prompt of a prompts file is
completed greedily, and the per-step accept lengths are pooled per prompt kind. Greedy
speculative decoding is lossless, so every mode must also produce the tokens of plain
autoregressive decoding; the report counts prompts where it did not (that number must be 0).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from .corpus import prompt_text, read_jsonl


def parse_modes(spec: str) -> list[tuple[str, int]]:
    """'chain,ddtree:22,ddtree:64' -> [('chain', 0), ('ddtree', 22), ('ddtree', 64)]."""
    modes = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, budget = part.partition(":")
        if name not in ("chain", "ddtree"):
            raise ValueError(f"unknown mode {name!r} (chain or ddtree[:budget])")
        modes.append((name, int(budget or 22) if name == "ddtree" else 0))
    return modes


def first_per_kind(prompts_path: Path | str, limit: Optional[int]) -> list[dict[str, Any]]:
    """The prompt records of a file, at most `limit` of each kind (all with None), in file order."""
    records, seen = [], {}
    for rec in read_jsonl(prompts_path):
        seen[rec["kind"]] = seen.get(rec["kind"], 0) + 1
        if limit is None or seen[rec["kind"]] <= limit:
            records.append(rec)
    return records


def evaluate(target: Optional[str], draft: Optional[str], prompts_path: str, modes: list[tuple[str, int]],
             max_tokens: int = 128, max_ctx: int = 4096, device: Optional[str] = None,
             limit_per_kind: Optional[int] = None) -> dict[str, Any]:
    """AL per mode and kind; `target=None` with `draft=None` evaluates the embedded pair."""
    from .. import Engine, SamplingParams
    from ..checkpoint.resolve import model_refs

    if modes and model_refs(target, draft)[1] is None:  # the engine would decode AR: an AL of 1 meaning nothing
        raise ValueError(f"mode {modes[0][0]} needs a draft: give --draft with --target (only the embedded "
                         "target comes with one)")
    records = first_per_kind(prompts_path, limit_per_kind)
    greedy = SamplingParams(temperature=0.0)
    report: dict[str, Any] = {"prompts": len(records), "max_tokens": max_tokens, "modes": {}}
    reference: dict[int, list[int]] = {}
    ended: dict[str, list[bool]] = {}  # per kind: did the answer end (a stop token) within max_tokens
    for name, budget in [("ar", 0)] + modes:
        engine = Engine.from_pretrained(target, draft, mode=name, budget=budget or 22, max_ctx=max_ctx,
                                        device=device)
        steps: dict[str, list[int]] = {}
        mismatches, t0 = 0, time.perf_counter()
        for i, rec in enumerate(records):
            ids = engine.tokenizer.encode(prompt_text(rec, engine.tokenizer))[-(max_ctx - max_tokens - 64):]
            result = engine.generate(ids, sampling=greedy, max_tokens=max_tokens)
            if name == "ar":
                reference[i] = result.token_ids
                ended.setdefault(rec["kind"], []).append(result.finish_reason == "stop")
                continue
            mismatches += result.token_ids != reference[i]
            steps.setdefault(rec["kind"], []).extend(result.stats.accept_lengths)
        if name == "ar":
            report["ar_seconds"] = round(time.perf_counter() - t0, 1)
            report["ended_by_kind"] = {k: round(sum(v) / len(v), 3) for k, v in sorted(ended.items())}
            continue
        every = [a for v in steps.values() for a in v]
        label = name if name == "chain" else f"ddtree:{budget}"
        report["modes"][label] = {
            "al": round(sum(every) / max(1, len(every)), 3),
            "al_by_kind": {k: round(sum(v) / max(1, len(v)), 3) for k, v in sorted(steps.items())},
            "steps": len(every), "mismatches_vs_ar": mismatches,
            "seconds": round(time.perf_counter() - t0, 1)}
    return report


def write_report(report: dict[str, Any], out: Optional[Path]) -> str:
    """Pretty JSON of the report, also written to `out` when given."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
