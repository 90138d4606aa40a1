"""The target architectures, one entry each: the config.json `model_type`s and GGUF
`general.architecture`s it serves, its config parser, its model class, the renaming of a
checkpoint's weights into the model's names, and the per-sequence state its model keeps, sized
from the config alone (StateShape).

The loader, the memory plan and the bench find a target's architecture here instead of testing
config or model classes, so a new architecture is a model module and an entry in ARCHITECTURES.
The GGUF reader (checkpoint/gguf_*.py) turns a GGUF header into the config.json its entry parses;
it keeps the conversion rules of the architectures whose GGUF converter changed their tensors
(llama's interleaved q/k rows, qwen35's norms and DeltaNet tensors), since it may not import models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..checkpoint.gguf_header import gguf_error
from ..errors import CheckpointError
from .qwen3 import CausalLM, LMConfig
from .qwen35 import HybridCausalLM, HybridConfig, text_weights

TargetConfig = Union[LMConfig, HybridConfig]
TargetModel = Union[CausalLM, HybridCausalLM]
StateDict = dict[str, Any]


@dataclass(frozen=True)
class StateShape:
    """What one sequence's state holds per token or per copy, from the config alone: what the
    model's new_cache allocates (KVCache; HybridState for a recurrent architecture), so that the
    memory plan can count it before anything is allocated. Each attention layer keeps K and V rows
    of the config's kv heads x head_dim; each recurrent layer a float32 state and a convolution
    window in the model's dtype, and per tree node the window again and float32 delta-rule inputs."""

    attention_layers: int
    recurrent_layers: int = 0
    state_floats: int = 0    # float32 values of one layer's recurrent state
    window_values: int = 0   # model-dtype values of one layer's convolution window
    node_floats: int = 0     # float32 delta-rule inputs (k, v, g, beta) of one tree node, one layer
    scratch_values: int = 0  # per token, model-dtype activations beyond attention and MLP
    scratch_floats: int = 0  # per token, float32 activations beyond attention and MLP


def attention_state(c: LMConfig) -> StateShape:
    """A dense model: KV rows in every layer."""
    return StateShape(attention_layers=c.num_layers)


def deltanet_state(c: HybridConfig) -> StateShape:
    """A hybrid: KV rows in its full-attention layers, a Gated DeltaNet state in the others (the
    shapes HybridCausalLM.new_cache gives HybridState). Its scratch per token: the DeltaNet
    projections and, float32, the delta-rule inputs; with experts, each routed expert's SwiGLU."""
    heads, keys, values = c.linear_value_heads, c.linear_key_dim, c.linear_value_dim
    return StateShape(attention_layers=len(c.attention_layers), recurrent_layers=len(c.linear_layers),
                      state_floats=heads * keys * values, window_values=(c.conv_kernel - 1) * c.conv_channels,
                      node_floats=heads * (keys + values + 2),
                      scratch_values=2 * c.conv_channels + 2 * heads * values + 3 * c.experts_per_token * c.expert_size,
                      scratch_floats=heads * (keys + values))


def same_names(state: StateDict) -> StateDict:
    """A checkpoint already under the model's names."""
    return state


@dataclass(frozen=True)
class Architecture:
    """How a target architecture is recognised, parsed, built and sized.

    `model_types[0]` is what a GGUF file of one of `gguf_names` is read as. `recurrent`: its state
    holds the whole sequence (Gated DeltaNet layers), so it goes back only to kept checkpoints and
    the plan counts its states, their checkpoints and a tree's per-node inputs."""

    name: str
    model_types: tuple[str, ...]
    parse: Callable[[dict[str, Any]], TargetConfig]      # config.json dict -> config
    model: Callable[[Any, int], TargetModel]             # (config, max positions) -> module
    shape: Callable[[Any], StateShape]
    rename: Callable[[StateDict], StateDict] = same_names  # checkpoint names -> the model's
    recurrent: bool = False
    gguf_names: tuple[str, ...] = ()


ARCHITECTURES = (
    Architecture("qwen3", ("qwen3",), LMConfig.from_hf, CausalLM, attention_state, gguf_names=("qwen3",)),
    Architecture("llama", ("llama",), LMConfig.from_hf, CausalLM, attention_state, gguf_names=("llama",)),
    # the vision-language checkpoints (qwen3_5, qwen3_5_moe) hold the text model under text_config;
    # Qwen3.6 and Qwen3.8 (27B dense, 2.4T-A95B MoE) publish under these names too
    Architecture("qwen3.5", ("qwen3_5_text", "qwen3_5"), HybridConfig.from_hf, HybridCausalLM, deltanet_state,
                 text_weights, recurrent=True, gguf_names=("qwen35",)),
    Architecture("qwen3.5-moe", ("qwen3_5_moe_text", "qwen3_5_moe"), HybridConfig.from_hf, HybridCausalLM,
                 deltanet_state, text_weights, recurrent=True),
)


# Architectures known by name that no entry serves, and why: a family whose name suggests it loads
# like its siblings is refused saying what it adds, not only that its name is unknown. Qwen3.8's
# 27B and 2.4T-A95B checkpoints are Qwen3.5's architecture under Qwen3.5's names (served above);
# Qwen3.8-Flash-Next is transformers' Qwen4Exp, GGUF `qwen4exp`.
_FLASH_NEXT = ("Qwen3.8-Flash-Next (Qwen4Exp), whose hyper-connection residual streams, hashed n-gram "
               "per-layer embeddings and indexed sparse attention layers flashtree does not implement")
NOT_SERVED = {"qwen4_exp": _FLASH_NEXT, "qwen4_exp_text": _FLASH_NEXT}
NOT_SERVED_GGUF = {"qwen4exp": _FLASH_NEXT}


def _refusal(kind: str, name: Any, why: dict[str, str], supported: list[str]) -> str:
    """Why `name` (config.json's value, whatever JSON type it is: a list is refused as one more
    name, not a TypeError from the lookup in `why`) is served by no architecture."""
    known = isinstance(name, str) and name in why
    said = f"{kind} {name!r} is not supported: it is {why[name]}" if known else f"unsupported {kind} {name!r}"
    return f"{said}; supported: {', '.join(supported)}"


def by_model_type(model_type: Optional[str]) -> Architecture:
    """The architecture serving a config.json `model_type`; others are refused by name."""
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    raise CheckpointError(_refusal("model_type", model_type, NOT_SERVED,
                                   [t for a in ARCHITECTURES for t in a.model_types]))


def by_gguf(name: str, path: Path) -> Architecture:
    """The architecture serving a GGUF file's `general.architecture`; others are refused."""
    for arch in ARCHITECTURES:
        if name in arch.gguf_names:
            return arch
    raise gguf_error(path, "general.architecture", _refusal("GGUF architecture", name, NOT_SERVED_GGUF,
                                                            [n for a in ARCHITECTURES for n in a.gguf_names]))


def architecture_of(cfg: TargetConfig) -> Architecture:
    """The architecture of a parsed target config."""
    return by_model_type(cfg.model_type)
