"""End to end on a trained pair: flashtree's ar, chain and ddtree against the reference DFlash
implementation (`dflash` 0.1.0 from PyPI, its chain loop) on identical weights and prompts.

Every implementation completes the same held-out prompts greedily, up to --max-tokens tokens or
the model's end-of-sequence token (excluded from the counts). Each implementation runs the whole
prompt set --passes times and the last pass is reported (the first pass's seconds are kept beside
it): a first pass also pays one-time costs, kernel compilation for each new prompt shape
included, that a running server pays once. Equal outputs mean equal work. Reported per
implementation: tokens/s over the whole request (prefill included, the same clock for all),
mean accept length (tokens per target forward after the first), and how many outputs equal
flashtree's ar output token for token; where one differs, its first divergence is checked
against the float32 model (a bf16 rounding tie, or a decoding error). On CUDA the device's copy
bandwidth is measured in the same run, and the AR ceiling (weight bytes / bandwidth) is reported
beside it.

    python benchmarks/e2e_pair.py [--target DIR --draft DIR] [--device cuda] [--peers dflash]

The reference runs where the `dflash` package imports (on the GPU machine it is carried as a
wheel: `pip install --no-deps --target /tmp/site .whl/dflash-0.1.0-py3-none-any.whl`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from flashtree import Engine, SamplingParams
from flashtree.runtime.engine import ASSETS
from flashtree.bench.measure import ceilings
from flashtree.train.corpus import prompt_text
from flashtree.train.eval_acceptance import first_per_kind
from flashtree.bench.provenance import provenance


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def load_prompts(path: Path, per_kind: int, tokenizer: Any, max_prompt: int) -> list[tuple[str, list[int]]]:
    return [(rec["kind"], tokenizer.encode(prompt_text(rec, tokenizer))[-max_prompt:])
            for rec in first_per_kind(path, per_kind)]


def summarize(outputs: list[list[int]], pass_seconds: list[float], accepts: list[int],
              reference: list[list[int]]) -> dict[str, Any]:
    tokens, seconds = sum(len(o) for o in outputs), pass_seconds[-1]
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "first_pass_seconds": round(pass_seconds[0], 3),
            "mean_accept_length": round(sum(accepts) / len(accepts), 3) if accepts else None,
            "equal_to_ar": sum(o == r for o, r in zip(outputs, reference)),
            "divergences": [{"prompt": k, "token": i, "ar": r[i] if i < len(r) else None,
                             "got": o[i] if i < len(o) else None}  # None: that output ended there
                            for k, (o, r) in enumerate(zip(outputs, reference))
                            for i in [first_difference(o, r)] if i is not None]}


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first token where a and b differ (the shorter one's length if one is a
    prefix of the other); None if they are equal."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else i


TIE = 0.03  # a divergence is a rounding tie if the float32 logit gap is under 3% of the logit spread


@torch.inference_mode()
def classify_divergences(target: str, prompts: list, reference: list[list[int]], rows: dict[str, Any],
                         device: torch.device) -> None:
    """For each first divergence from our AR output, the float32 model's logit gap between the two
    tokens there, against the logit spread (max - median): a gap within TIE of it is a tie that
    bf16 rounding decides, not a decoding error. Adds fp32_gap / spread / tie to each entry."""
    entries = [d for row in rows.values() for d in row.get("divergences", [])
               if d["ar"] is not None and d["got"] is not None]
    if not entries:
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
    for d in entries:
        prefix = prompts[d["prompt"]][1] + reference[d["prompt"]][:d["token"]]
        z = model(torch.tensor([prefix], device=device)).logits[0, -1]
        gap, spread = (z[d["ar"]] - z[d["got"]]).abs().item(), (z.max() - z.median()).item()
        d.update(fp32_gap=round(gap, 5), spread=round(spread, 3), tie=gap <= TIE * spread)


def timed_passes(device: torch.device, prompts: list, passes: int,
                 one: Callable[[list[int]], tuple[list[int], list[int]]]) -> tuple[list, list[int], list[float]]:
    """Run every prompt `passes` times through `one` (ids -> (output ids, accept lengths));
    return the last pass's outputs and accept lengths, and each pass's total seconds."""
    pass_seconds: list[float] = []
    for _ in range(passes):
        outputs, accepts, total = [], [], 0.0
        for _, ids in prompts:
            (out, acc), seconds = timed(device, lambda: one(ids))
            outputs.append(out)
            accepts += acc
            total += seconds
        pass_seconds.append(total)
    return outputs, accepts, pass_seconds


def run_ours(target: Optional[str], draft: Optional[str], mode: str, budget: int, prompts: list,
             max_tokens: int, device: Optional[str], reference: Optional[list], passes: int) -> tuple[dict, list]:
    engine = Engine.from_pretrained(target, draft, mode=mode, budget=budget, device=device,
                                    max_ctx=max(len(p) for _, p in prompts) + max_tokens + 64)
    greedy = SamplingParams(temperature=0.0)

    def one(ids: list[int]) -> tuple[list[int], list[int]]:
        engine.clear_caches()  # every request pays its prefill, as the reference's does
        res = engine.generate(ids, sampling=greedy, max_tokens=max_tokens)
        return res.token_ids, res.stats.accept_lengths

    outputs, accepts, pass_seconds = timed_passes(engine.device, prompts, passes, one)
    return summarize(outputs, pass_seconds, accepts, reference or outputs), outputs


def until_stop(ids: list[int], stops: list[int]) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)


def run_dflash(target: str, draft: str, prompts: list, max_tokens: int, device: torch.device,
               reference: list, stops: list[int], passes: int) -> dict[str, Any]:
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_target = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    hf_draft = DFlashDraftModel.from_pretrained(draft, dtype=dtype).to(device).eval()

    def one(ids: list[int]) -> tuple[list[int], list[int]]:
        x = torch.tensor([ids], device=device)
        res = dflash_generate(hf_draft, hf_target, x, max_tokens, stops, return_stats=device.type == "cuda")
        out_ids = res.output_ids if device.type == "cuda" else res
        return (until_stop(out_ids[0, len(ids):len(ids) + max_tokens].tolist(), stops),
                list(res.acceptance_lengths) if device.type == "cuda" else [])

    outputs, accepts, pass_seconds = timed_passes(device, prompts, passes, one)
    return summarize(outputs, pass_seconds, accepts, reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ASSETS / "target"))
    ap.add_argument("--draft", default=str(ASSETS / "draft"))
    ap.add_argument("--prompts", type=Path, default=ASSETS / "heldout_prompts.jsonl")
    ap.add_argument("--limit-per-kind", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--device", default=None)
    ap.add_argument("--peers", default="dflash", help="'dflash' or '' (none)")
    ap.add_argument("--passes", type=int, default=2, help="runs over the prompt set; the last is reported")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    probe = Engine.from_pretrained(args.target, args.draft, mode="ar", device=args.device, max_ctx=256)
    device = probe.device
    prompts = load_prompts(args.prompts, args.limit_per_kind, probe.tokenizer, args.max_prompt_tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in probe.target.parameters())
    stops = sorted(probe.tokenizer.eos_token_ids)
    del probe
    rows: dict[str, Any] = {}
    rows["ar"], reference = run_ours(args.target, args.draft, "ar", args.budget, prompts, args.max_tokens,
                                     args.device, None, args.passes)
    rows["chain"], _ = run_ours(args.target, args.draft, "chain", args.budget, prompts, args.max_tokens,
                                args.device, reference, args.passes)
    rows[f"ddtree:{args.budget}"], _ = run_ours(args.target, args.draft, "ddtree", args.budget, prompts,
                                                args.max_tokens, args.device, reference, args.passes)
    if "dflash" in args.peers.split(","):
        try:
            rows["dflash (reference chain)"] = run_dflash(args.target, args.draft, prompts, args.max_tokens,
                                                          device, reference, stops, args.passes)
        except ImportError as e:
            rows["dflash (reference chain)"] = {"skipped": f"dflash is not importable: {e}"}
    classify_divergences(args.target, prompts, reference, rows, device)
    bandwidth = ceilings()["copy_bandwidth_GBps"] if device.type == "cuda" else None
    result = {
        "benchmark": "e2e_pair", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "device": str(device), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
        "pair": {"target": args.target, "draft": args.draft, "target_weight_bytes": weight_bytes},
        "prompts": len(prompts), "max_tokens": args.max_tokens, "greedy": True, "passes": args.passes,
        "ceiling": {"copy_bandwidth_GBps": bandwidth,
                    "ar_floor_ms_per_token": 1000 * weight_bytes / (bandwidth * 1e9) if bandwidth else None},
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"e2e_pair_{device.type}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
