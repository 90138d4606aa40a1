"""A checkpoint's tokenizer: tokenizer.json through `tokenizers`, plus what tokenizer_config.json,
chat_template.jinja and generation_config.json add (chat template, end-of-turn ids, specials).

Torch-free on purpose: the HTTP process tokenizes prompts and detokenizes output itself, and
the training-data tools render and tokenize text, neither of which needs the model.
"""

from __future__ import annotations

import json
import os
import reprlib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer as RawTokenizer

from ..errors import CheckpointError
from .files import TOKENIZER_FILE_LIMIT, read_optional_json, read_text
from .long_text import LongText

MAX_EOS_IDS = 256  # end-of-sequence ids a checkpoint may name (models name one to three)


@dataclass
class Tokenizer:
    """tokenizer.json through `tokenizers`, plus what tokenizer_config.json adds."""

    raw: RawTokenizer
    chat_template: Optional[str]
    eos_token_ids: list[int]
    bos_token: Optional[str]
    eos_token: Optional[str]
    special_tokens: set[str]
    chat_template_source: Optional[str] = None  # the file (and key) the template was read from, for messages

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: the text of a special token in it (`<|im_end|>`) is encoded as the
        characters it is made of, not as the control token (transformers' split_special_tokens).
        Text a user wrote must never become markup."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def prepare(self) -> None:
        """Build now what encode_plain and long_text otherwise build on first use (each walks the
        whole vocabulary): a server does it at start, not in its first request."""
        _ = self._plain, self.long_text

    @cached_property
    def long_text(self) -> LongText:
        """How long texts are encoded a piece at a time, and bounded from their length alone."""
        return LongText(self.raw)

    @cached_property
    def _plain(self) -> RawTokenizer:
        plain = RawTokenizer.from_str(self.raw.to_str())
        plain.encode_special_tokens = True  # special tokens are matched no more; other added ones are
        return plain

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.raw.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.raw.id_to_token(idx)


def _token_text(value: Any, source: Path, key: str) -> Optional[str]:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict; anything else
    (a number, a list) is a CheckpointError naming `source` and `key`."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise CheckpointError(f"{source}: {key}: expected a token string or an AddedToken object, "
                              f"got {reprlib.repr(value)}")
    return text


def eos_token_ids(value: Any, source: Path, vocab_size: int, vocabulary: str) -> list[int]:
    """The end-of-sequence ids `eos_token_id` in `source` names: an int, a list of them, or null.
    Each must be an id of the `vocab_size` ids of `vocabulary` (what the error calls them): a
    float, a string or an id past the vocabulary (as 1e12 is) could never be sampled, so
    generation would never stop at it; it is refused. So is a list of more than MAX_EOS_IDS: one
    of every id ends every answer before its first token. (The tokenizer holds them to its
    tokens here, and the loader holds config.json's to the model's rows: models/checks.py,
    check_token_ids.)"""
    ids = [value] if isinstance(value, int) else [] if value is None else value
    if isinstance(ids, list) and len(ids) > MAX_EOS_IDS:
        raise CheckpointError(f"{source}: eos_token_id: {len(ids)} ids; a model ends on a few (at most "
                              f"{MAX_EOS_IDS} are read)")
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise CheckpointError(f"{source}: eos_token_id: expected an int or a list of ints inside the "
                              f"vocabulary (0 to {vocab_size - 1}: {vocabulary}), got {reprlib.repr(value)}")
    return ids


def check_added_token_ids(raw: RawTokenizer, text: str, path: Path) -> None:
    """Refuse an added token that `tokenizers` does not give the id tokenizer.json's
    `added_tokens` names for it. The library ignores those ids: a token whose content is in the
    vocabulary takes the vocabulary's id, any other the next free id after the vocabulary's. So
    an entry `{"id": 5, "content": "<|tool|>"}` where the vocabulary holds "abc" at 5 makes
    "<|tool|>" some id past the vocabulary (a padded embedding's untrained row, or one the model
    has none for) while the model's 5 still decodes as "abc": the model reads and writes the
    token as another, and every tool call is garbage. Likewise a duplicate id, an id past a gap,
    or a token the vocabulary holds under another id. An entry whose content is the vocabulary's
    own token at that id (the usual case: Qwen lists its specials in both) gets that id, and
    passes. The error names the file, the token, its id and what holds that id."""
    added = json.loads(text).get("added_tokens") or []
    vocab: Optional[dict[int, str]] = None
    seen: dict[int, str] = {}
    for entry in added:
        want, content = entry.get("id"), entry.get("content")
        got = raw.token_to_id(content) if isinstance(content, str) else None
        if not isinstance(want, int) or got is None or got == want:
            seen.setdefault(want, content)
            continue
        if vocab is None:
            vocab = {i: t for t, i in raw.get_vocab(with_added_tokens=False).items()}
        if want in vocab:
            why = f"which the vocabulary's token {vocab[want]!r} has"
        elif want in seen:
            why = f"which the added token {seen[want]!r} has too"
        elif vocab.get(got) == content:
            why = f"but the vocabulary holds it as id {got}"
        else:
            why = "which is not the next id after the vocabulary's and the added tokens' before it"
        raise CheckpointError(f"{path}: added_tokens: {content!r} has id {want}, {why}; tokenizers gives "
                              f"{content!r} id {got} instead, so the model would read and write it as another "
                              "token")


def _chat_template(model_dir: Path, tcfg: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """The chat template and where it was read from. A chat_template.jinja file wins over
    tokenizer_config.json, as in transformers (which writes the file and keeps a stale copy in
    the config); the config's chat_template is a string, or transformers' named templates: a
    list of {"name": ..., "template": ...} objects, of which "default" is taken; any other form
    is a CheckpointError naming the key."""
    jinja_file = model_dir / "chat_template.jinja"
    if os.path.lexists(jinja_file):
        return read_text(jinja_file), str(jinja_file)
    source = f"{model_dir / 'tokenizer_config.json'} (chat_template)"
    template = tcfg.get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            raise CheckpointError(f"{source}: expected a list of {{\"name\": ..., \"template\": ...}} "
                                  f"objects with string values, got {reprlib.repr(template)}")
        template = next((t["template"] for t in template if t["name"] == "default"), None)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source}: expected a string or a list of named templates, "
                              f"got {reprlib.repr(template)}")
    return template, (source if template is not None else None)


def load_tokenizer(model_dir: Path, model_cfg: Optional[dict[str, Any]] = None) -> Tokenizer:
    """The tokenizer of the checkpoint in `model_dir` (or of the GGUF file `model_dir`: from its
    metadata); `model_cfg` (its config.json) may add end-of-sequence ids. Of the token ids that
    config.json and generation_config.json name, only `eos_token_id` is read (eos_token_ids);
    `bos_token_id` and `pad_token_id` are ignored, whatever they hold: no prompt gets a bos
    prepended by id (prompts are encoded without special tokens, and a chat template writes
    tokenizer_config.json's `bos_token` text), and nothing is padded. tokenizer.json's own
    `truncation` and `padding` settings are dropped, as transformers drops them at each call."""
    from .gguf_file import is_gguf, open_gguf
    if is_gguf(model_dir):
        from .gguf_tokenizer import gguf_tokenizer
        return replace(gguf_tokenizer(open_gguf(model_dir)),
                       chat_template_source=f"{model_dir} (metadata tokenizer.chat_template)")
    path = model_dir / "tokenizer.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"missing file {path} (flashtree needs a fast tokenizer.json)")
    text = read_text(path, TOKENIZER_FILE_LIMIT)
    try:
        raw = RawTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    # a saved "truncation" or "padding" would cut every prompt to its max_length, or pad it with
    # pad tokens, without a word; transformers resets both at each call, so a tokenizer.json that
    # holds them tokenizes there as with none, and does here too
    raw.no_truncation()
    raw.no_padding()
    check_added_token_ids(raw, text, path)
    vocab_size = raw.get_vocab_size(with_added_tokens=True)
    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = read_optional_json(tcfg_path) or {}
    eos_token = _token_text(tcfg.get("eos_token"), tcfg_path, "eos_token")
    eos_ids: list[int] = []
    generation = model_dir / "generation_config.json"
    for source, cfg in ((generation, read_optional_json(generation) or {}), (model_dir / "config.json", model_cfg or {})):
        eos_ids += eos_token_ids(cfg.get("eos_token_id"), source, vocab_size,
                                 f"the tokenizer's {vocab_size} tokens")
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_token and raw.token_to_id(eos_token) is not None and raw.token_to_id(eos_token) not in eos_ids:
        eos_ids.append(raw.token_to_id(eos_token))
    specials = {t.content for t in raw.get_added_tokens_decoder().values() if t.special}
    template, source = _chat_template(model_dir, tcfg)
    return Tokenizer(raw=raw, chat_template=template, eos_token_ids=eos_ids,
                     bos_token=_token_text(tcfg.get("bos_token"), tcfg_path, "bos_token"), eos_token=eos_token,
                     special_tokens=specials, chat_template_source=source)
