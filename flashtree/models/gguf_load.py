"""A GGUF target whose quantized linear weights stay quantized on the device.

The GGUF reader (checkpoint/gguf_tensors.py) hands every quantized 2-D linear weight over as its
blocks, decomposed into group codes (checkpoint/gguf_codes.py); this module places them in the
model's QuantizedLinear slots (models/quant.py). A slot may pack several checkpoint weights (q/k/v,
gate/up, the DeltaNet in_proj parts), and a GGUF mix such as Q4_K_M stores them in different
types (Q4_K queries beside Q6_K values): the parts are brought to one format, the most bits and
the smallest group among them, which represents each part's codes exactly (4-bit codes are valid
8-bit codes; a group's scale and minimum repeat over its sub-groups). A dense part packed with
quantized ones (a small F32 `in_proj_a`, say) is rounded to that format, 8 bits at groups of 32
or less: the one place the loaded weights differ from the file's beyond float16 scales.

The lm_head stays quantized as the file stores it, and so does a quantized embedding table, as a
QuantizedEmbedding (a lookup dequantizes the rows it reads); a tied lm_head shares its codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..checkpoint.gguf_codes import GroupCodes, group_codes
from ..checkpoint.gguf_file import open_gguf
from ..checkpoint.gguf_tensors import read_tensors
from ..checkpoint.weights import build_module
from ..kernels.reference import unpack_codes
from .quant import QuantizedEmbedding, QuantizedLinear, quantizable_linears


def _promote(part: GroupCodes, bits: int, group: int) -> GroupCodes:
    """The same weight with `bits` >= part.bits and a `group` dividing part.group."""
    repeat = part.group // group
    return GroupCodes(part.codes, np.repeat(part.scale, repeat, axis=1),
                      np.repeat(part.minimum, repeat, axis=1), group, bits)


def _round(weight: torch.Tensor, bits: int, group: int) -> GroupCodes:
    layer = QuantizedLinear.from_float(weight.float().cpu(), bits, group)
    return GroupCodes(unpack_codes(layer.codes, bits).numpy(), layer.scale.float().numpy(),
                      layer.minimum.float().numpy(), group, bits)


def _pack(parts: list[GroupCodes | torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The parts (rows of one slot, in order) as one set of codes in their common format."""
    quantized = [p for p in parts if isinstance(p, GroupCodes)]
    bits = max(p.bits for p in quantized)
    group = min(p.group for p in quantized)
    if len(quantized) < len(parts):  # a dense part is rounded: keep its error small
        bits, group = 8, min(group, 32)
    same = [_promote(p, bits, group) if isinstance(p, GroupCodes) else _round(p, bits, group)
            for p in parts]
    return (np.concatenate([p.codes for p in same]), np.concatenate([p.scale for p in same]),
            np.concatenate([p.minimum for p in same]), group, bits)


def _slots(model: nn.Module) -> list[tuple[str, nn.Module, str, tuple[str, ...]]]:
    """(module path, parent, attribute, the checkpoint weights it packs) of every linear slot
    that may hold quantized weights: the decoder layers' linears and an untied lm_head."""
    paths = {id(m): name for name, m in model.named_modules()}
    slots = []
    for parent, attr, _ in quantizable_linears(model):
        parts = getattr(parent, "packed_parts", {}).get(attr, (attr,))
        slots.append((paths[id(parent)], parent, attr, parts))
    if not model.config.tie_word_embeddings:
        slots.append(("", model, "lm_head", ("lm_head",)))
    return slots


def load_gguf_quantized(path: Path, factory: Callable[[], nn.Module], dtype: torch.dtype,
                        device: torch.device, rename: Callable[[dict], dict],
                        optional: tuple[str, ...]) -> nn.Module:
    """The model `factory` builds, its weights from the GGUF file at `path`: quantized linear
    weights as QuantizedLinear on `device`, everything else dense in `dtype`. `rename` maps the
    dense state to the model's names (the hybrid's text_weights)."""
    state: dict[str, Any] = {}
    for name, value in read_tensors(open_gguf(path), quantized=group_codes):
        if not isinstance(value, GroupCodes):
            value = torch.from_numpy(np.require(value, requirements="W")).to(device=device, dtype=dtype)
        state[name] = value
    state = rename(state)
    with torch.device("meta"):
        model = factory()
    for prefix, parent, attr, parts in _slots(model):
        base = f"{prefix}.{{}}" if prefix else "{}"
        weights = [base.format(f"{p}.weight") for p in parts]
        if not any(isinstance(state.get(w), GroupCodes) for w in weights) or not all(w in state for w in weights):
            continue
        codes, scale, minimum, group, bits = _pack([state.pop(w) for w in weights])
        biases = [base.format(f"{p}.bias") for p in parts]
        bias = torch.cat([state.pop(b) for b in biases]) if all(b in state for b in biases) else None
        layer = QuantizedLinear.from_codes(codes, scale, minimum, group, bits, bias).to(device)
        setattr(parent, attr, layer)
        slot = base.format(attr)
        state.update({f"{slot}.{k}": v for k, v in layer.state_dict().items()})
    _embedding(model, state, dtype, device)
    for name, value in list(state.items()):  # quantized weights outside any slot: dense
        if isinstance(value, GroupCodes):
            state[name] = _dense(value).to(device=device, dtype=dtype)
    model = build_module(lambda: model, state, str(path), optional)
    if model.config.tie_word_embeddings and isinstance(model.model.embed_tokens, QuantizedEmbedding):
        model.lm_head = QuantizedLinear.sharing(model.model.embed_tokens)  # after the load: one copy
    return model


def _embedding(model: nn.Module, state: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
    """A quantized token_embd as the model's QuantizedEmbedding (its rows dequantized into
    `dtype`), in `model` and `state` alike."""
    c = state.get("model.embed_tokens.weight")
    if not isinstance(c, GroupCodes):
        return
    del state["model.embed_tokens.weight"]
    table = QuantizedEmbedding.from_codes(c.codes, c.scale, c.minimum, c.group, c.bits).to(device)
    table.dtype = dtype
    model.model.embed_tokens = table
    state.update({f"model.embed_tokens.{k}": v for k, v in table.state_dict().items()})


def _dense(c: GroupCodes) -> torch.Tensor:
    rows, cols = c.codes.shape
    w = c.codes.reshape(rows, cols // c.group, c.group).astype(np.float32) * c.scale[..., None] + c.minimum[..., None]
    return torch.from_numpy(w.reshape(rows, cols))
