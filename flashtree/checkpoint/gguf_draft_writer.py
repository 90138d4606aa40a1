"""A DFlash or DFlash2 draft checkpoint (z-lab's format: config.json + safetensors) -> a GGUF
file in llama.cpp's naming (checkpoint/gguf_draft.py), F32, F16, BF16, Q8_0 or Q4_K:

    python -m flashtree.checkpoint.gguf_draft_writer DRAFT_DIR OUT.gguf --type q8_0

The file is written with the `gguf` package's GGUFWriter. As llama.cpp's converter and
llama-quantize do, only 2-D weights take the chosen type, and only where their rows split into
its blocks (else Q8_0, else F16); norms and a DFlash2 draft's convolution base kernels stay F32.
gguf cannot quantize Q4_K, so `quantize_q4_k` does it here: per 32-value sub-block an affine fit
(scale, and a minimum clipped at zero as Q4_K's offset only subtracts), the 8 sub-block scales
and minimums of a 256-value block as 6-bit multiples of two float16 super-scales. A draft loaded
from the file is the safetensors draft with each weight replaced by its dequantized value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import quantize

from ..errors import CheckpointError
from .gguf_draft import DFLASH2_ARCHITECTURE, LLAMA_CPP
from .gguf_tensors import DRAFT_LAYER_NAMES
from .presets import default_target_layer_ids

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K}
PREFIX = f"{LLAMA_CPP}."
# the checkpoint's name -> the GGUF name written: llama.cpp's spelling of each, one of those the
# reader takes (gguf_tensors.DRAFT_GLOBAL_NAMES); a layer's post-attention norm is llama.cpp's `ffn_norm`
WRITTEN = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
           "norm.weight": "output_norm.weight",
           "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
           "candidate_selector.successor_codebook": "selector_successor.weight",
           "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
LAYER_WRITTEN = {v: k for k, v in DRAFT_LAYER_NAMES.items() if k != "post_attention_norm"}
CONV = {"attention_conv": "attn_conv", "mlp_conv": "ffn_conv"}


def gguf_name(name: str) -> str:
    """The GGUF name of a z-lab draft checkpoint's tensor (codebooks saved with or without
    `.weight`); another name is an error naming it."""
    name = name.removesuffix(".weight") if name.endswith("_codebook.weight") else name
    if name in WRITTEN:
        return WRITTEN[name]
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4 and parts[1].isdigit():
        block, rest = f"blk.{parts[1]}", ".".join(parts[2:])
        if parts[2] in CONV and rest.endswith(".base_kernel"):
            return f"{block}.{CONV[parts[2]]}_base"
        stem, suffix = rest.rsplit(".", 1)
        if stem in LAYER_WRITTEN and suffix in ("weight", "bias"):
            return f"{block}.{LAYER_WRITTEN[stem]}.{suffix}"
    raise CheckpointError(f"draft tensor {name!r} has no GGUF name (not a DFlash or DFlash2 draft's)")


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks [rows, cols / 256 * 144] of a float32 matrix whose rows split into 256s."""
    rows, cols = w.shape
    x = w.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0.0)
    scale, offset = (x.max(-1) - low) / 15, -low  # a sub-block's step and what is subtracted
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)

    def six_bits(value: np.ndarray, sup: np.ndarray) -> np.ndarray:
        sup = sup.astype(np.float32)[..., None]
        return np.clip(np.rint(np.divide(value, sup, out=np.zeros_like(value), where=sup > 0)), 0, 63).astype(np.uint8)

    ls, lm = six_bits(scale, d), six_bits(offset, dmin)
    step = d.astype(np.float32)[..., None] * ls
    shift = dmin.astype(np.float32)[..., None] * lm
    q = np.divide(x + shift[..., None], step[..., None], out=np.zeros_like(x), where=step[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    scales = np.zeros((rows, cols // 256, 12), np.uint8)
    scales[..., :4] = ls[..., :4] | (ls[..., 4:] >> 4) << 6
    scales[..., 4:8] = lm[..., :4] | (lm[..., 4:] >> 4) << 6
    scales[..., 8:] = (ls[..., 4:] & 0xF) | (lm[..., 4:] & 0xF) << 4
    pairs = q.reshape(rows, cols // 256, 4, 2, 32)  # sub-blocks 2j (low nibbles) and 2j + 1 (high)
    qs = (pairs[:, :, :, 0] | pairs[:, :, :, 1] << 4).reshape(rows, cols // 256, 128)
    head = np.stack([d, dmin], -1).view(np.uint8).reshape(rows, cols // 256, 4)
    return np.concatenate([head, scales, qs], -1).reshape(rows, -1)


def stored(name: str, t: np.ndarray, kind: Q) -> tuple[np.ndarray, Q]:
    """(the tensor's data as written, its type), by the rule of the module's docstring."""
    if t.ndim != 2 or kind == Q.F32:
        return t.astype(np.float32), Q.F32
    for candidate in (kind, Q.Q8_0, Q.F16):
        if t.shape[1] % GGML_QUANT_SIZES[candidate][0] == 0:
            kind = candidate
            break
    if kind == Q.F16:
        return t.astype(np.float16), kind
    return (quantize_q4_k(t) if kind == Q.Q4_K else quantize(t, kind)), kind


def _value(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    """A DFlash key from dflash_config, else the config's top level (as models/dflash*.py read it)."""
    for where in (cfg.get("dflash_config") or {}, cfg):
        if where.get(key) is not None:
            return where[key]
    return default


def _rope(w: GGUFWriter, cfg: dict[str, Any]) -> None:
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if kind == "linear":
        w.add_string(PREFIX + "rope.scaling.type", "linear")
        w.add_float32(PREFIX + "rope.scaling.factor", float(rope["factor"]))
    elif kind == "yarn":
        w.add_string(PREFIX + "rope.scaling.type", "yarn")
        w.add_float32(PREFIX + "rope.scaling.factor", float(rope["factor"]))
        w.add_uint32(PREFIX + "rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
        for hf_key, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(hf_key) is not None:
                w.add_float32(PREFIX + "rope.scaling." + key, float(rope[hf_key]))
    elif kind != "default":
        raise CheckpointError(f"draft rope type {kind!r} cannot be written (default, linear and yarn can)")


def write_metadata(w: GGUFWriter, cfg: dict[str, Any]) -> None:
    """The draft's config.json as the keys gguf_draft.py reads (`dflash` naming)."""
    layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w.add_name("DFlash2 draft" if DFLASH2_ARCHITECTURE in (cfg.get("architectures") or []) else "DFlash draft")
    w.add_block_count(layers)
    w.add_context_length(int(cfg.get("max_position_embeddings") or 32768))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    _rope(w, cfg)
    w.add_uint32(PREFIX + "block_size", int(_value(cfg, "block_size", 16)))
    ids = _value(cfg, "target_layer_ids")
    if ids is None:
        if not cfg.get("num_target_layers"):
            raise CheckpointError("draft config has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = default_target_layer_ids(int(cfg["num_target_layers"]), layers)
    w.add_array(PREFIX + "target_layers", [int(i) + 1 for i in ids])  # llama.cpp's layer 0: the embedding
    if _value(cfg, "mask_token_id") is None:
        raise CheckpointError("draft config lacks dflash_config.mask_token_id")
    w.add_mask_token_id(int(_value(cfg, "mask_token_id")))
    types = cfg.get("layer_types") or []
    if "sliding_attention" in types and cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if isinstance(cfg.get("is_causal"), bool):
        w.add_causal_attention(cfg["is_causal"])
    if DFLASH2_ARCHITECTURE in (cfg.get("architectures") or []):
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            w.add_uint32(PREFIX + key, int(_value(cfg, key)))
        scalars = (("output_multiplier", "logit_scale", 1.0), ("input_embedding_scale", "input_embedding_scale", 1.0),
                   ("final_logit_softcapping", "final_logit_softcapping", 0))
        for key, name, default in scalars:
            if float(_value(cfg, key, default)) != default:  # the reader's defaults: 1, 1, none
                w.add_float32(PREFIX + name, float(_value(cfg, key)))


def convert(draft_dir: Path, out: Path, kind: Q = Q.F16) -> None:
    """Write the draft checkpoint in `draft_dir` as the GGUF file `out`, its 2-D weights in `kind`."""
    from safetensors import safe_open  # torch: reads bfloat16, which numpy has no type for

    cfg = json.loads((draft_dir / "config.json").read_text())
    w = GGUFWriter(str(out), LLAMA_CPP)
    write_metadata(w, cfg)
    for f in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                data, dtype = stored(name, sf.get_tensor(name).float().numpy(), kind)
                w.add_tensor(gguf_name(name), data, raw_dtype=None if dtype in (Q.F32, Q.F16) else dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtree.checkpoint.gguf_draft_writer",
                                     description="Convert a DFlash or DFlash2 draft checkpoint to a GGUF file.")
    parser.add_argument("draft", type=Path, help="the draft's directory: config.json and *.safetensors")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", choices=TYPES, default="f16", help="the 2-D weights' type (default f16)")
    args = parser.parse_args(argv)
    try:
        convert(args.draft, args.out, TYPES[args.type])
    except (CheckpointError, OSError, KeyError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
