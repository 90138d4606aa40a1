"""Regenerate draft training data: the target's own responses to corpus prompts.

A draft is judged by how often it guesses what the target will say, so it must learn from the
target's outputs, not from the corpus answers (REFERENCE.md). Prompts are cut from corpus records
(code prefixes, conversations up to an assistant turn), rendered with the target's own chat
template, and completed in large left-padded batches with transformers' `generate`. Output records
are {"kind", "prompt_ids", "completion_ids"}; the completion ends with the stop token when the
target produced one.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from tqdm import tqdm

from .corpus import Record, cut_prompt, prompt_text, read_jsonl, write_jsonl


def sample_prompts(corpus: Path | str, per_kind: int, seed: int = 0,
                   code_corpus: Optional[Path | str] = None) -> list[Record]:
    """`per_kind` prompt records of each kind in the corpus; kinds with few records (code files)
    are cut several times at different places.

    With `code_corpus`, code prompts are cut from its records instead. The target has memorised
    its training code, so its completions of those prompts are recitations; on code it never saw
    (the held-out files, a user's code) it writes its own, and that is what the draft must learn."""
    by_kind: dict[str, list[Record]] = {}
    for rec in read_jsonl(corpus):
        if code_corpus is None or rec["kind"] != "code":
            by_kind.setdefault(rec["kind"], []).append(rec)
    for rec in read_jsonl(code_corpus) if code_corpus is not None else ():
        by_kind.setdefault("code", []).append(rec)
    rng = random.Random(seed)
    prompts = []
    for kind in sorted(by_kind):
        pool = by_kind[kind]
        picks = rng.sample(pool, per_kind) if len(pool) >= per_kind else [rng.choice(pool) for _ in range(per_kind)]
        prompts += [cut_prompt(r, rng) for r in picks]
    rng.shuffle(prompts)
    return prompts


def _encode(records: list[Record], tokenizer: Any, max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for rec in records:
        ids = tokenizer.encode(prompt_text(rec, tokenizer), add_special_tokens=False)
        if rec["kind"] == "code":
            ids = ids[-max_prompt_tokens:]
        if 0 < len(ids) <= max_prompt_tokens:
            out.append((rec["kind"], ids))
    return out


def _batches(items: list[tuple[str, list[int]]], batch_size: int, seed: int) -> Iterator[list[tuple[str, list[int]]]]:
    """Batches of one kind and similar prompt length (little padding), taking the kinds in turn,
    each kind's batches in shuffled order: a time budget that stops early still leaves every kind
    equally represented, over all prompt lengths."""
    rng = random.Random(seed)
    per_kind = []
    for kind in sorted({k for k, _ in items}):
        ordered = sorted((x for x in items if x[0] == kind), key=lambda x: len(x[1]))
        batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
        rng.shuffle(batches)
        per_kind.append(batches)
    for round_ in itertools.zip_longest(*per_kind):
        yield from (b for b in round_ if b is not None)


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def regenerate(target_dir: str, prompts: list[Record], out_path: Path, device: torch.device,
               max_new_tokens: int = 256, batch_size: int = 256, temperature: float = 0.0,
               max_prompt_tokens: int = 1024, time_budget: Optional[float] = None, seed: int = 0) -> dict[str, Any]:
    """Complete every prompt with the target and write the records; returns counts and time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    stops = _stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    items = _encode(prompts, tokenizer, max_prompt_tokens)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    torch.manual_seed(seed)
    records, tokens = [], 0
    bar = tqdm(total=len(items), desc="regen", dynamic_ncols=True, mininterval=2.0)
    for batch in _batches(items, batch_size, seed):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            break
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (_, ids) in enumerate(batch):  # left padding: every prompt ends at column `width`
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention[i, width - len(ids):] = 1
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad, **sampling)
        for (kind, ids), row in zip(batch, out[:, width:].tolist()):
            stop_at = next((j for j, t in enumerate(row) if t in stops), None)
            completion = row[: stop_at + 1] if stop_at is not None else row
            if completion:
                records.append({"kind": kind, "prompt_ids": ids, "completion_ids": completion})
                tokens += len(completion)
        bar.update(len(batch))
    bar.close()
    write_jsonl(out_path, records)
    return {"prompts": len(items), "records": len(records), "completion_tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
