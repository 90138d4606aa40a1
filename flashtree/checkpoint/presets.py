"""Published model shapes by name: the config.json of each preset's target, as transformers
writes it, and of its matching DFlash draft (or DFlash2 draft: `flashtree bench --draft-kind`).
`flashtree bench` builds random-weight models of these shapes and `flashtree plan --preset`
plans them; both read this one table. It imports nothing (not torch), so that a parser can list
the names.
"""

from __future__ import annotations

from typing import Any

_QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                 num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                 tie_word_embeddings=False, attention_bias=False)
_LLAMA31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
_QWEN3_17B = dict(_QWEN3_8B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, tie_word_embeddings=True)

# Hybrid (Gated DeltaNet) shapes: a full-attention layer every fourth, partial RoPE, gated
# attention, and the one multi-token-prediction layer the family's checkpoints ship (`--draft
# mtp`). The 27B attention/MLP widths are the published ones; the DeltaNet head counts (16 key,
# 48 value heads of 128) follow the family's pattern.
_QWEN35_27B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                   num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                   rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
                   attention_bias=False, full_attention_interval=4, linear_conv_kernel_dim=4,
                   linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                   linear_value_head_dim=128, mtp_num_hidden_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25})
_QWEN35_4B = dict(_QWEN35_27B, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                  num_attention_heads=16, linear_num_value_heads=32, tie_word_embeddings=True)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_8B,
    "llama3.1-8b": _LLAMA31_8B,
    "qwen3-1.7b": _QWEN3_17B,  # the small preset: quick runs and the GPU tests
    "qwen3.5-27b": _QWEN35_27B,
    "qwen3.5-4b": _QWEN35_4B,  # the small hybrid preset: the hybrid GPU tests
}


def target_config(preset: str) -> dict[str, Any]:
    """The transformers config.json of a preset's target."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return dict(PRESETS[preset])


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab default: one layer -> the middle one; else spread from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


DRAFT_LAYERS = 5
BLOCK_SIZE = 16  # a DFlash draft's; the largest block of the DRAFT_KINDS
DRAFT_KINDS = ("dflash", "dflash2", "mtp")  # what `flashtree bench --draft-kind` drafts a preset with


def draft_config(preset: str) -> dict[str, Any]:
    """The z-lab-format config of the matching 5-layer DFlash draft (block size 16)."""
    return draft_config_for(target_config(preset))


def draft_config_for(t: dict[str, Any]) -> dict[str, Any]:
    """The 5-layer DFlash draft config (block size 16) matching the target config `t`."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size",
            "max_position_embeddings")
    cfg = {k: t[k] for k in keep if k in t}
    if "rope_parameters" in t:  # a hybrid's draft rotates whole heads (z-lab drafts are Qwen3)
        cfg["rope_theta"] = t["rope_parameters"]["rope_theta"]
    cfg.update(model_type="qwen3", num_hidden_layers=DRAFT_LAYERS, block_size=BLOCK_SIZE,
               num_target_layers=t["num_hidden_layers"], architectures=["DFlashDraftModel"],
               dflash_config={"target_layer_ids": default_target_layer_ids(t["num_hidden_layers"],
                                                                           DRAFT_LAYERS),
                              "mask_token_id": t["vocab_size"] - 1})
    return cfg


def dflash2_config_for(t: dict[str, Any]) -> dict[str, Any]:
    """The z-lab DFlash2 draft config matching the target config `t`: the DFlash draft's shape
    (draft_config_for) in the published DFlash2 layout: block 8, every layer a sliding-window
    layer (window 2048) that sees the whole block (is_causal false), convolutions of 2 taps with a
    dynamic value per 16 channels, and a selector of each position's top 16 candidates at codebook
    rank 256."""
    cfg = draft_config_for(t)
    del cfg["block_size"]  # DFlash2 configs keep it in dflash_config
    cfg.update(architectures=["DFlash2DraftModel"], layer_types=["sliding_attention"] * DRAFT_LAYERS,
               sliding_window=2048, use_sliding_window=True, is_causal=False)
    cfg["dflash_config"].update(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                selector_top_k=16)
    return cfg


def check_draft_kind(preset: str, kind: str) -> None:
    """Refuse (ValueError, naming the preset) a draft kind that a preset cannot be drafted with:
    an MTP draft is the target's own multi-token-prediction layer, which only the presets whose
    config declares one (`mtp_num_hidden_layers`: the Qwen3.5 family) have."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; choose from {', '.join(DRAFT_KINDS)}")
    t = target_config(preset)
    if kind == "mtp" and not t.get("mtp_num_hidden_layers"):
        with_one = [name for name, cfg in PRESETS.items() if cfg.get("mtp_num_hidden_layers")]
        raise ValueError(f"--draft-kind mtp: preset {preset!r} (model_type {t['model_type']!r}) has no MTP layer; "
                         f"the presets with one: {', '.join(with_one)}")
