"""A GGUF target or draft whose quantized linear weights stay quantized on the device.

The GGUF reader (checkpoint/gguf_tensors.py) hands every quantized 2-D linear weight over as its
blocks, decomposed into group codes (checkpoint/gguf_codes.py); this module places them in the
model's QuantizedLinear slots (models/quant.py). A slot may pack several checkpoint weights (q/k/v,
gate/up, the DeltaNet in_proj parts), and a GGUF mix such as Q4_K_M stores them in different
types (Q4_K queries beside Q6_K values): the parts are brought to one format, the most bits and
the smallest group among them, which represents each part's codes exactly (4-bit codes are valid
8-bit codes; a group's scale and minimum repeat over its sub-groups). Parts all of the IQ4 types
keep the 4-bit table layout: IQ4_NL alone its float16 scales, else IQ4_XS's two levels, in the
smallest super-blocks among the parts (an IQ4_NL part's are single groups: its d the super-scale,
1 the sub-scale); IQ4 parts packed with another type are widened to affine 8-bit codes first
(gguf_codes.widen).
A dense part packed with quantized ones (a small F32 `in_proj_a`, say) is rounded to that
format, 8 bits at groups of 32 or less: the one place the loaded weights differ from the file's beyond float16 scales, unless
--quantize asks the decoder layers' slots for fewer bits than the file keeps (`max_bits`). A
draft's slots are all its quantizable linears (models/quant.py: quantizable_linears), and
--quantize-draft is its `max_bits`; its other quantized tensors (a DFlash2 draft's small
projections and codebooks, which it keeps dense) are dequantized.

The lm_head stays quantized as the file stores it, and so does a quantized embedding table, as a
QuantizedEmbedding (a lookup dequantizes the rows it reads); a tied lm_head shares its codes.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..checkpoint.gguf_codes import (IQ4_VALUES, LOOKUP_TYPES, TWO_LEVEL, WIDENED, GroupCodes, group_codes,
                                      group_scales, part_format, widen)
from ..checkpoint.gguf_file import open_gguf
from ..checkpoint.gguf_tensors import QuantizedTensor, read_tensors
from ..checkpoint.weights import build_module
from ..kernels.reference import unpack_codes
from .quant import GGUF_REQUANT_GROUP, QuantizedEmbedding, QuantizedLinear
from .quantize import quantizable_linears

log = logging.getLogger("flashtree.load")


def _promote(part: GroupCodes, bits: int, group: int) -> GroupCodes:
    """The same weight with `bits` >= part.bits and a `group` dividing part.group."""
    repeat = part.group // group
    return GroupCodes(part.codes, np.repeat(part.scale, repeat, axis=1),
                      np.repeat(part.minimum, repeat, axis=1), group, bits)


def _round(weight: torch.Tensor, bits: int, group: int) -> GroupCodes:
    layer = QuantizedLinear.from_float(weight.float().cpu(), bits, group)
    return GroupCodes(unpack_codes(layer.codes, bits).numpy(), layer.scale.float().numpy(),
                      layer.minimum.float().numpy(), group, bits)


Format = tuple[int, int, Optional[str], Optional[int]]  # bits, group, lookup, super_groups (gguf_codes.FORMATS)


def kept_format(formats: Sequence[Optional[Format]], in_layers: bool, max_bits: Optional[int] = None) -> Format:
    """(bits, group, lookup, super_groups) of a slot whose parts are stored as `formats`: each
    quantized part's as it unpacks (gguf_codes.part_format), None for a dense part; at least one
    is quantized. Parts all in the table layout keep it, a 4-bit format that --quantize's
    `max_bits` leaves alone: IQ4_NL alone as it is, else IQ4_XS's two levels in the fewest groups
    a part's super-scale covers (an IQ4_NL part's one). Otherwise table parts count as their
    widened 8-bit codes, and the most bits and the smallest group hold every quantized part
    exactly; a dense part rounded into them takes 8 bits at groups of 32 or less; and with
    `max_bits`, a decoder layer's slot above it is rounded to it in groups of GGUF_REQUANT_GROUP.
    The loader and the memory plan both follow it."""
    lookups = {f[2] for f in formats if f is not None}
    if None not in formats and None not in lookups:
        lookup = max(lookups, key=LOOKUP_TYPES.index)  # IQ4_XS's two levels hold IQ4_NL's scales
        return 4, formats[0][1], lookup, min(f[3] or 1 for f in formats) if lookup in TWO_LEVEL else None
    quantized = [(8, g) if lookup else (b, g) for b, g, lookup, _ in filter(None, formats)]
    bits, group = max(b for b, _ in quantized), min(g for _, g in quantized)
    if len(quantized) < len(formats):  # a dense part is rounded: keep its error small
        bits, group = 8, min(group, 32)
    if max_bits is not None and in_layers and bits > max_bits:
        return max_bits, GGUF_REQUANT_GROUP, None, None
    return bits, group, None, None


def _levels(part: GroupCodes, super_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """A table part's (sub-scales, super-scales) with a super-scale per `super_groups` groups, no
    more than its own: an IQ4_NL part's d as the super-scale of each group, under sub-scale 1."""
    if part.superscale is None:
        return np.ones_like(part.scale), part.scale
    return part.scale, np.repeat(part.superscale, part.scale.shape[1] // part.superscale.shape[1] // super_groups,
                                 axis=1)


def _pack(parts: list[GroupCodes | torch.Tensor], bits: int, group: int, lookup: Optional[str],
          super_groups: Optional[int]) -> GroupCodes:
    """The parts (rows of one slot, in order) as one set of codes in the format (bits, group,
    lookup, super_groups)."""
    if lookup is not None:
        codes = np.concatenate([p.codes for p in parts])
        if super_groups is None:
            return GroupCodes(codes, np.concatenate([p.scale for p in parts]), None, group, bits, lookup)
        sub, superscale = zip(*(_levels(p, super_groups) for p in parts))
        return GroupCodes(codes, np.concatenate(sub), None, group, bits, lookup, np.concatenate(superscale))
    same = [_promote(widen(p), bits, group) if isinstance(p, GroupCodes) else _round(p, bits, group)
            for p in parts]
    return GroupCodes(np.concatenate([p.codes for p in same]), np.concatenate([p.scale for p in same]),
                      np.concatenate([p.minimum for p in same]), group, bits)


@dataclass
class Slot:
    """A linear slot that may hold quantized weights, and the checkpoint weights it packs."""

    path: str  # the slot's module name in the model
    in_layers: bool  # a decoder layer's linear (not the lm_head)
    parent: nn.Module
    attr: str
    weights: list[str]
    biases: list[str]  # empty when the slot's linear has no bias

    def ready(self, state: dict[str, Any]) -> bool:
        """All its weights (and biases) are read, and at least one is quantized."""
        return (all(n in state for n in self.weights + self.biases)
                and any(isinstance(state[w], QuantizedTensor) for w in self.weights))

    def build(self, parts: list[QuantizedTensor | torch.Tensor], bias: Optional[torch.Tensor],
              device: torch.device, max_bits: Optional[int]) -> QuantizedLinear:
        """The slot's QuantizedLinear on `device` (run on a worker thread), in kept_format: the
        parts' codes packed exactly, or rounded from their values where `max_bits` asks for fewer."""
        unpacked = [group_codes(p) if isinstance(p, QuantizedTensor) else p for p in parts]
        packed = _pack(unpacked, *kept_format(part_formats(parts), self.in_layers))
        bits, group, lookup, _ = kept_format(part_formats(parts), self.in_layers, max_bits)
        if (bits, group, lookup) != (packed.bits, packed.group, packed.lookup):
            return QuantizedLinear.from_float(_dense(packed), bits, group, bias, device)
        return QuantizedLinear.from_codes(packed.codes, packed.scale, packed.minimum, group, bits, bias,
                                          lookup, packed.superscale).to(device)


def part_formats(parts: Sequence[QuantizedTensor | torch.Tensor]) -> list[Optional[Format]]:
    """Each part's format as it unpacks (gguf_codes.part_format), None for a dense one."""
    return [part_format(p.qtype, p.column_order) if isinstance(p, QuantizedTensor) else None for p in parts]


def _tied(model: nn.Module) -> bool:
    """A target whose lm_head is its embedding table (a draft has neither: it uses the target's)."""
    return hasattr(model, "lm_head") and model.config.tie_word_embeddings


def _slots(model: nn.Module) -> dict[str, Slot]:
    """Every linear slot that may hold quantized weights (a target's decoder layers' linears and
    untied lm_head; a draft's linears, quantizable_linears), by the name of each checkpoint
    weight it packs."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = [(parent, attr, True) for parent, attr, _ in quantizable_linears(model)]
    if hasattr(model, "lm_head") and not _tied(model):
        found.append((model, "lm_head", False))
    slots = {}
    for parent, attr, in_layers in found:
        prefix = paths[id(parent)]
        parts = getattr(parent, "packed_parts", {}).get(attr, (attr,))
        names = [f"{prefix}.{p}" if prefix else p for p in parts]
        has_bias = getattr(parent, attr).bias is not None
        slot = Slot(f"{prefix}.{attr}" if prefix else attr, in_layers, parent, attr,
                    [f"{n}.weight" for n in names], [f"{n}.bias" for n in names] if has_bias else [])
        slots.update({w: slot for w in slot.weights + slot.biases})
    return slots


def load_gguf_quantized(path: Path, factory: Callable[[], nn.Module], dtype: torch.dtype,
                        device: torch.device, rename: Callable[[dict], dict],
                        optional: tuple[str, ...], max_bits: Optional[int] = None, mtp: bool = False) -> nn.Module:
    """The model `factory` builds (a target, or a draft), its weights from the GGUF file at
    `path`: quantized linear weights as QuantizedLinear on `device`, everything else dense in
    `dtype`. `rename` maps the
    dense state to the model's names (the hybrid's text_weights). `max_bits` (--quantize with a
    GGUF target): the decoder layers' slots kept with more bits (Q5_K, Q6_K, Q8_0, or a slot they
    promote) are requantized to it, which a Q4_K_M 27B needs to fit a 24 GB card.
    A tensor the model has no weight for, or holds in another shape than the config implies, is
    refused as it is read (gguf_tensors.read_tensors), before it is reordered or packed. `mtp`: the
    model is the MTP draft, read from the target file's nextn block.

    A slot is built as soon as its last part has been read, on a pool of threads (numpy's and
    torch's array operations release the GIL), and at most two per thread wait unplaced: so the
    unpacked codes of a 27B file (a byte per weight) never sit in host memory all at once, and
    every core unpacks."""
    with torch.device("meta"):
        model = factory()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # as the config implies
    slots = _slots(model)
    state: dict[str, Any] = {}
    building: deque[tuple[Slot, Future]] = deque()
    workers = len(os.sched_getaffinity(0))

    def place(everything: bool) -> None:
        while building and (everything or len(building) > 2 * workers or building[0][1].done()):
            slot, job = building.popleft()
            layer = job.result()
            setattr(slot.parent, slot.attr, layer)
            state.update({f"{slot.path}.{k}": v for k, v in layer.state_dict().items()})

    widened: set[str] = set()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for raw_name, raw in read_tensors(open_gguf(path), quantized=lambda t: t, shapes=shapes, mtp=mtp):
            for name, value in rename({raw_name: raw}).items():
                if not isinstance(value, QuantizedTensor):
                    value = torch.from_numpy(np.require(value, requirements="W")).to(device=device, dtype=dtype)
                elif value.qtype in WIDENED:
                    widened.add(value.qtype)
                state[name] = value
                slot = slots.get(name)
                if slot is not None and slot.ready(state):
                    parts = [state.pop(w) for w in slot.weights]
                    bias = torch.cat([state.pop(b) for b in slot.biases]) if slot.biases else None
                    if kept_format(part_formats(parts), slot.in_layers)[2] is None:  # IQ4 parts widened
                        widened.update(p.qtype for p in parts
                                       if isinstance(p, QuantizedTensor) and p.qtype in LOOKUP_TYPES)
                    building.append((slot, pool.submit(slot.build, parts, bias, device, max_bits)))
            place(everything=False)
        place(everything=True)
        left = [n for n, v in state.items() if isinstance(v, QuantizedTensor)]
        state.update(zip(left, pool.map(group_codes, [state[n] for n in left])))
    if widened:
        log.warning("%s: %s weights are held as 8-bit codes (exact, more memory than the file; the "
                    "kernels take 4-bit codes only as affine groups of 32 or more, or IQ4 tables "
                    "packed with no other type)", path.name, ", ".join(sorted(widened)))
    _embedding(model, state, dtype, device)
    for name, value in list(state.items()):  # quantized weights outside any slot: dense
        if isinstance(value, GroupCodes):
            state[name] = _dense(value).to(device=device, dtype=dtype)
    model = build_module(lambda: model, state, str(path), optional)
    if _tied(model) and isinstance(model.model.embed_tokens, QuantizedEmbedding):
        model.lm_head = QuantizedLinear.sharing(model.model.embed_tokens)  # after the load: one copy
    return model


def _embedding(model: nn.Module, state: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
    """A quantized token_embd as the model's QuantizedEmbedding (its rows dequantized into
    `dtype`), in `model` and `state` alike."""
    c = state.get("model.embed_tokens.weight")
    if not isinstance(c, GroupCodes):
        return
    del state["model.embed_tokens.weight"]
    table = QuantizedEmbedding.from_codes(c.codes, c.scale, c.minimum, c.group, c.bits, lookup=c.lookup,
                                          superscale=c.superscale).to(device)
    table.dtype = dtype
    model.model.embed_tokens = table
    state.update({f"model.embed_tokens.{k}": v for k, v in table.state_dict().items()})


def _dense(c: GroupCodes) -> torch.Tensor:
    rows, cols = c.codes.shape
    codes = (IQ4_VALUES[c.codes] if c.lookup else c.codes).reshape(rows, cols // c.group, c.group)
    w = codes.astype(np.float32) * group_scales(c)[..., None]
    return torch.from_numpy((w if c.lookup else w + c.minimum[..., None]).reshape(rows, cols))
