"""An HF checkpoint -> a GGUF file, written with the `gguf` package's GGUFWriter as llama.cpp's
converter (convert_hf_to_gguf.py) writes one: the same metadata keys, tensor names (through
gguf's own TensorNameMap) and tensor transforms (LLaMA's q/k row permutation; Qwen3.5's 1 + w
norms, -exp(A_log), dt_proj.bias, squeezed conv1d and tiled value heads), then quantized with
gguf.quants.quantize, or, for the K-quants the package cannot quantize, filled with random valid
blocks. The converter's work is redone here independently of flashtree's reader, so the tests
check the reader against the format, not against itself.

`convert` also returns the weights the file really holds, back in HF layout: those are what a
"dequantized safetensors copy" of the file contains (`save_reference`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import gguf
from gguf import GGMLQuantizationType as Q

ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "llama": gguf.MODEL_ARCH.LLAMA, "qwen3_5_text": gguf.MODEL_ARCH.QWEN35}
# The types written as random blocks (gguf's quantizer has none for them): the fp16 scale d (and
# dmin) of each block, so that weights are ~0.1, and its byte offsets in the block
RANDOM_SCALE = {Q.Q4_K: 1e-4, Q.Q5_K: 5e-5, Q.Q6_K: 2e-5, Q.Q3_K: 1e-3, Q.Q2_K: 3e-3, Q.IQ4_NL: 1e-3,
                Q.IQ4_XS: 3e-5}
RANDOM_SCALE_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82),
                   Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tile_value_heads(t: torch.Tensor, dim: int, keys: int, per_key: int, head_dim: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], keys, per_key, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


# the MTP layer's own tensors: HF name after `mtp.` -> the converter's intermediate name in block N
# (after model.layers.N.) and its GGUF name (after blk.N.)
MTP_NAMES = {"fc": ("eh_proj", "nextn.eh_proj"), "pre_fc_norm_embedding": ("enorm", "nextn.enorm"),
             "pre_fc_norm_hidden": ("hnorm", "nextn.hnorm"), "norm": ("shared_head.norm", "nextn.shared_head_norm")}


def mtp_block_name(name: str, layers: int) -> str:
    """The converter's Qwen3.5 MTP mixin: `mtp.layers.0.*` -> `model.layers.{layers}.*`, and the
    MTP layer's own tensors into that block under their DeepSeek-style nextn names."""
    rest = name[len("mtp."):]
    if rest.startswith("layers.0."):
        return f"model.layers.{layers}.{rest[len('layers.0.'):]}"
    stem, suffix = rest.rsplit(".", 1)
    return f"model.layers.{layers}.{MTP_NAMES[stem][0]}.{suffix}"


def converter_tensors(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """HF names -> the tensors under the converter's intermediate names, transformed as it does
    (the MTP layer renamed first, so its norms take the + 1 as the layers' do)."""
    out = {}
    mtype = cfg["model_type"]
    for name, t in state.items():
        t = t.float()
        if name.startswith("mtp."):
            name = mtp_block_name(name, cfg["num_hidden_layers"])
        if mtype == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_permute(t, cfg["num_attention_heads"])
        elif mtype == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_permute(t, cfg["num_key_value_heads"])
        if mtype == "qwen3_5_text":
            name, t = _qwen35(name, t, cfg)
        out[name] = t
    return out


def _qwen35(name: str, t: torch.Tensor, cfg: dict) -> tuple[str, torch.Tensor]:
    keys, values = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, per = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], values // keys
    if per > 1 and "linear_attn." in name:
        qk = 2 * keys * dk
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], tile_value_heads(t[qk:], 0, keys, per, dv)])
        elif ".in_proj_z." in name:
            t = tile_value_heads(t, 0, keys, per, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            t = tile_value_heads(t, 0, keys, per, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            t = tile_value_heads(t[:, None], 0, keys, per, 1)[:, 0]
        elif ".conv1d." in name:
            t = t.squeeze()
            t = torch.cat([t[:qk], tile_value_heads(t[qk:], 0, keys, per, dv)])
        elif ".out_proj." in name:
            t = tile_value_heads(t, 1, keys, per, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name[:-len(".dt_bias")] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def random_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks of a RANDOM_SCALE type: random codes and sub-scales, fp16 (super-)
    scales of a sane size."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for at in RANDOM_SCALE_AT[qtype]:
        scale = (rng.uniform(0.5, 1.5, blocks.shape[:2]) * RANDOM_SCALE[qtype]).astype(np.float16)
        blocks[:, :, at:at + 2] = scale[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def stored(name: str, t: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """(the tensor as written, its type). Like the converter, only 2-D weights whose rows split
    into whole blocks are quantized; others fall back to Q8_0, then to F32; the conv kernel is
    always F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if t.ndim != 2 or qtype == Q.F32 or t.shape[1] % block or "conv1d" in name:
        if t.ndim == 2 and qtype != Q.F32 and t.shape[1] % 32 == 0:
            return gguf.quants.quantize(t, Q.Q8_0), Q.Q8_0
        return t, Q.F32
    if qtype == Q.F16:
        return t.astype(np.float16), Q.F16
    if qtype in RANDOM_SCALE:
        return random_blocks(*t.shape, qtype, rng), qtype
    return gguf.quants.quantize(t, qtype), qtype


def _vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """The converter's get_vocab_base for a byte-level BPE tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    added = {a["id"]: a for a in tok["added_tokens"]}
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    reverse.update({i: a["content"] for i, a in added.items()})
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre: str,
                    cfg: Optional[dict] = None) -> None:
    tokens, types, merges = _vocab(model_dir, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("eos_token", w.add_eos_token_id), ("pad_token", w.add_pad_token_id),
                     ("bos_token", w.add_bos_token_id)):
        if tcfg.get(key):
            add(tokens.index(tcfg[key]))
    if (cfg or {}).get("bos_token_id") is not None and not tcfg.get("bos_token"):
        w.add_bos_token_id(cfg["bos_token_id"])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])


def write_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if cfg["model_type"] == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["head_dim"])
    if cfg["model_type"] == "qwen3_5_text":
        types = cfg["layer_types"]
        interval = types.index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types))
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(interval)
        w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """The converter's rope_freqs tensor for LLaMA-3 rope scaling."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    dim, base = cfg["head_dim"], rope.get("rope_theta", cfg.get("rope_theta"))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert(model_dir: Path, out: Path, qtype: Q = Q.F32, pre: str = "gpt-2", seed: int = 0,
            mtp: bool = False, overrides: Optional[dict[str, Q]] = None) -> dict[str, torch.Tensor]:
    """Write `model_dir` as the GGUF file `out`; return the weights the file holds, in HF
    layout and names (float32). `mtp`: keep the checkpoint's multi-token-prediction layer
    (`mtp.*`, tiny_models.add_mtp) as llama.cpp's converter keeps Qwen3.5's: one more block
    (block_count + 1, nextn_predict_layers 1) holding its layer's tensors and its own as
    `blk.N.nextn.*` (MTP_NAMES); without it they are left out. `overrides`: the type of the
    tensors whose GGUF name holds a key (`attn_v`: a mix like llama-quantize's Q4_K_M)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    state = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
             if mtp or not k.startswith("mtp.")}
    assert not mtp or "mtp.fc.weight" in state, "the checkpoint has no MTP layer (tiny_models.add_mtp)"
    arch = ARCH[cfg["model_type"]]
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers + mtp)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(w, dict(cfg, num_hidden_layers=layers + mtp))
    if mtp:
        w.add_uint32(f"{w.arch}.nextn_predict_layers", 1)
    nextn = {f"model.layers.{layers}.{inner}": f"blk.{layers}.{gguf_name}" for inner, gguf_name in MTP_NAMES.values()}
    write_tokenizer(w, model_dir, cfg["vocab_size"], pre, cfg)
    rng = np.random.default_rng(seed)
    held = {}
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    converted = converter_tensors({k: v for k, v in state.items()
                                   if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")}, cfg)
    for name, t in converted.items():
        stem, suffix = name.rsplit(".", 1)
        gname = f"{nextn[stem]}.{suffix}" if stem in nextn else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        kind = next((q for part, q in (overrides or {}).items() if f".{part}." in gname), qtype)
        data, dtype = stored(name, t.numpy(), kind, rng)
        w.add_tensor(gname, data, raw_dtype=dtype if dtype not in (Q.F32, Q.F16) else None)
        held[name] = np.asarray(gguf.quants.dequantize(data, dtype), dtype=np.float32).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _back_to_hf(held, state, cfg)


def _back_to_hf(held: dict[str, np.ndarray], state: dict[str, torch.Tensor], cfg: dict
                ) -> dict[str, torch.Tensor]:
    """Where the file's values differ from the checkpoint's (quantized 2-D weights), carry them
    back through the inverse of the converter's transforms: the transforms of 2-D weights are
    permutations, found by converting an index tensor."""
    out = {}
    for name, t in state.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        if t.dim() != 2 or "conv1d" in name:
            out[name] = t.float()  # stored as F32: the file holds the checkpoint's values
            continue
        index = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape)
        (cname, where), = converter_tensors({name: index}, cfg).items()
        back = np.empty(t.numel(), dtype=np.float32)
        back[where.numpy().astype(np.int64).reshape(-1)] = held[cname].reshape(-1)
        out[name] = torch.from_numpy(back.reshape(t.shape))
    return out


def save_reference(model_dir: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of the HF checkpoint `model_dir` whose weights are `weights`."""
    shutil.copytree(model_dir, out)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def rewrite(src: Path, out: Path, metadata: Optional[dict[str, Any]] = None,
            tensors: Optional[Callable[[str, np.ndarray], np.ndarray]] = None,
            types: Optional[dict[str, Q]] = None, left_out: tuple[str, ...] = ()) -> Path:
    """A copy of the GGUF file `src` as `out`, with the values of `metadata`'s keys replaced (each
    written in the key's own type; None drops the key), each tensor's data passed through
    `tensors(name, data)` (data as gguf's reader maps it: float arrays, or the blocks' bytes),
    the F32 tensors named in `types` quantized to their type there and those in `left_out` left out."""
    reader = gguf.GGUFReader(str(src))
    changes, types = metadata or {}, types or {}
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        dropped = key in changes and changes[key] is None
        if key.startswith("GGUF.") or key == "general.architecture" or dropped:
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(key, changes.get(key, field.contents()), field.types[0], sub_type)
    for t in reader.tensors:
        if t.name in left_out:
            continue
        data, kind = np.array(t.data), types.get(t.name, t.tensor_type)
        if t.name in types:
            data = gguf.quants.quantize(data, kind)
        w.add_tensor(t.name, tensors(t.name, data) if tensors else data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
