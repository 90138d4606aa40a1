"""Quantizing a loaded model in place (`--quantize int8|int4`): which of its linears take the
layers' kind, its embedding table and lm_head the head's (HEAD_KIND), and the int4 layers tiled
for the GEMM once they are on the device. The quantized modules and their formats are quant.py's.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..kernels.quant import gemm_applies, l2_prefetch_bytes
from . import quant
from .quant import QUANT_BITS, QuantizedEmbedding, QuantizedLinear, pick_group


def tile_for_kernels(model: nn.Module) -> nn.Module:
    """Tile (QuantizedLinear.tile_) every int4 QuantizedLinear of `model` on CUDA that the GEMM
    reads, one layer at a time (a layer's bytes of headroom), except one sharing an embedding
    table's codes (a tied lm_head: a lookup reads the table's rows in order). The loaders call
    it once the model is on its device."""
    tables = {id(m.codes) for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    for m in model.modules():
        if (isinstance(m, QuantizedLinear) and m.bits == 4 and m.codes.is_cuda and id(m.codes) not in tables
                and gemm_applies(m.in_features, m.bits, m.group)):
            m.tile_()
    return model


def forward_order(model: nn.Module) -> list[QuantizedLinear]:
    """`model`'s quantized linears in the order a forward runs them: the order they are
    registered in, which the decoder layers keep (a layer's attention or DeltaNet in and out
    projections, then its MLP's; the lm_head last)."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def link_prefetches(model: nn.Module) -> nn.Module:
    """Give each tiled int4 linear (the GEMM's) the weights of the linear after it in a forward
    to prefetch into L2 as it ends (kernels/triton_prefetch.py: the small kernels between two
    linears then run while the next one's first bytes arrive). A hint only: a forward's results
    do not depend on it. None where l2_prefetch_bytes is 0 (a device without bulk prefetches,
    FLASHTREE_L2_PREFETCH_MB=0). The loaders call it after tile_for_kernels."""
    chain = forward_order(model)
    for layer, after in zip(chain, chain[1:] + [None]):
        nbytes = l2_prefetch_bytes(layer.codes.device) if layer.tiled and after is not None else 0
        layer.prefetch = (after.codes, nbytes) if nbytes else None
    return model


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every dense linear that --quantize gives `kind`: a
    target's decoder layers' (`model.model.layers`: its embedding and lm_head are outside them),
    all of a draft's (it has no embedding or lm_head of its own) but those marked `keep_dense`
    (a DFlash2 draft's small convolution and selector projections)."""
    scope = model.model.layers if hasattr(model, "lm_head") else model
    found = []
    for parent in scope.modules():
        for name, child in parent.named_children():
            if (isinstance(child, nn.Linear) and pick_group(child.in_features) is not None
                    and not getattr(child, "keep_dense", False)):
                found.append((parent, name, child))
    return found


def head_slots(model: nn.Module) -> tuple[Optional[nn.Embedding], Optional[nn.Linear]]:
    """A target's dense embedding table and untied dense lm_head, that --quantize gives
    HEAD_KIND (None where there is none: a draft, a GGUF table already quantized, no group)."""
    if not hasattr(model, "lm_head"):
        return None, None
    emb = model.model.embed_tokens
    emb = emb if isinstance(emb, nn.Embedding) and pick_group(emb.embedding_dim) else None
    head = model.lm_head
    tied = emb is not None and head.weight is emb.weight
    head = head if isinstance(head, nn.Linear) and not tied and pick_group(head.in_features) else None
    return emb, head


def quantize_model(model: nn.Module, kind: str, device: Union[str, torch.device, None] = None) -> nn.Module:
    """Replace a loaded target's or draft's linears by QuantizedLinear `kind` (int8 or int4), and a
    target's embedding table and lm_head by their HEAD_KIND form (a tied lm_head sharing the
    table's codes), one at a time, in place. With `device`, each weight is quantized there and only
    the quantized layer stays: a model staged in host memory reaches the device already small.
    Layers on CUDA are then tiled for the kernels (tile_for_kernels)."""
    if kind not in QUANT_BITS:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_BITS)}, got {kind!r}")
    bits = QUANT_BITS[kind]
    for parent, name, lin in quantizable_linears(model):
        setattr(parent, name, QuantizedLinear.from_float(lin.weight, bits, pick_group(lin.in_features),
                                                         lin.bias, device))
        lin.weight = lin.bias = None  # release the dense copy now, not when the loop ends
    emb, head = head_slots(model)
    head_bits = QUANT_BITS[quant.HEAD_KIND]  # looked up at the call: benchmarks/head_quant_quality.py sets it
    if head is not None:
        model.lm_head = QuantizedLinear.from_float(head.weight, head_bits, pick_group(head.in_features), None, device)
        head.weight = None
    if emb is not None:
        tied = isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is emb.weight
        table = QuantizedEmbedding.from_float(emb.weight, head_bits, pick_group(emb.embedding_dim), None, device)
        table.dtype = emb.weight.dtype
        if tied:
            model.lm_head = QuantizedLinear.sharing(table)
        model.model.embed_tokens = table
        emb.weight = None
    return link_prefetches(tile_for_kernels(model))
