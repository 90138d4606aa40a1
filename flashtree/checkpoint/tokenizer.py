"""A checkpoint's tokenizer: tokenizer.json through `tokenizers`, plus what tokenizer_config.json,
chat_template.jinja and generation_config.json add (chat template, end-of-turn ids, specials).

Torch-free on purpose: the HTTP process tokenizes prompts and detokenizes output itself, and
the training-data tools render and tokenize text, neither of which needs the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer as RawTokenizer

from ..errors import CheckpointError
from .files import read_optional_json
from .long_text import LongText


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


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(model_dir: Path, tcfg: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """The chat template and where it was read from."""
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is not None:
        return template, f"{model_dir / 'tokenizer_config.json'} (chat_template)"
    jinja_file = model_dir / "chat_template.jinja"  # where newer transformers versions save it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    return None, None


def load_tokenizer(model_dir: Path, model_cfg: Optional[dict[str, Any]] = None) -> Tokenizer:
    """The tokenizer of the checkpoint in `model_dir` (or of the GGUF file `model_dir`: from its
    metadata); `model_cfg` (its config.json) may add end-of-sequence ids."""
    from .gguf_file import is_gguf, open_gguf
    if is_gguf(model_dir):
        from .gguf_tokenizer import gguf_tokenizer
        return replace(gguf_tokenizer(open_gguf(model_dir)),
                       chat_template_source=f"{model_dir} (metadata tokenizer.chat_template)")
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"missing file {path} (flashtree needs a fast tokenizer.json)")
    try:
        raw = RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    tcfg = read_optional_json(model_dir / "tokenizer_config.json") or {}
    eos_token = _token_text(tcfg.get("eos_token"))
    eos_ids: list[int] = []
    for source in (read_optional_json(model_dir / "generation_config.json") or {}, model_cfg or {}):
        value = source.get("eos_token_id")
        for i in ([value] if isinstance(value, int) else value or []):
            if i not in eos_ids:
                eos_ids.append(int(i))
    if eos_token and raw.token_to_id(eos_token) is not None and raw.token_to_id(eos_token) not in eos_ids:
        eos_ids.append(raw.token_to_id(eos_token))
    specials = {t.content for t in raw.get_added_tokens_decoder().values() if t.special}
    template, source = _chat_template(model_dir, tcfg)
    return Tokenizer(raw=raw, chat_template=template, eos_token_ids=eos_ids,
                     bos_token=_token_text(tcfg.get("bos_token")), eos_token=eos_token,
                     special_tokens=specials, chat_template_source=source)
