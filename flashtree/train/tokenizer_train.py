"""Train the embedded model's byte-level BPE tokenizer and write its HF tokenizer files.

Writes tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json,
the files transformers and flashtree's checkpoint loader read next to the weights. Digits are
split one by one so arithmetic stays regular; runs of indentation are kept whole so Python source
tokenizes compactly. The chat control strings are stripped from the training text: they are
added tokens with fixed ids and must not also be spelled by merges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .chat_template import CHAT_TEMPLATE

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
# control tokens: skipped by `decode(skip_special_tokens=True)`
CONTROL_TOKENS = [ENDOFTEXT, IM_START, IM_END, MASK]
# markup tokens: real text the client must see (reasoning and tool-call parsers read them)
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END] + MARKUP_TOKENS + [MASK]

_SPLIT = (r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _strip_specials(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        for tok in SPECIAL_TOKENS:
            text = text.replace(tok, "\n")
        yield text


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE whose first ids are SPECIAL_TOKENS, in that order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_strip_specials(texts), trainer=trainer)
    # the trainer registers every special token as "special"; the markup ones must survive decoding
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in CONTROL_TOKENS
    return Tokenizer.from_str(json.dumps(data))


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    return {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": t in CONTROL_TOKENS}
            for t in SPECIAL_TOKENS}


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int = 65536) -> None:
    """Write the three files a target directory needs besides its config and weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
        "mask_token": MASK, "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "split_special_tokens": False, "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    gen = {"eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)],
           "pad_token_id": tok.token_to_id(ENDOFTEXT), "bos_token_id": tok.token_to_id(ENDOFTEXT),
           "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
