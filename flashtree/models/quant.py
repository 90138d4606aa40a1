"""Weight-only quantized linear layers that stay quantized in memory (`--quantize int8|int4`, and
the GGUF loader's quantized tensors).

Format (shared with the GGUF loader): a weight W [out, in] is stored group-wise along `in`,
W[o, i] = code[o, i] * scale[o, i // group] + minimum[o, i // group], with unsigned codes of
`bits` 8 or 4 and group 16, 32, 64 or 128. Int8 codes are uint8 [out, in]; int4 codes are packed
two per byte, uint8 [out, in / 2], the even index in the low nibble; scale and minimum are
float16 [out, in / group]. A minimum per group (not a symmetric zero point) is what GGUF's K-quants
need, and it costs the kernels one multiply-add per group (kernels/triton_quant.py).

`--quantize` rounds each group of 128 to its own min/max range (asymmetric). For int8 this was
measured against the symmetric form (scale max|w| / 127, codes centered on 128) on the embedded
target's 42 layer weights and a Gaussian one: asymmetric has 0.9x symmetric's RMS error on
average (it spends all 256 codes on the group's actual range), so both widths use it.

What is quantized: every nn.Linear inside the decoder layers (attention, MLP and Gated DeltaNet
projections, after load packed q/k/v and gate/up into one linear each). Embeddings and the
lm_head stay dense: a tied lm_head is the embedding table, which a lookup must read densely, and
the logits' precision is what greedy decoding compares.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from ..kernels.quant import quant_linear
from ..kernels.reference import dequantize

QUANT_BITS = {"int8": 8, "int4": 4}
GROUP_SIZES = (128, 64, 32, 16)  # --quantize takes the largest that divides in_features
ArrayLike = Union[np.ndarray, torch.Tensor]


class QuantizedLinear(nn.Module):
    """nn.Linear's forward contract (x [..., in] -> [..., out]) over a group-wise quantized
    weight; the bias, if any, stays dense in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int,
                 bias: Optional[torch.Tensor] = None, device: Union[str, torch.device, None] = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if group not in GROUP_SIZES or in_features % group:
            raise ValueError(f"group must be one of {sorted(GROUP_SIZES)} and divide in_features "
                             f"({in_features}), got {group}")
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        per_byte = 8 // bits
        self.register_buffer("codes", torch.zeros(out_features, in_features // per_byte, dtype=torch.uint8,
                                                  device=device))
        groups = in_features // group
        self.register_buffer("scale", torch.zeros(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("minimum", torch.zeros(out_features, groups, dtype=torch.float16, device=device))
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.codes, self.scale, self.minimum, self.bias, self.bits, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={self.group}, bias={self.bias is not None}")

    @property
    def nbytes(self) -> int:
        """The bytes this layer holds on its device: codes, scales, minima and the bias."""
        tensors = [self.codes, self.scale, self.minimum] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def planned_nbytes(out_features: int, in_features: int, bits: int, group: int,
                       bias_bytes: int = 0) -> int:
        """`nbytes` of a layer of this shape, without building it (the memory plan); `bias_bytes`
        is the bias's element size, 0 for none."""
        codes = out_features * in_features * bits // 8
        return codes + 2 * 2 * out_features * (in_features // group) + bias_bytes * out_features

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [out, in] this layer stands for."""
        return dequantize(self.codes, self.scale, self.minimum, self.bits, self.group, dtype)

    @classmethod
    def from_codes(cls, codes: ArrayLike, scale: ArrayLike, minimum: ArrayLike, group: int, bits: int,
                   bias: Optional[ArrayLike] = None) -> "QuantizedLinear":
        """The loaders' constructor: codes unsigned [out, in] (one per weight, below 2**bits),
        scale and minimum [out, in / group] (float32; stored as float16). On the codes' device
        (numpy arrays: the CPU)."""
        c = _tensor(codes)
        if c.dim() != 2:
            raise ValueError(f"codes must be 2-D [out, in], got shape {tuple(c.shape)}")
        out_f, in_f = c.shape
        layer = cls(in_f, out_f, bits, group, _tensor(bias) if bias is not None else None, device=c.device)
        s, m = _tensor(scale), _tensor(minimum)
        for name, t in (("scale", s), ("minimum", m)):
            if tuple(t.shape) != (out_f, in_f // group):
                raise ValueError(f"{name} must have shape {(out_f, in_f // group)}, got {tuple(t.shape)}")
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
            raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit weights")
        layer.codes.copy_(pack_codes(c.to(torch.uint8), bits))
        layer.scale.copy_(s.to(torch.float16))
        layer.minimum.copy_(m.to(torch.float16))
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group: int = 128,
                   bias: Optional[torch.Tensor] = None) -> "QuantizedLinear":
        """Round `weight` [out, in] group-wise to its min/max range. The codes are rounded against
        the float16 scale and minimum actually stored, so storage adds no error of its own."""
        out_f, in_f = weight.shape
        layer = cls(in_f, out_f, bits, group, bias, device=weight.device)
        w = weight.detach().float().view(out_f, in_f // group, group)
        if not torch.isfinite(w).all():
            raise ValueError("cannot quantize a weight holding inf or nan")
        lo, hi = w.amin(-1), w.amax(-1)
        top = (1 << bits) - 1
        minimum = lo.to(torch.float16)
        scale = ((hi - minimum.float()) / top).to(torch.float16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0
        codes = ((w - minimum.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
        layer.codes.copy_(pack_codes(codes.to(torch.uint8).view(out_f, in_f), bits))
        layer.scale.copy_(scale)
        layer.minimum.copy_(minimum)
        return layer


def _tensor(a: ArrayLike) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> the stored layout (kernels/reference.py `unpack_codes` inverts it)."""
    if bits == 8:
        return codes
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def pick_group(in_features: int) -> Optional[int]:
    """The largest group size dividing in_features (None: no supported group does)."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every dense linear of the decoder layers
    (`model.model.layers`) that --quantize replaces; embeddings and lm_head are outside them."""
    found = []
    for parent in model.model.layers.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and pick_group(child.in_features) is not None:
                found.append((parent, name, child))
    return found


def quantize_model(model: nn.Module, kind: str, device: Union[str, torch.device, None] = None) -> nn.Module:
    """Replace the decoder layers' linears of a loaded target by QuantizedLinear `kind` (int8 or
    int4), one at a time, in place. With `device`, each weight is quantized there and only the
    quantized layer stays: a model staged in host memory reaches the device already small."""
    if kind not in QUANT_BITS:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_BITS)}, got {kind!r}")
    bits = QUANT_BITS[kind]
    for parent, name, lin in quantizable_linears(model):
        weight = lin.weight.detach().to(device) if device is not None else lin.weight.detach()
        bias = lin.bias.detach().to(weight.device) if lin.bias is not None else None
        setattr(parent, name, QuantizedLinear.from_float(weight, bits, pick_group(lin.in_features), bias))
        lin.weight = lin.bias = None  # release the dense copy now, not when the loop ends
    return model


def quantized_model_nbytes(model: nn.Module, kind: Optional[str],
                           dtype: Optional[torch.dtype] = None) -> int:
    """The bytes of everything `model` holds (parameters and buffers, tied ones once) after
    `quantize_model(model, kind)`, without running it: works on a meta-device model, so the
    memory plan can count the real bytes before any weight is loaded. `kind` None: as it is.
    `dtype`: the floating-point parameters' dtype at load, if not the one they have (a meta
    model is built in float32); buffers (the RoPE table) are counted as they are."""
    bias_size = dtype.itemsize if dtype is not None else None
    replaced: dict[int, int] = {}
    if kind is not None:
        bits = QUANT_BITS[kind]
        for _, _, lin in quantizable_linears(model):
            bias = 0 if lin.bias is None else (bias_size or lin.bias.element_size())
            replaced[id(lin.weight)] = QuantizedLinear.planned_nbytes(
                lin.out_features, lin.in_features, bits, pick_group(lin.in_features), bias)
            if lin.bias is not None:
                replaced[id(lin.bias)] = 0  # counted in planned_nbytes
    seen: dict[int, int] = {}
    for p in model.parameters():
        size = dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size()
        seen.setdefault(id(p), replaced.get(id(p), p.numel() * size))
    for b in model.buffers():
        seen.setdefault(id(b), b.numel() * b.element_size())
    return sum(seen.values())
