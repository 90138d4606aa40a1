"""Train the tiny Qwen3 target from scratch on the corpus and save it as a standard HF checkpoint.

The model is transformers' own `Qwen3ForCausalLM`, so the checkpoint is by construction what
transformers (and flashtree's loader) read: config.json, sharded bf16 safetensors with an index,
and the tokenizer files copied next to them. Training is plain next-token prediction on packed
1K-token rows; the corpus is mostly regular synthetic text, which makes the target predictable
and so gives the draft something it can learn to anticipate.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from ..checkpoint import read_json
from .corpus import read_jsonl, training_document
from .datasets import Document, pack_documents, pack_row_starts
from .loop import LoopConfig, batch_indices, train_loop
from .tokenizer_train import ENDOFTEXT, IM_END

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# ~14.4M parameters: 29 MB of bf16 safetensors with tied embeddings
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 384, "intermediate_size": 1280, "num_hidden_layers": 6,
             "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
    "test": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32},
}
# Hybrid (Qwen3.5-style) sizes: Gated DeltaNet layers with full attention every third layer
HYBRID_SIZES: dict[str, dict[str, Any]] = {
    "tiny-hybrid": {**SIZES["tiny"], "linear_num_key_heads": 3, "linear_num_value_heads": 6,
                    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
                    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2},
    "test-hybrid": {**SIZES["test"], "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                    "layer_types": ["linear_attention", "full_attention"]},
}


@dataclass
class TargetTrainConfig:
    """Model size and batch shape of a target training run."""

    size: str = "tiny"
    seq_len: int = 1024
    batch_size: int = 64
    seed: int = 0
    # with row openings (train_target's `openings`): every `short_every`-th step is a batch of
    # rows of `short_seq_len` tokens instead (as many tokens as a long batch), each row starting
    # with one opening
    short_seq_len: int = 1024
    short_every: int = 2
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(lr=2e-3, warmup=100, weight_decay=0.1))


def target_config(size: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json of a fresh target: Qwen3 (or, for a *-hybrid size, Qwen3.5's Gated DeltaNet
    hybrid with partial RoPE), GQA, tied embeddings, RoPE theta 1e6 for 64K."""
    if size in HYBRID_SIZES:
        return {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **HYBRID_SIZES[size],
            "vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": 65536,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.token_to_id(ENDOFTEXT), "eos_token_id": tokenizer.token_to_id(IM_END),
            "pad_token_id": tokenizer.token_to_id(ENDOFTEXT), "torch_dtype": "bfloat16",
            "initializer_range": 0.02, "use_cache": True,
        }
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SIZES[size],
        "vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": 65536,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": True, "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END), "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    }


def save_target(model: torch.nn.Module, config: dict[str, Any], tokenizer_dir: Path, out_dir: Path,
                shard: str = "15MB") -> None:
    """save_pretrained as bf16 shards (each under the 16 MiB transfer limit) + tokenizer files.

    config.json is rewritten from `config` so it carries the flat `rope_theta` that older
    loaders read, whichever transformers version saved it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}  # model itself untouched
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: the embedding is the only copy on disk
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True, max_shard_size=shard)
    saved = json.loads((out_dir / "config.json").read_text())
    saved.update(config, dtype="bfloat16")
    (out_dir / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def anchor_document(record: dict[str, Any], tokenizer: Tokenizer) -> Document:
    """A regen record (a target's own greedy completion of a prompt: `train regen`) as a document
    predicted from its completion on, in the very tokens the target chose (decoding and tokenizing
    again could merge the completion's first token into the prompt's last). Mixed into a fine-tune,
    such records anchor the target to what it answered before: the agent stage otherwise moves its
    completions of code it never saw, and the draft, which learnt the old ones, loses acceptance
    (docs/TRAINING.md, the anchor)."""
    ids = record["prompt_ids"] + record["completion_ids"] + [tokenizer.token_to_id(ENDOFTEXT)]
    return ids, len(record["prompt_ids"])


def _documents(corpora: list[Path], seed: int, tokenizer: Tokenizer,
               answers_only: tuple[Path, ...] = ()) -> list[Document]:
    """Every record of the corpora as a training document (text, where its loss starts). Several
    corpora are shuffled together, so that packed rows mix them (in a fine-tune, new long documents
    with the old short ones); one corpus keeps its own (already shuffled) order, which the shipped
    target was trained on. Records of an `answers_only` corpus are predicted from their first
    assistant turn on: in the agent stage an 8K-token client frame would otherwise drown the few
    dozen tokens of the tool call that copies the request's words. Regen records (token ids) are
    anchor_documents, predicted from their completion on."""
    docs = [anchor_document(r, tokenizer) if "prompt_ids" in r else training_document(r, corpus in answers_only)
            for corpus in corpora for r in read_jsonl(corpus)]
    if len(corpora) > 1:
        random.Random(seed).shuffle(docs)
    return docs


def _short_rows(openings: tuple[Path, ...], fill: tuple[Path, ...], fill_answers_only: tuple[Path, ...],
                seed: int, tokenizer: Tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `seq_len` tokens, each starting with one record of `openings` (shuffled, predicted
    everywhere) and filled with the `fill` corpora's records (`fill_answers_only` ones predicted
    from their first answer on), shuffled together."""
    starts = [training_document(r) for corpus in openings for r in read_jsonl(corpus)]
    random.Random(seed + 1).shuffle(starts)
    fill_docs = _documents(list(fill) + list(fill_answers_only), seed + 2, tokenizer, fill_answers_only) \
        if fill or fill_answers_only else []
    if len(list(fill) + list(fill_answers_only)) == 1:
        random.Random(seed + 2).shuffle(fill_docs)
    return pack_row_starts(starts, fill_docs, tokenizer, seq_len)


def train_target(corpus: Path | list[Path], tokenizer_dir: Path, out_dir: Path, cfg: TargetTrainConfig,
                 device: torch.device, work_dir: Path | None = None, init_dir: Path | None = None,
                 answers_only: list[Path] | tuple[Path, ...] = (), openings: list[Path] | tuple[Path, ...] = (),
                 short_corpus: list[Path] | tuple[Path, ...] = (),
                 short_answers_only: list[Path] | tuple[Path, ...] = ()) -> dict[str, Any]:
    """Train from scratch, or from the checkpoint in `init_dir` (a fine-tune: its config and
    weights; e.g. a long-context stage on agent conversations with a longer `seq_len`), or resume
    from work_dir; save to out_dir, return a summary. `answers_only` corpora are mixed in with
    the loss on their answers only (see `_documents`).

    With `openings` (records that a row should start with: code cut at a `def` or `class` line),
    every `cfg.short_every`-th step trains on short rows instead (`_short_rows`, filled with the
    `short_corpus` and `short_answers_only` records): in a stage of long rows, only a handful of
    rows a step begin anywhere, and none at a document's start, so the target forgets what a bare
    prompt at position 0 (`def fib(n):`) continues with."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    corpora = (corpus if isinstance(corpus, list) else [corpus]) + list(answers_only)
    rows, loss_mask = pack_documents(_documents(corpora, cfg.seed, tokenizer, tuple(answers_only)), tokenizer,
                                     cfg.seq_len)
    short = _short_rows(tuple(openings), tuple(short_corpus), tuple(short_answers_only), cfg.seed, tokenizer,
                        cfg.short_seq_len) if openings else None
    short_batch = max(1, cfg.batch_size * cfg.seq_len // cfg.short_seq_len)
    if init_dir is not None:
        config = read_json(init_dir / "config.json")  # a missing or broken file is a clear error
        model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32).to(device)
    else:
        config = target_config(cfg.size, tokenizer)
        skip = ("architectures", "torch_dtype", "rope_theta", "model_type")
        fields = {k: v for k, v in config.items() if k not in skip}
        if cfg.size in HYBRID_SIZES:
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).to(device)
        else:
            hf_config = Qwen3Config(**fields, rope_parameters={"rope_type": "default",
                                                               "rope_theta": config["rope_theta"]})
            model = Qwen3ForCausalLM(hf_config).to(device)
    model.config.use_cache = False

    def loss_at(step: int) -> tuple[torch.Tensor, dict[str, float]]:
        if short is not None and step % cfg.short_every == cfg.short_every - 1:
            idx = batch_indices(short[0].shape[0], short_batch, step // cfg.short_every, cfg.seed + 1)
            ids, mask = short[0][idx], short[1][idx]
        else:
            idx = batch_indices(rows.shape[0], cfg.batch_size, step, cfg.seed)
            ids, mask = rows[idx], loss_mask[idx]
        batch = ids.long().to(device, non_blocking=True)
        labels = batch.masked_fill(~mask.to(device, non_blocking=True), -100)
        return model(input_ids=batch, labels=labels).loss, {}

    work = work_dir or out_dir.with_name(out_dir.name + "_work")
    params = [p for p in model.parameters() if p.requires_grad]
    summary = train_loop(params, loss_at, cfg.loop, work / "target.pt", {"model": model}, device, desc="target")
    save_target(model, config, tokenizer_dir, out_dir)
    summary.update({"rows": rows.shape[0], "tokens_per_step": cfg.batch_size * cfg.seq_len,
                    "predicted_share": round(loss_mask.float().mean().item(), 4),
                    "answers_only": [str(p) for p in answers_only],
                    "openings": [str(p) for p in openings],
                    "short_rows": short[0].shape[0] if short is not None else 0,
                    "init": str(init_dir) if init_dir is not None else None,
                    "parameters": sum(p.numel() for p in params),
                    "epochs": round(summary["steps"] * cfg.batch_size / rows.shape[0], 2),
                    "config": {k: v for k, v in asdict(cfg).items() if k != "loop" and not (k == "size" and init_dir)
                               and not (k.startswith("short_") and short is None)},
                    "loop": asdict(cfg.loop)})
    work.mkdir(parents=True, exist_ok=True)
    (work / "target_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
