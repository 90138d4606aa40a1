"""Weight-only quantized linear layers that stay quantized in memory (`--quantize int8|int4`, and
the GGUF loader's quantized tensors).

Format (shared with the GGUF loader): a weight W [out, in] is stored group-wise along `in`,
W[o, i] = code[o, i] * scale[o, i // group] + minimum[o, i // group], with unsigned codes of
`bits` 8 or 4 and group 16, 32, 64 or 128. Int8 codes are uint8 [out, in]; int4 codes are packed
two per byte, uint8 [out, in / 2], in runs of 128 along `in` laid out for the GEMM's
dequantization (kernels/reference.py `unpack_codes`: a run's word i holds its codes i, 32 + i,
64 + i, 96 + i); scale and minimum are float16 [out, in / group]. A minimum per group (not a
symmetric zero point) is what GGUF's K-quants need, and it costs the kernels one multiply-add
per group (kernels/triton_quant.py).

The table layout (`lookup`: GGUF's IQ4_NL / IQ4_XS): W[o, i] = values[code[o, i]] * scale[o, i //
32], int4 codes as above indexing 16 float32 `values` (LOOKUP_VALUES), no minimum. IQ4_NL's scale
is its float16 d (4.5 bits a weight). IQ4_XS's, d * (ls - 32), has up to 16 significant bits, so
it stays in the file's two levels (4.3125 bits a weight): `scale` int8 [out, in / 32] the
sub-scales ls - 32, `superscale` float16 [out, in / 32 / super_groups] the d of each super-block
of super_groups groups (8 as stored, fewer where the loader reorders columns across them:
checkpoint/gguf_codes.py), and W[o, i] = values[code] * superscale[o, g // super_groups] *
scale[o, g] with g = i // 32. The table values (at most 7 significant bits), d (11) and ls - 32
(6) multiply to at most 24 bits, exact in float32 in any order; the kernels compute each weight
so and round it once, so the weights are gguf's dequantized ones exactly.

Placed on CUDA, an int4 linear's codes, scales and minima are reordered once (QuantizedLinear.
tile_, by tile_for_kernels in the loaders and quantize_model): blocks of 64 rows, each stored a
run of codes (scales: a run's groups) at a time, so that a GEMM program's step reads one contiguous 4 KB
instead of 64 pieces of 64 bytes. Same bytes, same shapes; the row-major format above stays the
one every loader writes, the CPU reads and a state dict holds.

`--quantize` rounds each group of 128 to its own min/max range (asymmetric). For int8 this has
less RMS error than the symmetric form (scale max|w| / 127, codes centered on 128) on the
embedded target's layer weights and on a Gaussian one, as it spends all 256 codes on the group's
actual range, so both widths use it.

What is quantized: every nn.Linear inside the decoder layers (attention, MLP and Gated DeltaNet
projections, after load packed q/k/v and gate/up into one linear each) at `kind`; for a target
also the embedding table (QuantizedEmbedding: a lookup dequantizes only the rows it reads) and
the lm_head, both at HEAD_KIND (int8) whatever `kind` is: they are the logits' last step and the
first, and int8 costs the 27B shape 2.4 GiB less than bf16 while int4 there would save another
1.2 GiB at a cost to greedy agreement (`python benchmarks/head_quant_quality.py` measures it). A
tied lm_head IS the embedding table, so it is quantized once: the lm_head becomes a
QuantizedLinear over the very same code/scale/minimum tensors (the format is the same, [vocab,
hidden] grouped along hidden), which also halves the bytes the largest GEMV of every step reads.
A DFlash draft (`--quantize-draft`) has no embedding or lm_head of its own (it borrows the
target's); all its linears, the context projection `fc` included, are quantized.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.gguf_codes import IQ4_VALUES, TWO_LEVEL
from ..kernels.quant import gemm_applies, quant_linear
from ..kernels.reference import TILE_ROWS, dequantize, int4_runs, tile_int4

QUANT_BITS = {"int8": 8, "int4": 4}
GROUP_SIZES = (128, 64, 32, 16)  # --quantize takes the largest that divides in_features
GGUF_REQUANT_GROUP = 32  # a GGUF slot --quantize rounds to fewer bits: the K-quants' own group
HEAD_KIND = "int8"  # the embedding table's and the lm_head's, whatever the layers' (docstring)
FLOAT_CHUNK = 1 << 24  # weights from_float converts to float32 at a time
ArrayLike = Union[np.ndarray, torch.Tensor]
LOOKUPS = {"IQ4_NL": torch.float16, "IQ4_XS": torch.int8}  # the table layouts and their scales' dtype
LOOKUP_VALUES = torch.from_numpy(IQ4_VALUES.astype(np.float32))  # the 16 values their codes index
LOOKUP_GROUP = 32


class GroupQuantized(nn.Module):
    """A group-wise quantized matrix [out, in] (the format above) and its constructors; the
    subclasses give it nn.Linear's or nn.Embedding's forward; with `lookup` (a LOOKUPS key) in
    the table layout: int4 codes, scale in its dtype, `values` instead of a minimum, and for
    IQ4_XS (TWO_LEVEL) a `superscale` per `super_groups` groups."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int,
                 bias: Optional[torch.Tensor] = None, device: Union[str, torch.device, None] = None,
                 lookup: Optional[str] = None, super_groups: Optional[int] = None):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if lookup is not None and (lookup not in LOOKUPS or (bits, group) != (4, LOOKUP_GROUP)):
            raise ValueError(f"a table layout is one of {', '.join(LOOKUPS)} with 4-bit codes in groups of "
                             f"{LOOKUP_GROUP}, got {lookup} with {bits} bits in groups of {group}")
        if group not in GROUP_SIZES or in_features % group:
            raise ValueError(f"group must be one of {sorted(GROUP_SIZES)} and divide in_features "
                             f"({in_features}), got {group}")
        groups = in_features // group
        if (super_groups is None) != (lookup not in TWO_LEVEL) or groups % (super_groups or 1):
            raise ValueError(f"{', '.join(TWO_LEVEL)} and only they have super-scales, each over groups that "
                             f"divide the {groups} of a row; got {super_groups} groups for {lookup}")
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        self.lookup, self.super_groups = lookup, super_groups
        per_byte = 8 // bits
        self.register_buffer("codes", torch.zeros(out_features, in_features // per_byte, dtype=torch.uint8,
                                                  device=device))
        self.register_buffer("scale", torch.zeros(out_features, groups, dtype=LOOKUPS.get(lookup, torch.float16),
                                                  device=device))
        if lookup is None:
            self.register_buffer("minimum", torch.zeros(out_features, groups, dtype=torch.float16, device=device))
            self.register_buffer("values", None)
        else:
            self.register_buffer("minimum", None)
            self.register_buffer("values", LOOKUP_VALUES.to(self.codes.device))
        self.register_buffer("superscale", None if super_groups is None else torch.zeros(
            out_features, groups // super_groups, dtype=torch.float16, device=device))
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.tiled = False  # codes, scale and minimum in reference.tile_rows' order (tile_)
        # the next linear's codes and the bytes of them the GEMM sends to L2 (quantize.link_prefetches)
        self.prefetch: Optional[tuple[torch.Tensor, int]] = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={self.group}, bias={self.bias is not None}" + (f", lookup={self.lookup}" if self.lookup else "")
                + (f", super_groups={self.super_groups}" if self.super_groups else ""))

    @property
    def nbytes(self) -> int:
        """The bytes this layer holds on its device: codes, scales, minima (or table values and
        super-scales) and the bias."""
        tensors = [self.codes, self.scale, self.minimum, self.values, self.superscale, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @staticmethod
    def planned_nbytes(out_features: int, in_features: int, bits: int, group: int, bias_bytes: int = 0,
                       lookup: Optional[str] = None, super_groups: Optional[int] = None) -> int:
        """`nbytes` of a layer of this shape, without building it (the memory plan); `bias_bytes`
        is the bias's element size, 0 for none."""
        return (quantized_bytes(out_features * in_features, bits, group, lookup, super_groups)
                + bias_bytes * out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [out, in] this layer stands for."""
        return dequantize(*self.row_major(), self.bits, self.group, dtype, self.values, self.superscale)

    def row_major(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """codes, scale and minimum (None in the table layout) in the format above (a copy where
        the layer is tiled; super-scales are never tiled)."""
        if not self.tiled:
            return self.codes, self.scale, self.minimum
        return tile_int4(self.codes, self.scale, self.minimum, inverse=True)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:
            destination.update({prefix + name: t for name, t in zip(("codes", "scale", "minimum"), self.row_major())
                                if t is not None})

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)  # rows in order into the buffers
        if self.tiled:
            buffers = (self.codes, self.scale, self.minimum)
            for buffer, tiled in zip(buffers, tile_int4(*buffers)):
                if buffer is not None:
                    buffer.copy_(tiled)

    @classmethod
    def from_codes(cls, codes: ArrayLike, scale: ArrayLike, minimum: Optional[ArrayLike], group: int, bits: int,
                   bias: Optional[ArrayLike] = None, lookup: Optional[str] = None,
                   superscale: Optional[ArrayLike] = None) -> "GroupQuantized":
        """The loaders' constructor: codes unsigned [out, in] (one per weight, below 2**bits),
        scale and minimum [out, in / group] (float32; stored as float16), or with `lookup` the
        table layout's codes, scale and (IQ4_XS) superscale [out, in / group / super_groups],
        whose shape gives super_groups (stored in their dtypes; a value one does not hold exactly
        is refused) and no minimum. On the codes' device (numpy arrays: the CPU)."""
        c = _tensor(codes)
        if c.dim() != 2:
            raise ValueError(f"codes must be 2-D [out, in], got shape {tuple(c.shape)}")
        out_f, in_f = c.shape
        parts = {"scale": _tensor(scale)} | ({} if lookup else {"minimum": _tensor(minimum)})
        super_groups = None
        if superscale is not None:
            parts["superscale"] = _tensor(superscale)
            super_groups = max(1, in_f // group // max(1, parts["superscale"].shape[-1]))
        layer = cls(in_f, out_f, bits, group, _tensor(bias) if bias is not None else None, device=c.device,
                    lookup=lookup, super_groups=super_groups)
        for name, t in parts.items():
            want = tuple(getattr(layer, name).shape)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
            raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit weights")
        layer.codes.copy_(pack_codes(c.to(torch.uint8), bits))
        for name, t in parts.items():
            held = getattr(layer, name)
            held.copy_(t)
            if lookup and not torch.equal(held.to(t.dtype), t):
                raise ValueError(f"{lookup} {name}s must be exact in {held.dtype}")
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int, group: int = 128, bias: Optional[torch.Tensor] = None,
                   device: Union[str, torch.device, None] = None) -> "GroupQuantized":
        """Round `weight` [out, in] group-wise to its min/max range, onto `device` (default: the
        weight's). The codes are rounded against the float16 scale and minimum actually stored,
        so storage adds no error of its own. Rows go over in chunks (FLOAT_CHUNK values), so a
        vocabulary-sized table never has a float32 copy on the device."""
        out_f, in_f = weight.shape
        device = weight.device if device is None else torch.device(device)
        layer = cls(in_f, out_f, bits, group, None if bias is None else bias.to(device), device=device)
        top = (1 << bits) - 1
        step = max(1, FLOAT_CHUNK // in_f)
        for start in range(0, out_f, step):
            w = weight.detach()[start:start + step].to(device).float()
            rows = w.shape[0]
            w = w.view(rows, in_f // group, group)
            if not torch.isfinite(w).all():
                raise ValueError("cannot quantize a weight holding inf or nan")
            lo, hi = w.amin(-1), w.amax(-1)
            minimum = lo.to(torch.float16)
            scale = ((hi - minimum.float()) / top).to(torch.float16)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0
            codes = ((w - minimum.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, top)
            layer.codes[start:start + rows] = pack_codes(codes.to(torch.uint8).view(rows, in_f), bits)
            layer.scale[start:start + rows] = scale
            layer.minimum[start:start + rows] = minimum
        return layer


class QuantizedLinear(GroupQuantized):
    """nn.Linear's forward contract (x [..., in] -> [..., out]) over a group-wise quantized
    weight; the bias, if any, stays dense in the model's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.codes, self.scale, self.minimum, self.bias, self.bits, self.group, self.tiled,
                            self.values, self.superscale, self.prefetch)

    def tile_(self) -> "QuantizedLinear":
        """Reorder int4 codes, scales and minima in place into blocks of TILE_ROWS rows, each
        stored a run (scales: a run's groups) at a time (reference.tile_rows), which the GEMM and the
        prefill dequantization read as one contiguous piece per step of a program (a faster
        int4 AR forward than the row-major layout: `python benchmarks/int4_layout.py` compares
        them). The bytes and shapes are the same; state dicts keep the format above."""
        if self.bits != 4 or not gemm_applies(self.in_features, self.bits, self.group):
            raise ValueError(f"only int4 weights the GEMM reads are tiled, not {self.extra_repr()}")
        if not self.tiled:
            self.codes, self.scale, self.minimum = tile_int4(self.codes, self.scale, self.minimum)
            self.tiled = True
        return self

    @classmethod
    def sharing(cls, table: GroupQuantized) -> "QuantizedLinear":
        """A linear over `table`'s own code, scale and minimum tensors (a tied lm_head over its
        QuantizedEmbedding): no copy, and a state dict that loads into both."""
        with torch.device("meta"):
            head = cls(table.in_features, table.out_features, table.bits, table.group, lookup=table.lookup,
                       super_groups=table.super_groups)
        head.codes, head.scale, head.minimum, head.values = table.codes, table.scale, table.minimum, table.values
        head.superscale = table.superscale
        return head


class QuantizedEmbedding(GroupQuantized):
    """nn.Embedding's forward contract (ids [...] -> [..., dim]) over a group-wise quantized table
    [num_embeddings, dim]: only the looked-up rows' codes are read and dequantized, into `dtype`,
    the model's. The table stores no floating-point weight to take it from, so an empty buffer of
    that dtype carries it, and follows the model's `.to(dtype)` / `.float()` as a weight would."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int,
                 bias: Optional[torch.Tensor] = None, device: Union[str, torch.device, None] = None,
                 lookup: Optional[str] = None, super_groups: Optional[int] = None):
        if bias is not None:
            raise ValueError("an embedding has no bias")
        super().__init__(in_features, out_features, bits, group, None, device, lookup, super_groups)
        self.register_buffer("like", torch.empty(0, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.like.dtype

    @dtype.setter
    def dtype(self, value: torch.dtype) -> None:
        self.like = torch.empty(0, dtype=value, device=self.codes.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        minimum = None if self.minimum is None else self.minimum[flat]
        superscale = None if self.superscale is None else self.superscale[flat]
        rows = dequantize(self.codes[flat], self.scale[flat], minimum, self.bits, self.group, self.dtype, self.values,
                          superscale)
        return rows.view(*ids.shape, self.in_features)


def linear_rows(layer: nn.Module, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Output features `rows` of `layer(x)`, dense or quantized, without computing the others (the
    draft's context projection uses only the k/v rows of its packed qkv)."""
    bias = layer.bias[rows] if layer.bias is not None else None
    if isinstance(layer, QuantizedLinear):
        start, stop, _ = rows.indices(layer.out_features)
        if layer.tiled and (start % TILE_ROWS or (stop % TILE_ROWS and stop != layer.out_features)):
            return layer(x)[..., rows]  # not whole tiles (rows [a, b) of tiles are tiles where a, b are edges)
        minimum = None if layer.minimum is None else layer.minimum[rows]
        superscale = None if layer.superscale is None else layer.superscale[rows]
        return quant_linear(x, layer.codes[rows], layer.scale[rows], minimum, bias, layer.bits, layer.group,
                            layer.tiled, layer.values, superscale)
    return F.linear(x, layer.weight[rows], bias)


def quantized_bytes(numel: int, bits: int, group: int, lookup: Optional[str] = None,
                    super_groups: Optional[int] = None) -> int:
    """Codes (two int4 per byte, or one int8) + float16 scale and minimum per group; in a table
    layout (`lookup`) its scale alone per group, a float16 super-scale per `super_groups` groups
    (IQ4_XS) and the table's values once."""
    if lookup is not None:
        supers = numel // (group * super_groups) * 2 if super_groups else 0
        return numel // 2 + numel // group * LOOKUPS[lookup].itemsize + supers + LOOKUP_VALUES.nbytes
    return numel * bits // 8 + numel // group * 4


def quant_label(bits: int, group: int, lookup: Optional[str] = None, super_groups: Optional[int] = None) -> str:
    """int4 g128: codes of 4 bits, a float16 scale and minimum per 128 values; int4 IQ4_NL g32:
    the table layout of that name; int4 IQ4_XS g32/256: IQ4_XS's two levels, a super-scale per
    256 values (`super_groups` 8)."""
    supers = f"/{group * super_groups}" if super_groups else ""
    return f"int{bits} {lookup} g{group}{supers}" if lookup else f"int{bits} g{group}"


def _tensor(a: ArrayLike) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> the stored layout (kernels/reference.py `unpack_codes` describes
    int4's runs of words and inverts this)."""
    if bits == 8:
        return codes
    out_f = codes.shape[0]
    parts = []
    for start, length, run in int4_runs(codes.shape[1]):
        nibbles = codes[:, start:start + length].reshape(out_f, length // run, 4, run // 4).transpose(-1, -2)
        parts.append((nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).reshape(out_f, length // 2))
    return torch.cat(parts, dim=-1)


def pick_group(in_features: int) -> Optional[int]:
    """The largest group size dividing in_features (None: no supported group does)."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)
