"""A GGUF file as a checkpoint: opened and checked once, its metadata read back into the
transformers config.json that the HF checkpoint of the same model has.

The loaders and the memory plan already understand config.json dicts (models/loader.py's
target_config), so a GGUF target is turned into one here, from the keys llama.cpp's converter
writes (`{arch}.block_count`, `{arch}.attention.head_count`, ...), instead of growing a second
config reader. Torch-free: the HTTP process reads the tokenizer from the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from ..errors import CheckpointError
from .resolve import GGUF_SUFFIX

# GGUF architecture -> the transformers model_type whose modules load its weights
ARCHITECTURES = {"qwen3": "qwen3", "llama": "llama", "qwen35": "qwen3_5_text"}
MISSING = object()


@dataclass
class GGUFFile:
    """An opened GGUF file: `reader` is gguf's GGUFReader (memory-mapped, nothing read yet)."""

    path: Path
    reader: Any
    arch: str

    def value(self, key: str, default: Any = MISSING) -> Any:
        """The metadata value under `key` (`{arch}` is replaced by the architecture); a missing
        required key is a CheckpointError naming it."""
        key = key.format(arch=self.arch)
        field = self.reader.fields.get(key)
        if field is None:
            if default is MISSING:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks required key {key!r}")
            return default
        return field.contents()

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def tensor(self, name: str) -> Any:
        for t in self.reader.tensors:
            if t.name == name:
                return t
        raise CheckpointError(f"{self.path}: GGUF file has no tensor {name!r}")


def is_gguf(path: Path) -> bool:
    return path.suffix == GGUF_SUFFIX and path.is_file()


@lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    from gguf import GGUFReader  # imported here: only GGUF targets need it

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError, AssertionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise CheckpointError(f"{path}: GGUF metadata lacks general.architecture")
    arch = field.contents()
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    return GGUFFile(path, reader, arch)


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file at `path`, parsed once per version of the file (the engine, the tokenizer
    and the weights all ask for it); unreadable files and other architectures are refused."""
    try:
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    return _open(path.resolve(), stat.st_mtime_ns, stat.st_size)


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal the config held (1e-6, not 9.99999997e-07): the
    shortest one that rounds to the stored float32, so the model computes with the HF value."""
    import numpy as np
    return float(str(np.float32(value)))


def _rope(g: GGUFFile) -> dict[str, Any]:
    """transformers' rope_parameters from the rope keys. llama.cpp's converter writes LLaMA-3's
    scaling not as keys but as a `rope_freqs` tensor of per-frequency divisors: those are kept as
    they are (rope type `freq_factors`), which is the same inverse-frequency table."""
    rope: dict[str, Any] = {"rope_theta": _decimal(g.value("{arch}.rope.freq_base", 10000.0))}
    kind = g.value("{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in g.tensor_names():
        from gguf.quants import dequantize
        t = g.tensor("rope_freqs.weight")
        rope.update(rope_type="freq_factors",
                    freq_factors=[float(x) for x in dequantize(t.data, t.tensor_type).reshape(-1)])
    elif kind in ("none", ""):
        rope["rope_type"] = "default"
    elif kind == "linear":
        rope.update(rope_type="linear", factor=float(g.value("{arch}.rope.scaling.factor")))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(g.value("{arch}.rope.scaling.factor")),
                    original_max_position_embeddings=int(g.value("{arch}.rope.scaling.original_context_length")))
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = g.value("{arch}.rope.scaling." + gguf_key, None)
            if value is not None:
                rope[hf_key] = float(value)
    else:
        raise CheckpointError(f"{g.path}: unsupported GGUF rope scaling type {kind!r}")
    return rope


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The config.json of the HF checkpoint this GGUF file was converted from, as far as the
    loaders need it."""
    try:
        return _config(g)
    except (TypeError, ValueError, ZeroDivisionError) as e:  # a key of the wrong type or value
        raise CheckpointError(f"{g.path}: malformed GGUF metadata: {e}") from None


def _config(g: GGUFFile) -> dict[str, Any]:
    heads = int(g.value("{arch}.attention.head_count"))
    hidden = int(g.value("{arch}.embedding_length"))
    names = g.tensor_names()
    embed = g.tensor("token_embd.weight")
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[g.arch],
        "hidden_size": hidden,
        "intermediate_size": int(g.value("{arch}.feed_forward_length")),
        # newer converters append Qwen3.5's multi-token-prediction layers as extra blocks
        "num_hidden_layers": int(g.value("{arch}.block_count")) - int(g.value("{arch}.nextn_predict_layers", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.value("{arch}.attention.head_count_kv", heads)),
        "head_dim": int(g.value("{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _decimal(g.value("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(g.value("{arch}.context_length", 32768)),
        "vocab_size": int(embed.shape[-1]),  # GGUF shapes list the fastest dimension first
        # the converter leaves output.weight out when the HF model ties it to the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_k.bias") for n in names),
        "rope_parameters": _rope(g),
    }
    value_length = g.value("{arch}.attention.value_length", cfg["head_dim"])
    if int(value_length) != cfg["head_dim"]:
        raise CheckpointError(f"{g.path}: key_length {cfg['head_dim']} != value_length {value_length} "
                              "is not supported")
    if g.arch == "qwen35":
        cfg.update(_hybrid(g, cfg))
    return cfg


def _hybrid(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's linear-attention shape from the `ssm.*` keys (named after Mamba's by the
    converter: state_size is the key head dim, group_count the key heads, time_step_rank the
    value heads) and its layer pattern from full_attention_interval."""
    key_heads = int(g.value("{arch}.ssm.group_count"))
    value_heads = int(g.value("{arch}.ssm.time_step_rank"))
    inner = int(g.value("{arch}.ssm.inner_size"))
    if value_heads <= 0 or inner % value_heads or key_heads <= 0 or value_heads % key_heads:
        raise CheckpointError(f"{g.path}: inconsistent ssm shape: {key_heads} key heads, "
                              f"{value_heads} value heads, inner size {inner}")
    interval = int(g.value("{arch}.full_attention_interval", 4))
    layers = cfg["num_hidden_layers"]
    rotary = int(g.value("{arch}.rope.dimension_count", cfg["head_dim"] // 4))
    return {
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": int(g.value("{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(g.value("{arch}.ssm.state_size")),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "rope_parameters": dict(cfg["rope_parameters"], partial_rotary_factor=rotary / cfg["head_dim"]),
    }


def gguf_config(path: Path) -> Optional[dict[str, Any]]:
    """hf_config of the GGUF file at `path`; None when `path` is not a GGUF file."""
    return hf_config(open_gguf(path)) if is_gguf(path) else None
