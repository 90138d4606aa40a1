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
# the special-token ids read (tokenizer.ggml.<kind>_token_id): bos, and those that end generation
SPECIAL_IDS = ("bos", "eos", "eot", "eom")


def _family(g: GGUFFile) -> Family:
    pre = g.string("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise g.error("tokenizer.ggml.pre", f"unsupported tokenizer.ggml.pre {pre!r}; supported: "
                                            f"{', '.join(PRE_TOKENIZERS)}")
    return PRE_TOKENIZERS[pre]


def _pre_tokenizer(family: Family) -> Any:
    if family.split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _vocabulary(g: GGUFFile) -> tuple[list[str], list[int], dict[str, int]]:
    """(token texts, their types, the BPE vocabulary: text -> id of the tokens in use), checked:
    one token per row of the embedding table (the converter pads the list to it with unused
    tokens, as llama.cpp requires: every id the model can emit decodes, every id the tokenizer
    makes has a row), a type per token, and no text twice among the tokens in use (the BPE
    vocabulary maps a text to one id, so a second id would never be made and its merges break)."""
    tokens = g.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise g.error("tokenizer.ggml.tokens", "the vocabulary is empty")
    embed = g.tensors.get("token_embd.weight")  # a tokenizer-only file has none
    if embed is not None and len(tokens) != embed.shape[-1]:
        raise g.error("tokenizer.ggml.tokens", f"{len(tokens)} tokens for the {embed.shape[-1]} rows of "
                                               "token_embd.weight (there must be one per row)")
    types = g.integers("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise g.error("tokenizer.ggml.token_type", f"{len(types)} token types for {len(tokens)} tokens")
    # unused rows pad the embedding to its size: no text maps to them, none decodes from them
    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind != UNUSED and vocab.setdefault(text, i) != i:
            raise g.error("tokenizer.ggml.tokens", f"token {text!r} appears twice (ids {vocab[text]} and {i})")
    return tokens, types, vocab


def _merges(g: GGUFFile) -> list[tuple[str, str]]:
    merges = []
    for i, merge in enumerate(g.strings("tokenizer.ggml.merges")):
        pair = tuple(merge.split(" ", 1))
        if len(pair) != 2:
            raise g.error(f"tokenizer.ggml.merges[{i}]", f"{merge!r} is not two tokens separated by a space")
        merges.append(pair)
    return merges


def _raw_tokenizer(g: GGUFFile) -> tuple[RawTokenizer, list[str], list[int]]:
    model = g.string("tokenizer.ggml.model")
    if model != "gpt2":
        raise g.error("tokenizer.ggml.model", f"unsupported tokenizer model {model!r}; only byte-level BPE "
                                              "('gpt2', as Qwen and LLaMA-3 use) is supported")
    tokens, types, vocab = _vocabulary(g)
    family = _family(g)
    try:
        bpe = models.BPE(vocab=vocab, merges=_merges(g), fuse_unk=False, byte_fallback=False,
                         ignore_merges=family.ignore_merges)
    except Exception as e:  # tokenizers raises a bare Exception (a merge of tokens not in the vocabulary)
        raise g.error("tokenizer.ggml.merges", str(e)) from None
    raw = RawTokenizer(bpe)
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


def _token_id(g: GGUFFile, key: str, size: int) -> Optional[int]:
    """The token id under `key` (None: absent); an id outside a vocabulary of `size` is an error."""
    idx = g.integer(key, None)
    if idx is not None and not 0 <= idx < size:
        raise g.error(key, f"{idx} is not a token id (the vocabulary has {size} tokens)")
    return idx


def special_token_ids(g: GGUFFile, size: int) -> dict[str, Optional[int]]:
    """The file's special-token ids that are read (`tokenizer.ggml.<kind>_token_id` of each kind
    of SPECIAL_IDS; None: absent), each refused outside a vocabulary of `size`: its tokens here,
    the embedding's rows (as many) where the loader reads the header (models/checks.py,
    check_token_ids), so that `flashtree plan` refuses the file too. bos is the chat template's
    `bos_token`, prepended where `tokenizer.ggml.add_bos_token` says so; eos, eot and eom end
    generation. Ids read nowhere (`padding_token_id`, `unknown_token_id`, `seperator_token_id`)
    are ignored, as an HF checkpoint's `pad_token_id` is (tokenizer.py, load_tokenizer)."""
    return {kind: _token_id(g, f"tokenizer.ggml.{kind}_token_id", size) for kind in SPECIAL_IDS}


def gguf_tokenizer(g: GGUFFile) -> Tokenizer:
    """The Tokenizer of the GGUF file: vocabulary, merges and special tokens from its
    `tokenizer.ggml.*` metadata, chat template from `tokenizer.chat_template`."""
    raw, tokens, types = _raw_tokenizer(g)
    ids = special_token_ids(g, len(tokens))
    bos_id, eos_id = ids["bos"], ids["eos"]
    if bos_id is not None and g.flag("tokenizer.ggml.add_bos_token", False):
        raw.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A {tokens[bos_id]} $B",
            special_tokens=[(tokens[bos_id], bos_id)])
    eos_ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        idx = ids[key]
        if idx is not None and idx not in eos_ids:
            eos_ids.append(idx)
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL and text in END_OF_TURN and i not in eos_ids:
            eos_ids.append(i)
    specials = {t for t, kind in zip(tokens, types) if kind == CONTROL}
    return Tokenizer(raw=raw, chat_template=g.string("tokenizer.chat_template", None),
                     eos_token_ids=eos_ids, bos_token=None if bos_id is None else tokens[bos_id],
                     eos_token=None if eos_id is None else tokens[eos_id], special_tokens=specials)
