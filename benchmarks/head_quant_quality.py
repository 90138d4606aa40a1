"""What quantizing the embedding table and the lm_head costs, on the embedded pair (CPU, float32).

    PYTHONPATH=. python benchmarks/head_quant_quality.py [benchmarks/results/head_quant_quality_cpu.json]

--quantize gives the embedding and lm_head models/quant.py's HEAD_KIND whatever the layers get;
this measures that choice. For the layers at int8 and at int4, the embedding/lm_head pair (tied
in the embedded target: one table) kept dense, at int8 and at int4; and the draft's linears at
int8 and int4 (--quantize-draft) over an int4 target. Per row, against the dense float32 pair
on the held-out prompts of benchmarks/quality.py: the relative error of the prompts' logits
(teacher-forced), greedy AR's agreement (tokens equal until the first divergence, and how many
outputs diverge), the perplexity of the prompts, and ddtree's mean accept length (budget 22).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from flashtree import Engine, SamplingParams
from flashtree.models import quant, quantize
from flashtree.models.inputs import ForwardInput
from quality import TOKENS, agreement, perplexity, prompts

# (layers, embedding/lm_head, draft): None = dense
ROWS = [(None, None, None), ("int8", None, None), ("int8", "int8", None), ("int8", "int4", None),
        ("int4", None, None), ("int4", "int8", None), ("int4", "int4", None),
        ("int4", "int8", "int8"), ("int4", "int8", "int4")]


@torch.inference_mode()
def prompt_logits(eng: Engine, ids: list[list[int]]) -> torch.Tensor:
    out = []
    for p in ids:
        cache = eng.target.new_cache(len(p) + 1, eng.dtype, eng.device, 1)
        hidden, _ = eng.target(ForwardInput.prefill(torch.tensor(p), cache))
        out.append(eng.target.logits(hidden))
    return torch.cat(out)


def engine(mode: str, layers: Optional[str], head: Optional[str], draft: Optional[str]) -> Engine:
    """The embedded pair with the head kind patched in (None: quantize_model leaves it dense)."""
    quant.HEAD_KIND = head or "int8"
    slots = quantize.head_slots
    if head is None:
        quantize.head_slots = lambda model: (None, None)
    try:
        return Engine.from_pretrained(mode=mode, max_ctx=512, budget=22, quantize=layers, quantize_draft=draft)
    finally:
        quantize.head_slots, quant.HEAD_KIND = slots, "int8"


def main() -> None:
    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/head_quant_quality_cpu.json")
    greedy = SamplingParams(temperature=0.0)
    rows, reference, ref_logits = [], None, None
    for layers, head, draft in ROWS:
        t0 = time.perf_counter()
        ar = engine("ar", layers, head, draft)
        ids = prompts(ar.tokenizer)
        outs = [ar.generate(p, greedy, max_tokens=TOKENS, stop_token_ids=[]).token_ids for p in ids]
        logits = prompt_logits(ar, ids)
        reference = reference or outs
        ref_logits = logits if ref_logits is None else ref_logits
        agree = [agreement(o, ref) for o, ref in zip(outs, reference)]
        tree = engine("ddtree", layers, head, draft)
        steps = [n for p in ids for n in tree.generate(p, greedy, max_tokens=TOKENS, stop_token_ids=[]).stats.accept_lengths]
        row = {"layers": layers or "dense", "embedding_lm_head": head or "dense", "draft": draft or "dense",
               "logit_rel_err": round(((logits - ref_logits).norm() / ref_logits.norm()).item(), 5),
               "top1_match": round((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(), 4),
               "agree_tokens": agree, "mean_agree": sum(agree) / len(agree), "diverged": sum(a < TOKENS for a in agree),
               "perplexity": round(perplexity(ar, ids), 4), "ddtree_accept_length": round(sum(steps) / len(steps), 4),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row))
    report = {"device": "cpu", "compute_dtype": "float32", "prompts": len(reference), "tokens": TOKENS,
              "reference": "the dense float32 pair", "rows": rows}
    out_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
