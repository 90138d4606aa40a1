"""A DFlash or DFlash2 draft as a GGUF file: its header read back into the config.json of the
z-lab checkpoint it was converted from, which models/dflash2.py's draft_config parses as it
parses that checkpoint's, so a GGUF draft is the same model as its safetensors copy.

Two namings of the keys are published, and both are read (docs/MODELS.md has the table):

- `general.architecture = dflash`: llama.cpp's converter (convert_hf_to_gguf.py, DFlash2 since
  llama.cpp PR 27342) and flashtree's own (checkpoint/gguf_draft_writer.py). The DFlash keys sit
  under `dflash.`: `block_size`; `target_layers`, which counts target layers as llama.cpp does
  (its layer 0 is the embedding's output, so it is HF's target_layer_ids + 1); the mask token as
  the tokenizer's `tokenizer.ggml.mask_token_id` (or `dflash.mask_token_id`). A DFlash2 draft is
  one whose file has `dflash.selector_top_k`, as llama.cpp decides, with `conv_kernel_size`,
  `conv_group_size`, `selector_rank`, `logit_scale` (HF's output_multiplier) and
  `final_logit_softcapping`; its vocabulary is the selector codebooks' rows.
- `qwen35-dflash-draft` (lucebox's convert_dflash_to_gguf.py) and `dflash-draft` (ik_llama.cpp):
  the DFlash keys under `{arch}.dflash.`: `block_size`, `mask_token_id` and `target_layer_ids` in
  HF's own numbering.

Both write the layer shape under the standard keys (gguf_file.shape_config), sliding windows as
`{arch}.attention.sliding_window` and the per-layer bool `{arch}.attention.sliding_window_pattern`
(true: that layer slides), and may write `{arch}.attention.causal` (HF's is_causal). flashtree adds
`dflash.input_embedding_scale` where a DFlash2 draft's is not 1. Every value is read in its type
and range, and a key the model needs that is missing is an error naming it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gguf_file import GGUFFile, float32_decimal, shape_config

LLAMA_CPP = "dflash"


@dataclass(frozen=True)
class Naming:
    """Where one family of converters writes the DFlash keys."""

    prefix: str        # before each DFlash key, `{arch}` replaced by the architecture
    target_layers: str  # the key of the target layers the draft reads
    layer_offset: int  # the file's number of a target layer minus HF's
    mask_keys: tuple[str, ...]  # where the mask token may be, first found wins


NAMINGS = {
    LLAMA_CPP: Naming("{arch}.", "target_layers", 1, ("tokenizer.ggml.mask_token_id", "{arch}.mask_token_id")),
    "qwen35-dflash-draft": Naming("{arch}.dflash.", "target_layer_ids", 0, ("{arch}.dflash.mask_token_id",)),
    "dflash-draft": Naming("{arch}.dflash.", "target_layer_ids", 0, ("{arch}.dflash.mask_token_id",)),
}
DRAFT_ARCHITECTURES = tuple(NAMINGS)
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
CODEBOOK = "selector_predecessor.weight"  # [rank, vocabulary] in GGUF order


def is_draft(g: GGUFFile) -> bool:
    return g.arch in DRAFT_ARCHITECTURES


def draft_config_json(g: GGUFFile) -> dict[str, Any]:
    """The draft's config.json (a DFlash draft's, or with `architectures` DFlash2's), as
    models/dflash2.py: draft_config reads it. `g` is a draft's file (is_draft)."""
    naming = NAMINGS[g.arch]
    key = naming.prefix.format(arch=g.arch)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **shape_config(g)}
    cfg.update(_windows(g, cfg["num_hidden_layers"]))
    dflash: dict[str, Any] = {"target_layer_ids": _target_layers(g, key + naming.target_layers, naming.layer_offset),
                              "mask_token_id": _mask_token(g, naming)}
    if key + "block_size" in g.header.fields:
        cfg["block_size"] = g.integer(key + "block_size", least=2)
    if f"{g.arch}.attention.causal" in g.header.fields:
        cfg["is_causal"] = g.flag("{arch}.attention.causal")
    if key + "selector_top_k" in g.header.fields:
        cfg["architectures"] = [DFLASH2_ARCHITECTURE]
        cfg["vocab_size"] = _vocabulary(g)
        dflash.update(_dflash2(g, key))
    cfg["dflash_config"] = dflash
    return cfg


def _target_layers(g: GGUFFile, key: str, offset: int) -> list[int]:
    found = g.integers(key)
    ids = [i - offset for i in found]
    if not ids or min(ids) < 0:
        lowest = f"at least {offset}" if offset else "not negative"
        raise g.error(key, f"must list the target layers the draft reads, each {lowest}; found {found}")
    return ids


def _mask_token(g: GGUFFile, naming: Naming) -> int:
    for key in naming.mask_keys:
        key = key.format(arch=g.arch)
        if key in g.header.fields:
            return g.integer(key, least=0)
    keys = " or ".join(k.format(arch=g.arch) for k in naming.mask_keys)
    raise g.error(keys, "missing (a draft needs its mask token)")


def _windows(g: GGUFFile, layers: int) -> dict[str, Any]:
    """layer_types and sliding_window from the pattern of sliding layers and their window; a
    window without its pattern is refused, since it cannot say which layers slide."""
    pattern_key, window_key = f"{g.arch}.attention.sliding_window_pattern", f"{g.arch}.attention.sliding_window"
    if pattern_key not in g.header.fields:
        if g.integer(window_key, 0, least=0):
            raise g.error(window_key, f"a sliding window without {pattern_key} (which layers slide)")
        return {}
    pattern = g.flags(pattern_key)
    if len(pattern) != layers:
        raise g.error(pattern_key, f"{len(pattern)} entries for {layers} layers")
    if not any(pattern):
        return {}
    return {"layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
            "sliding_window": g.integer(window_key, least=1), "use_sliding_window": True}


def _vocabulary(g: GGUFFile) -> int:
    """A DFlash2 draft's vocabulary: its selector codebooks' rows (the target's vocabulary)."""
    codebook = g.tensor(CODEBOOK)
    if len(codebook.shape) != 2:
        raise g.error(CODEBOOK, f"shape {list(codebook.shape)} is not [selector_rank, vocabulary]")
    vocab = codebook.shape[1]
    if g.integer("{arch}.vocab_size", vocab) != vocab:
        raise g.error(f"{g.arch}.vocab_size", f"differs from the {vocab} rows of {CODEBOOK}")
    return vocab


def _dflash2(g: GGUFFile, key: str) -> dict[str, Any]:
    """The DFlash2 fields of dflash_config (models/dflash2.py checks them against each other)."""
    out: dict[str, Any] = {name: g.integer(key + name, least=1)
                           for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    out["output_multiplier"] = float32_decimal(g.positive(key + "logit_scale", 1.0))
    out["input_embedding_scale"] = float32_decimal(g.positive(key + "input_embedding_scale", 1.0))
    cap = g.positive(key + "final_logit_softcapping", None)
    if cap is not None:
        out["final_logit_softcapping"] = float32_decimal(cap)
    return out
