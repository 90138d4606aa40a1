"""Bytes per stored value, per weight type and per KV type: what the memory plan multiplies.

Weights are counted on a meta-device instance of the model (shapes without memory) by
planned_weight_bytes, so the count is exact for every architecture and layer
mix without a formula per model. A quantized weight
costs its codes plus a float16 scale and a float16 minimum per group (docs: the shared quantized
format); a GGUF file's tensors are counted as the loader keeps them in memory, which is not the
file's own size (a Q4_K block is 4.5 bits a value on disk and 5 in memory, int4 g32; an IQ4_XS
block 4.25 and 4.3125, its table layout's int8 sub-scale a group and float16 super-scale per
256 values, more where a column order narrows its super-blocks: gguf_codes.super_groups).
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..checkpoint.gguf_codes import FORMATS, TWO_LEVEL, part_format
from ..checkpoint.gguf_file import open_gguf
from ..checkpoint.gguf_draft import is_draft
from ..checkpoint.gguf_tensors import DRAFT_GLOBAL_NAMES, column_orders, is_read
from ..errors import CheckpointError
from ..models.gguf_load import Format, kept_format
from ..models import quant, quantize
from ..models.quant import HEAD_KIND, QUANT_BITS, GroupQuantized, QuantizedLinear, pick_group, quant_label, quantized_bytes
from ..models.quantize import quantizable_linears

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
GGUF_DENSE = ("F32", "F16", "BF16")  # kept in the model's dtype
# KV cache types with blocks of 32 values along head_dim: codes + one 16-bit scale per block
# (kv_storage.scale_dtype: float16, or a bfloat16 model's q4_0 in bfloat16)
KV_BLOCK_BYTES = {"q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32)}
KV_FIXED_BYTES = {"bf16": 2, "fp8": 1}


def kv_value_bytes(kv_type: str, model_dtype: torch.dtype) -> Fraction:
    """Bytes one cached K or V value takes under `kv_type` (auto: the model's dtype)."""
    if kv_type == "auto":
        return Fraction(DTYPE_BYTES[model_dtype])
    if kv_type in KV_FIXED_BYTES:
        return Fraction(KV_FIXED_BYTES[kv_type])
    if kv_type in KV_BLOCK_BYTES:
        return KV_BLOCK_BYTES[kv_type]
    raise ValueError(f"unknown KV type {kv_type!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_weight_bytes(path: Path, dtype: torch.dtype, num_layers: int,
                      max_bits: Optional[int] = None, mtp: bool = False) -> dict[str, int]:
    """Bytes per in-memory type of a GGUF file's tensors, from its header alone (open_gguf maps
    the file and reads no tensor data), kept as models/gguf_load.py keeps them: the linear
    weights of one packed slot (q/k/v, gate/up, the DeltaNet in_proj parts) in the loader's
    kept_format, a quantized embedding table in its own type (a tied lm_head shares it); every
    other tensor dense in the model's dtype. Only what the loader reads is counted
    (gguf_tensors.is_read): not the blocks from `num_layers` on (a multi-token-prediction head
    that newer converters append), nor a draft's copies of the target's embedding and lm_head;
    with `mtp` (the MTP draft of a target of `num_layers` layers), that head's block alone.
    `max_bits` (--quantize, --quantize-draft): what `_kept` says of each slot. A two-level
    type's super-blocks are those its column order keeps (gguf_codes.part_format), as loaded."""
    dense_label = f"{dtype_name(dtype)} (dense)"
    out: dict[str, int] = {}
    slots: dict[str, list[tuple[Optional[Format], int, int]]] = {}
    g = open_gguf(path)
    draft = is_draft(g)
    orders = column_orders(g, mtp)
    for t in g.tensors.values():
        if not is_read(t.name, num_layers, draft, mtp):
            continue
        kind, numel = t.kind.name, t.numel
        if kind not in GGUF_DENSE and kind not in FORMATS:
            raise CheckpointError(f"{path}: tensor {t.name} has GGUF type {kind}; supported: "
                                  f"{', '.join(GGUF_DENSE + tuple(FORMATS))}")
        slot = _gguf_slot(t.name)
        if slot is None:
            out[dense_label] = out.get(dense_label, 0) + numel * DTYPE_BYTES[dtype]
        else:  # GGUF shapes list the row length (in_features) first
            stored = None if kind in GGUF_DENSE else part_format(kind, orders(t.name) if kind in TWO_LEVEL else None)
            slots.setdefault(slot, []).append((stored, numel, t.shape[0]))
    for slot, parts in slots.items():
        numel = sum(n for _, n, _ in parts)
        kept = _kept(slot, parts, max_bits)
        label, nbytes = (dense_label, numel * DTYPE_BYTES[dtype]) if kept is None else \
            (quant_label(*kept), quantized_bytes(numel, *kept))
        out[label] = out.get(label, 0) + nbytes
    return out


def _kept(slot: str, parts: list[tuple[Optional[Format], int, int]],
          max_bits: Optional[int]) -> Optional[Format]:
    """(bits, group, lookup, super_groups) a slot is kept in, None: dense. `parts`: each one's
    stored format (None: dense), size and in_features. A slot with a quantized part is in the
    loader's kept_format; with --quantize's `max_bits`, dense slots are quantized as
    quantize_model quantizes a checkpoint's (the embedding and lm_head to HEAD_KIND)."""
    formats = [stored for stored, _, _ in parts]
    in_layers = slot not in ("lm_head", "embed")
    if any(formats):
        return kept_format(formats, in_layers, max_bits)
    group = pick_group(parts[0][2])
    if max_bits is None or group is None:
        return None
    return (max_bits if in_layers else QUANT_BITS[HEAD_KIND]), group, None, None


def planned_weight_bytes(model: nn.Module, kind: Optional[str], dtype: torch.dtype) -> dict[str, int]:
    """Bytes per storage type ("bfloat16 (dense)", "int4 g128", ...) of `model`'s parameters,
    tied ones once, after `quantize_model(model, kind)` (`kind` None: as it is), without running
    it: a meta-device model is fine, so the memory plan counts the real bytes before any weight is
    loaded. `dtype`: the floating-point parameters' dtype at load (a meta model is float32). The
    head slots (models/quantize.py) and HEAD_KIND (models/quant.py) are looked up at the call, as
    quantize_model does (benchmarks/head_quant_quality.py patches them there)."""
    out: dict[str, int] = {}
    replaced: set[int] = set()

    def add(weight: torch.Tensor, bits: int, group: int) -> None:
        label = quant_label(bits, group)
        out[label] = out.get(label, 0) + quantized_bytes(weight.numel(), bits, group)
        replaced.add(id(weight))

    if kind is not None:
        for _, _, lin in quantizable_linears(model):
            add(lin.weight, QUANT_BITS[kind], pick_group(lin.in_features))
        for slot in quantize.head_slots(model):
            if slot is not None:
                add(slot.weight, QUANT_BITS[quant.HEAD_KIND], pick_group(slot.weight.shape[1]))
    for q in model.modules():  # already quantized (a loaded model, a GGUF one)
        if isinstance(q, GroupQuantized):
            label = quant_label(q.bits, q.group, q.lookup, q.super_groups)
            out.setdefault(label, 0)
            if id(q.codes) not in replaced:  # a tied table and head share theirs
                out[label] += QuantizedLinear.planned_nbytes(q.out_features, q.in_features, q.bits, q.group,
                                                             lookup=q.lookup, super_groups=q.super_groups)
                replaced.add(id(q.codes))
    dense = {id(p): p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
             for p in model.parameters() if id(p) not in replaced}
    out = {f"{str(dtype).removeprefix('torch.')} (dense)": sum(dense.values()), **out}
    return {k: v for k, v in out.items() if v}


def quantized_model_nbytes(model: nn.Module, kind: Optional[str],
                           dtype: Optional[torch.dtype] = None) -> int:
    """Every byte `model` holds after `quantize_model(model, kind)`: planned_weight_bytes plus the
    buffers that are not weights (the RoPE table), as they are. `dtype` None: the parameters'."""
    dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    weights = {id(b) for q in model.modules() if isinstance(q, GroupQuantized) for b in q.buffers(recurse=False)}
    other = {id(b): b.numel() * b.element_size() for b in model.buffers() if id(b) not in weights}
    return sum(planned_weight_bytes(model, kind, dtype).values()) + sum(other.values())


# the linear weights models/gguf_load.py may keep quantized, by the slot that packs them
GGUF_SLOTS = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_gate_up",
              "ffn_up": "ffn_gate_up", "attn_qkv": "in_proj", "attn_gate": "in_proj", "ssm_beta": "in_proj",
              "ssm_alpha": "in_proj", "attn_output": "attn_output", "ffn_down": "ffn_down", "ssm_out": "ssm_out"}


def _gguf_slot(name: str) -> Optional[str]:
    """The packed slot a GGUF tensor loads into (None: kept dense)."""
    if name == "output.weight":
        return "lm_head"
    if name == "token_embd.weight":
        return "embed"
    if DRAFT_GLOBAL_NAMES.get(name) == "fc.weight" or name.endswith(".nextn.eh_proj.weight"):
        return "fc"  # a draft's feature projection (the MTP layer's), a linear as its layers' are
    m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", name)
    if m and m[2] in GGUF_SLOTS:
        return f"{m[1]}.{GGUF_SLOTS[m[2]]}"
    return None