"""The tokenizer and chat template of a GGUF file, rebuilt from its own metadata as the
tokenizer.json it was converted from, so that a .gguf target needs no HF folder beside it.

llama.cpp's converter stores a byte-level BPE tokenizer as `tokenizer.ggml.*` arrays: every
token's text (byte-level alphabet, as in tokenizer.json's vocab), its type (normal, control =
a special added token, user-defined = a plain added token, unused = padding rows of the
embedding) and the merges; the pre-tokenizer is not stored but named (`tokenizer.ggml.pre`), and
each name stands for one split regex. Those are turned back into a `tokenizers` Tokenizer with the
pre-tokenizer, normalizer and decoder that the named family's tokenizer.json has, so ids are the
original tokenizer's, token for token. Torch-free, like tokenizer.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer

from ..errors import CheckpointError
from .gguf_file import GGUFFile
from .tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"


class Family(NamedTuple):
    """What a family's tokenizer.json has around its vocabulary and merges."""

    split: Optional[str]  # the split regex; None: GPT-2's ByteLevel pre-tokenizer and its regex
    nfc: bool             # an NFC normalizer (Qwen)
    ignore_merges: bool   # a pre-token that is a vocabulary entry is that token (LLaMA-3)


PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> its family
    "default": Family(None, False, False),
    "gpt-2": Family(None, False, False),
    "qwen2": Family(CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                    r"|\s+(?!\S)|\s+", True, False),
    "qwen35": Family(CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+", True, False),
    "llama-bpe": Family(CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+", False, True),
}
# control tokens that end a turn although the file names only one eos id (llama.cpp treats
# them as end-of-generation by their text, as the HF generation_config lists them)
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _family(g: GGUFFile) -> Family:
    pre = g.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{g.path}: unsupported tokenizer.ggml.pre {pre!r}; supported: "
                              f"{', '.join(PRE_TOKENIZERS)}")
    return PRE_TOKENIZERS[pre]


def _pre_tokenizer(family: Family) -> Any:
    if family.split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _raw_tokenizer(g: GGUFFile) -> tuple[RawTokenizer, list[str], list[int]]:
    model = g.value("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{g.path}: unsupported tokenizer.ggml.model {model!r}; only byte-level "
                              "BPE ('gpt2', as Qwen and LLaMA-3 use) is supported")
    tokens = g.value("tokenizer.ggml.tokens")
    types = g.value("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in g.value("tokenizer.ggml.merges")]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{g.path}: malformed tokenizer.ggml arrays")
    # unused rows pad the embedding to its size: no text maps to them, none decodes from them
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    family = _family(g)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=family.ignore_merges))
    raw.pre_tokenizer = _pre_tokenizer(family)
    if family.nfc:
        raw.normalizer = normalizers.NFC()
    raw.decoder = decoders.ByteLevel()
    # added tokens keep their ids: each is already in the BPE vocabulary under its text
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    raw.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return raw, tokens, types


def _token(tokens: list[str], idx: Any) -> Optional[str]:
    return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None


def gguf_tokenizer(g: GGUFFile) -> Tokenizer:
    """The Tokenizer of the GGUF file: vocabulary, merges and special tokens from its
    `tokenizer.ggml.*` metadata, chat template from `tokenizer.chat_template`."""
    raw, tokens, types = _raw_tokenizer(g)
    bos_id = g.value("tokenizer.ggml.bos_token_id", None)
    eos_id = g.value("tokenizer.ggml.eos_token_id", None)
    if bos_id is not None and g.value("tokenizer.ggml.add_bos_token", False):
        bos = _token(tokens, bos_id)
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
    eos_ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        idx = g.value(f"tokenizer.ggml.{key}_token_id", None)
        if idx is not None and int(idx) not in eos_ids:
            eos_ids.append(int(idx))
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and text in END_OF_TURN and i not in eos_ids:
            eos_ids.append(i)
    specials = {t for t, kind in zip(tokens, types) if kind == CONTROL}
    return Tokenizer(raw=raw, chat_template=g.value("tokenizer.chat_template", None),
                     eos_token_ids=eos_ids, bos_token=_token(tokens, bos_id),
                     eos_token=_token(tokens, eos_id), special_tokens=specials)

