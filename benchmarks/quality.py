"""Quality of the quantized weight and KV cache types on the embedded pair (CPU, float32 compute).

    PYTHONPATH=. python benchmarks/quality.py [benchmarks/results/quality_cpu.json]

Every weight type (dense, --quantize int8, int4) with every KV type (auto, bf16, fp8, q8_0,
q4_0), against the dense target with the float32 cache; then the draft's cache in each type
(--draft-kv-type: only the accept lengths can move, the target decides every token), and the
24 GB card's combination (int4 weights, q4_0 caches for both).

Four held-out prompts of each kind (code, chat, tool; flashtree/assets/heldout_prompts.jsonl, the
prompts the acceptance evaluation uses, cut to their first 256 tokens), 48 greedy tokens. Per KV
type: greedy AR's agreement with the float32 cache (tokens equal until the first divergence, and
how many outputs diverge at all), the mean accept length of chain and ddtree (budget 22), and
the perplexity of the prompts themselves, teacher-forced in one forward over a cache of that type
(each position reads the quantized rows of those before it).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from flashtree import Engine, SamplingParams
from flashtree.checkpoint import render_chat
from flashtree.models.inputs import ForwardInput

PROMPTS = Path(__file__).resolve().parents[1] / "flashtree" / "assets" / "heldout_prompts.jsonl"
TYPES = ("auto", "bf16", "fp8", "q8_0", "q4_0")
WEIGHTS = (None, "int8", "int4")  # --quantize
# (--quantize, --kv-type, --draft-kv-type): the target's types with the draft's cache as the model's
# dtype, then the draft's cache in each type, then the card's combination
CONFIGS = ([(w, kv, "auto") for w in WEIGHTS for kv in TYPES] + [(None, "auto", dk) for dk in TYPES[1:]]
           + [("int4", "q4_0", "q4_0")])
TOKENS = 48
PER_KIND = 4  # prompts of each kind: 12 in all (an accept length over 6 moved by 5-7% between types)


def prompts(tokenizer) -> list[list[int]]:
    by_kind: dict[str, list[dict]] = {}
    for line in PROMPTS.read_text().splitlines():
        record = json.loads(line)
        by_kind.setdefault(record["kind"], []).append(record)
    picked = [r for kind in sorted(by_kind) for r in by_kind[kind][:PER_KIND]]
    texts = [r["text"] if "text" in r else render_chat(tokenizer, r["messages"], r.get("tools")) for r in picked]
    return [tokenizer.encode(t)[:256] for t in texts]


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def perplexity(eng: Engine, ids: list[list[int]]) -> float:
    """exp(mean next-token NLL) over all prompts, each run as one chunk on a fresh cache."""
    c = eng.config
    nll, count = 0.0, 0
    for p in ids:
        cache = eng.target.new_cache(len(p) + 1, eng.dtype, eng.device, 1, c.kv_type, c.v_type)
        hidden, _ = eng.target(ForwardInput.prefill(torch.tensor(p), cache))
        logp = torch.log_softmax(eng.target.logits(hidden[:-1]), dim=-1)
        nll -= logp.gather(1, torch.tensor(p[1:])[:, None]).sum().item()
        count += len(p) - 1
    return math.exp(nll / count)


def main() -> None:
    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/quality_cpu.json")
    greedy = SamplingParams(temperature=0.0)
    rows, reference = {}, None
    for quantize, kv, draft_kv in CONFIGS:
        t0 = time.perf_counter()
        row: dict = {}
        for mode in ("ar", "chain", "ddtree"):
            eng = Engine.from_pretrained(mode=mode, max_ctx=512, budget=22, kv_type=kv, quantize=quantize,
                                         draft_kv_type=draft_kv)
            ids = prompts(eng.tokenizer)
            results = [eng.generate(p, greedy, max_tokens=TOKENS, stop_token_ids=[]) for p in ids]
            if mode == "ar":
                outs = [r.token_ids for r in results]
                reference = reference or outs
                agree = [agreement(o, ref) for o, ref in zip(outs, reference)]
                row.update(kv_bytes_per_token=eng.state.target.bytes_per_token(), perplexity=round(perplexity(eng, ids), 4),
                           agree_tokens=agree,
                           mean_agree=sum(agree) / len(agree), diverged=sum(a < TOKENS for a in agree))
            else:
                row["draft_kv_bytes_per_token"] = eng.state.draft.bytes_per_token()
                steps = [n for r in results for n in r.stats.accept_lengths]
                row[f"{mode}_accept_length"] = round(sum(steps) / len(steps), 4)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        name = f"{quantize or 'dense'} weights, {kv} KV" + (f", {draft_kv} draft KV" if draft_kv != "auto" else "")
        rows[name] = row
        print(name, json.dumps(row))
    report = {"device": "cpu", "compute_dtype": "float32", "prompts": 3 * PER_KIND, "tokens": TOKENS,
              "reference": "dense weights, auto KV (float32)", "types": rows}
    out_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
