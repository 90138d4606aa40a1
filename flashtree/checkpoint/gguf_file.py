"""A GGUF file as a checkpoint: opened and checked once, its metadata read back into the
transformers config.json that the HF checkpoint of the same model has.

The loaders and the memory plan already understand config.json dicts (models/loader.py's
target_config), so a GGUF target is turned into one here, from the keys llama.cpp's converter
writes (`{arch}.block_count`, `{arch}.attention.head_count`, ...), instead of growing a second
config reader. Which architecture serves a file's `general.architecture`, and so the config's
model_type, is the registry's to say (models/registry.py), which the loader asks. Torch-free:
the HTTP process reads the tokenizer from the same file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import CheckpointError
from .gguf_header import BOOL, FLOATS, INTEGERS, STRING, Header, TensorInfo, Value, gguf_error, read_header
from .resolve import GGUF_SUFFIX

MISSING = object()


@dataclass
class GGUFFile:
    """An opened GGUF file: its checked header (gguf_header.py) and architecture. Metadata is
    read through typed accessors, so a key of the wrong type or an impossible value is an error
    naming the key, not a TypeError where the value is used."""

    header: Header
    arch: str

    @property
    def path(self) -> Path:
        return self.header.path

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.header.tensors

    def error(self, where: str, problem: str) -> CheckpointError:
        return gguf_error(self.path, where, problem)

    def _field(self, key: str, default: Any, kinds: tuple[int, ...], array: bool, expected: str
               ) -> tuple[str, Any, bool]:
        """(the key with `{arch}` replaced, its value, whether the file has it): a value of another
        type than `kinds` or a missing key without a `default` is an error naming the key."""
        key = key.format(arch=self.arch)
        value: Optional[Value] = self.header.fields.get(key)
        if value is None:
            if default is MISSING:
                raise self.error(key, "missing (a required key)")
            return key, default, False
        if value.array != array or value.kind not in kinds:
            raise self.error(key, f"expected {expected}, found {value.describe()}")
        return key, value.data, True

    def integer(self, key: str, default: Any = MISSING, least: Optional[int] = None) -> int:
        key, value, present = self._field(key, default, INTEGERS, False, "an integer")
        if present and least is not None and value < least:
            raise self.error(key, f"must be at least {least}, found {value}")
        return value

    def positive(self, key: str, default: Any = MISSING) -> float:
        """A number that must be finite and above zero (a norm epsilon, a RoPE base or factor)."""
        key, value, present = self._field(key, default, INTEGERS + FLOATS, False, "a number")
        if present and not (math.isfinite(value) and value > 0):
            raise self.error(key, f"must be a positive finite number, found {value}")
        return value

    def string(self, key: str, default: Any = MISSING) -> str:
        return self._field(key, default, (STRING,), False, "a string")[1]

    def flag(self, key: str, default: Any = MISSING) -> bool:
        return self._field(key, default, (BOOL,), False, "a bool")[1]

    def strings(self, key: str, default: Any = MISSING) -> list[str]:
        return self._field(key, default, (STRING,), True, "an array of string")[1]

    def flags(self, key: str, default: Any = MISSING) -> list[bool]:
        value = self._field(key, default, (BOOL,), True, "an array of bool")[1]
        return [bool(v) for v in value]

    def integers(self, key: str, default: Any = MISSING) -> list[int]:
        value = self._field(key, default, INTEGERS, True, "an array of integers")[1]
        return value.tolist() if isinstance(value, np.ndarray) else value

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise self.error(name, "missing (a required tensor)")
        return self.tensors[name]

    def data(self, t: TensorInfo) -> np.ndarray:
        return self.header.data(t)


def is_gguf(path: Path) -> bool:
    return path.suffix == GGUF_SUFFIX and path.is_file()


@lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    header = read_header(path)
    return GGUFFile(header, GGUFFile(header, "").string("general.architecture"))


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file at `path`, parsed once per version of the file (the engine, the tokenizer
    and the weights all ask for it); unreadable files are refused (and architectures no entry of
    models/registry.py serves, where the loader reads the config)."""
    try:
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    return _open(path.resolve(), stat.st_mtime_ns, stat.st_size)


def float32_decimal(value: float) -> float:
    """A float32 metadata value as the decimal the config held (1e-6, not 9.99999997e-07): the
    shortest one that rounds to the stored float32, so the model computes with the HF value."""
    return float(str(np.float32(value)))


def _rope(g: GGUFFile) -> dict[str, Any]:
    """transformers' rope_parameters from the rope keys. llama.cpp's converter writes LLaMA-3's
    scaling not as keys but as a `rope_freqs` tensor of per-frequency divisors: those are kept as
    they are (rope type `freq_factors`), which is the same inverse-frequency table."""
    rope: dict[str, Any] = {"rope_theta": float32_decimal(g.positive("{arch}.rope.freq_base", 10000.0))}
    kind = g.string("{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in g.tensors:
        from gguf.quants import dequantize
        t = g.tensors["rope_freqs.weight"]
        factors = dequantize(g.data(t), t.kind).reshape(-1)
        if not np.all(np.isfinite(factors) & (factors > 0)):
            raise g.error(t.name, "its frequency divisors must be positive finite numbers")
        rope.update(rope_type="freq_factors", freq_factors=[float(x) for x in factors])
    elif kind in ("none", ""):
        rope["rope_type"] = "default"
    elif kind == "linear":
        rope.update(rope_type="linear", factor=g.positive("{arch}.rope.scaling.factor"))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=g.positive("{arch}.rope.scaling.factor"),
                    original_max_position_embeddings=g.integer("{arch}.rope.scaling.original_context_length",
                                                               least=1))
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = g.positive("{arch}.rope.scaling." + gguf_key, None)
            if value is not None:
                rope[hf_key] = float(value)
    else:
        raise g.error(f"{g.arch}.rope.scaling.type", f"unsupported GGUF rope scaling type {kind!r}")
    return rope


def shape_config(g: GGUFFile) -> dict[str, Any]:
    """The decoder-layer shape a target and a draft share (models/common.py: LayerShape), from
    the keys llama.cpp's converter writes for both: each key read in its type and range (counts
    at least 1, the norm epsilon and RoPE base positive and finite)."""
    heads = g.integer("{arch}.attention.head_count", least=1)
    hidden = g.integer("{arch}.embedding_length", least=1)
    blocks = g.integer("{arch}.block_count", least=1)
    # newer converters append Qwen3.5's multi-token-prediction layers as extra blocks
    layers = blocks - g.integer("{arch}.nextn_predict_layers", 0, least=0)
    if layers < 1:
        raise g.error(f"{g.arch}.block_count", f"all {blocks} blocks are multi-token prediction layers "
                                               f"({g.arch}.nextn_predict_layers): no decoder layer is left")
    if f"{g.arch}.attention.key_length" not in g.header.fields and hidden % heads:
        raise g.error(f"{g.arch}.attention.head_count", f"{heads} heads do not divide embedding_length {hidden}, "
                                                        "and no key_length gives the head size")
    head_dim = g.integer("{arch}.attention.key_length", hidden // heads, least=1)
    if g.integer("{arch}.attention.value_length", head_dim, least=1) != head_dim:
        raise g.error(f"{g.arch}.attention.value_length", f"differs from key_length {head_dim} (not supported)")
    return {
        "hidden_size": hidden,
        "intermediate_size": g.integer("{arch}.feed_forward_length", least=1),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": g.integer("{arch}.attention.head_count_kv", heads, least=1),
        "head_dim": head_dim,
        "rms_norm_eps": float32_decimal(g.positive("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": g.integer("{arch}.context_length", 32768, least=1),
        "attention_bias": any(n.endswith(".attn_k.bias") for n in g.tensors),
        "rope_parameters": _rope(g),
    }


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The config.json of the HF checkpoint this GGUF target was converted from, as far as the
    loaders need it, but for its model_type (the loader's, from the file's architecture): the
    layer shape (shape_config), and the vocabulary and tying of the embedding table, which must
    agree with the keys."""
    cfg = shape_config(g)
    hidden = cfg["hidden_size"]
    embed = g.tensor("token_embd.weight")
    if len(embed.shape) != 2 or embed.shape[0] != hidden:  # GGUF shapes list the row length first
        raise g.error(embed.name, f"shape {list(embed.shape)} is not [embedding_length {hidden}, vocabulary]")
    if g.integer("{arch}.vocab_size", embed.shape[1]) != embed.shape[1]:
        raise g.error(f"{g.arch}.vocab_size", f"differs from the {embed.shape[1]} rows of token_embd.weight")
    cfg.update(vocab_size=embed.shape[1],
               # the converter leaves output.weight out when the HF model ties it to the embedding
               tie_word_embeddings="output.weight" not in g.tensors)
    if g.arch == "qwen35":
        cfg.update(_hybrid(g, cfg))
    return cfg


def _hybrid(g: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's linear-attention shape from the `ssm.*` keys (named after Mamba's by the
    converter: state_size is the key head dim, group_count the key heads, time_step_rank the
    value heads), its layer pattern from full_attention_interval and, where the file carries one,
    its multi-token-prediction layers (nextn_predict_layers: mtp_num_hidden_layers)."""
    key_heads = g.integer("{arch}.ssm.group_count", least=1)
    value_heads = g.integer("{arch}.ssm.time_step_rank", least=1)
    inner = g.integer("{arch}.ssm.inner_size", least=1)
    if inner % value_heads or value_heads % key_heads:
        raise g.error(f"{g.arch}.ssm", f"inconsistent shape: {key_heads} key heads (group_count), {value_heads} "
                                       f"value heads (time_step_rank), inner size {inner}")
    interval = g.integer("{arch}.full_attention_interval", 4, least=1)
    layers = cfg["num_hidden_layers"]
    rotary = g.integer("{arch}.rope.dimension_count", cfg["head_dim"] // 4, least=1)
    shape = {
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": g.integer("{arch}.ssm.conv_kernel", least=1),
        "linear_key_head_dim": g.integer("{arch}.ssm.state_size", least=1),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "rope_parameters": dict(cfg["rope_parameters"], partial_rotary_factor=rotary / cfg["head_dim"]),
    }
    mtp = g.integer("{arch}.nextn_predict_layers", 0, least=0)  # the MTP head's layers, appended as blocks
    return {**shape, "mtp_num_hidden_layers": mtp} if mtp else shape
