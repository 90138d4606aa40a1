"""Turn JSONL records into token tensors: packed (ids, loss mask) blocks for the target, (ids, loss mask)
examples for drafts.

Draft data can come from anywhere, so four record shapes are accepted (first match wins):
  {"prompt_ids": [...], "completion_ids": [...]}   what `flashtree train regen` writes
  {"prompt": "...", "completion": "..."}            plain text pairs
  {"messages": [...], "tools": [...]}               loss on the last assistant turn only
  {"text": "..."}                                   loss everywhere
Chat records are rendered with the target's own template (through transformers), and the loss
starts where the generation prompt ends, so the draft learns exactly what it will be asked to
predict at serving time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from tokenizers import Tokenizer

from .corpus import read_jsonl

Example = tuple[torch.Tensor, torch.Tensor]  # (token ids [T] int64, loss mask [T] bool)


Document = tuple[Union[str, list[int]], int]


def tokenize_documents(docs: Iterable[Document], tokenizer: Tokenizer,
                       batch: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, loss mask) of each document. A document is (text, loss_from): its tokens that
    start before character `loss_from` are context only (a conversation's prompt), the rest are
    predicted; or (token ids, loss_from), already tokenized, predicted from token `loss_from` on
    (a target's own answer, kept in the tokens it chose)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    chunk: list[Document] = []

    def flush() -> None:
        encodings = iter(tokenizer.encode_batch([doc for doc, _ in chunk if isinstance(doc, str)],
                                                add_special_tokens=False))
        for doc, loss_from in chunk:
            if not isinstance(doc, str):
                out.append((torch.tensor(doc, dtype=torch.int32), torch.arange(len(doc)) >= loss_from))
                continue
            enc = next(encodings)
            ids = torch.tensor(enc.ids, dtype=torch.int32)
            if loss_from == 0:  # the common case: predicted everywhere, no offsets to read
                out.append((ids, torch.ones(len(enc.ids), dtype=torch.bool)))
            else:
                out.append((ids, torch.tensor([start >= loss_from for start, _ in enc.offsets], dtype=torch.bool)))
        chunk.clear()

    for doc in docs:
        chunk.append(doc)
        if len(chunk) == batch:
            flush()
    flush()
    return out


def pack_documents(docs: Iterable[Document], tokenizer: Tokenizer, seq_len: int,
                   batch: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize documents (`tokenize_documents`), concatenate them and cut the stream into rows of
    `seq_len` tokens. Returns (ids, loss mask), each [rows, seq_len]. Documents already end with
    the end-of-text token, so attention across a boundary sees a separator; the ragged tail is
    dropped.
    """
    pieces = tokenize_documents(docs, tokenizer, batch)
    stream = torch.cat([i for i, _ in pieces]) if pieces else torch.zeros(0, dtype=torch.int32)
    predicted = torch.cat([m for _, m in pieces]) if pieces else torch.zeros(0, dtype=torch.bool)
    rows = stream.numel() // seq_len
    if rows == 0:
        raise ValueError(f"corpus has {stream.numel()} tokens, fewer than one row of {seq_len}")
    return stream[: rows * seq_len].view(rows, seq_len), predicted[: rows * seq_len].view(rows, seq_len)


def pack_row_starts(starts: Iterable[Document], fill: Iterable[Document], tokenizer: Tokenizer,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of `seq_len` tokens per `starts` document: the document at the row's first
    position (cut at `seq_len`), then the `fill` documents' stream (taken in order, wrapping
    around) to the row's end. Packed rows start wherever the stream is cut, so a model trained
    only on long ones never sees a document begin at position 0, where a bare prompt does.
    Returns (ids, loss mask), each [len(starts), seq_len]."""
    heads = tokenize_documents(starts, tokenizer)
    if not heads:
        raise ValueError("no documents to start rows with")
    pieces = tokenize_documents(fill, tokenizer) or heads
    stream = torch.cat([i for i, _ in pieces])
    predicted = torch.cat([m for _, m in pieces])
    ids = torch.empty((len(heads), seq_len), dtype=torch.int32)
    mask = torch.empty((len(heads), seq_len), dtype=torch.bool)
    at = 0
    for r, (head, head_mask) in enumerate(heads):
        n = min(len(head), seq_len)
        ids[r, :n], mask[r, :n] = head[:n], head_mask[:n]
        while n < seq_len:
            take = min(seq_len - n, stream.numel() - at)
            ids[r, n:n + take], mask[r, n:n + take] = stream[at:at + take], predicted[at:at + take]
            n, at = n + take, (at + take) % stream.numel()
    return ids, mask


def _split(prompt: list[int], completion: list[int], max_len: int) -> Optional[Example]:
    if not completion:
        return None
    ids = (prompt + completion)[-max_len:]
    mask = ([False] * len(prompt) + [True] * len(completion))[-max_len:]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def _chat_example(rec: dict[str, Any], hf_tokenizer: Any, max_len: int) -> Optional[Example]:
    messages = rec["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return None
    tools = rec.get("tools") or None
    prompt = hf_tokenizer.apply_chat_template(messages[:last], tools=tools, add_generation_prompt=True, tokenize=False)
    full = hf_tokenizer.apply_chat_template(messages[: last + 1], tools=tools, tokenize=False)
    if not full.startswith(prompt):
        return None
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return _split(encode(prompt), encode(full[len(prompt):]), max_len)


def draft_example(rec: dict[str, Any], hf_tokenizer: Any, max_len: int) -> Optional[Example]:
    """One record in any accepted shape -> (ids, loss mask), or None when it has nothing to learn."""
    if "prompt_ids" in rec:
        return _split(list(rec["prompt_ids"]), list(rec["completion_ids"]), max_len)
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if "prompt" in rec:
        return _split(encode(rec["prompt"]), encode(rec["completion"]), max_len)
    if "messages" in rec:
        return _chat_example(rec, hf_tokenizer, max_len)
    if "text" in rec:
        return _split([], encode(rec["text"]), max_len)
    raise ValueError(f"unrecognised draft record with keys {sorted(rec)}")


def load_draft_examples(path: Path | str, hf_tokenizer: Any, max_len: int, min_loss_tokens: int = 2) -> list[Example]:
    """All usable examples of a draft-data file (plain or gzip JSONL)."""
    out = []
    for rec in read_jsonl(path):
        ex = draft_example(rec, hf_tokenizer, max_len)
        if ex is not None and int(ex[1].sum()) >= min_loss_tokens:
            out.append(ex)
    if not out:
        raise ValueError(f"{path}: no usable draft examples")
    return out
