"""How a KV cache stores its rows, and how they are read and written through a page table.

A cache side (keys or values) is plain rows in the model's dtype, or `QuantRows`: codes plus,
for the block types, one scale per QBLOCK values of a head (scale_dtype). Rows stay indexed by
position in every form, so moving a row means moving its codes and scales.

The rows of a live sequence sit in pages of PAGE_ROWS rows of a pool that sequences share
(models/kv_cache.py). A `Paged` side carries the pool's rows and the sequence's page table:
logical row r is the pool's row pages[r // PAGE_ROWS] * PAGE_ROWS + r % PAGE_ROWS. Every
function here and every kernel that takes a cache side takes either form; the definitions below
are what the CPU runs and what the Triton kernels are checked against.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

PAGE_ROWS = 64  # rows of a KV page, the unit of a page table and of what sequences share

# The stored kinds:
#   bf16  bfloat16 values (a cast; 2 bytes a value)
#   fp8   float8_e4m3fn values, saturated at +-FP8_MAX, no scale (1 byte a value); kept as their
#         bytes (uint8): PyTorch's CPU indexing ops do not take float8 tensors
#   q8_0  int8 codes, value = code * scale, scale = amax / 127 of the block (34 bytes / 32 values)
#   q4_0  4-bit codes two to a byte (even dim in the low nibble), value = (code - 8) * scale,
#         scale = -(the block's value of largest magnitude) / 8, so it maps exactly onto code 0
#         and the other side keeps 7 levels (18 bytes / 32 values)
QBLOCK = 32
FP8_MAX = 448.0
KV_CODES = {"bf16": (torch.bfloat16, 1), "fp8": (torch.uint8, 1), "q8_0": (torch.int8, 1),
            "q4_0": (torch.uint8, 2)}  # kind -> (code dtype, values per code element)


class QuantRows(NamedTuple):
    """One layer's keys or values as stored: codes [rows, heads, D / values per code] and, for
    q8_0/q4_0, scales [rows, heads, D / QBLOCK] (scale_dtype's); `kind` names the format."""

    kind: str
    codes: torch.Tensor
    scale: Optional[torch.Tensor]


KVRows = Union[torch.Tensor, QuantRows]  # plain rows in the compute dtype, or quantized ones


def has_scale(kind: str) -> bool:
    return kind in ("q8_0", "q4_0")


def scale_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cache's block scales for a model computing in `dtype`: a bfloat16 model's
    q4_0 scales in bfloat16, so that the attention kernels dequantize its codes with packed
    bfloat16 arithmetic (triton_kv_read._q4_packed), where (code - 8) * scale is exact before
    its one rounding, as it is in float32; every other scale (q8_0's, and q4_0's under a float16
    or float32 model) in float16."""
    return torch.bfloat16 if kind == "q4_0" and dtype == torch.bfloat16 else torch.float16


def quantize_kv(x: torch.Tensor, kind: str, scales: torch.dtype = torch.float16
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [..., D] -> (codes, scales or None) of `kind`. Scales are rounded to `scales` (a cache's
    scale_dtype; default float16, which q8_0 always takes) before the codes are computed, so
    decoding uses exactly the scale the codes were made for; a code is floor(x / scale + 0.5)
    (q4_0: + 8.5): a correctly rounded division and an add, which the Triton store repeats bit
    for bit (a multiply by the reciprocal could be fused with the add there)."""
    if kind == "bf16":
        return x.to(torch.bfloat16), None
    if kind == "fp8":
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None
    blocks = x.float().unflatten(-1, (-1, QBLOCK))
    if kind == "q8_0":
        scale = (blocks.abs().amax(-1) / 127).to(scales)
        codes = torch.floor(blocks / _divisor(scale) + 0.5).clamp(-127, 127).to(torch.int8)
        return codes.flatten(-2), scale
    if kind == "q4_0":
        hi, lo = blocks.amax(-1), blocks.amin(-1)
        scale = (torch.where(-lo > hi, lo, hi) / -8).to(scales)
        codes = torch.floor(blocks / _divisor(scale) + 8.5).clamp(0, 15).to(torch.uint8).flatten(-2)
        return codes[..., 0::2] | (codes[..., 1::2] << 4), scale
    raise ValueError(f"unknown KV type {kind!r}")


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """The block scales as divisors [..., blocks, 1]: 1 where a scale is 0 (an all-zero block,
    or values below the scale type's range, which then all round to code 0)."""
    scale = scale.float()
    return torch.where(scale != 0, scale, 1.0).unsqueeze(-1)


def dequantize_kv(rows: QuantRows, dtype: torch.dtype) -> torch.Tensor:
    """The values that `rows` stand for, [..., D] in `dtype`."""
    if rows.kind == "fp8":
        return rows.codes.view(torch.float8_e4m3fn).to(dtype)
    if rows.kind == "bf16":
        return rows.codes.to(dtype)
    codes = rows.codes
    if rows.kind == "q4_0":
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).to(torch.int8) - 8
    values = codes.float().unflatten(-1, (-1, QBLOCK)) * rows.scale.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


class Paged(NamedTuple):
    """A cache side read and written through a page table: logical row r is row
    pages[r // PAGE_ROWS] * PAGE_ROWS + r % PAGE_ROWS of `rows`, a pool that sequences share.
    A table of several rows ([S, n]) is S sequences' tables over the same pool, for the kernels
    that serve all their new rows in one launch (each sequence's rows as they would be alone)."""

    rows: KVRows
    pages: torch.Tensor  # int32 [n] (or [S, n]): the page of each PAGE_ROWS logical rows, on the rows' device


KVSide = Union[KVRows, Paged]  # what every function and kernel that takes a cache side takes


def physical_rows(rows: torch.Tensor, pages: Optional[torch.Tensor]) -> torch.Tensor:
    """The pool rows of logical `rows` (identity without a table): rows [R] through a table
    [pages], or several sequences' rows [S, R] through their tables [S, pages]. Device ops
    only: no host sync, so a CUDA graph can capture it."""
    if pages is None:
        return rows
    rows = rows.long()
    return pages.long().gather(-1, rows // PAGE_ROWS) * PAGE_ROWS + rows % PAGE_ROWS


def unpaged(side: KVSide) -> tuple[KVRows, Optional[torch.Tensor]]:
    """(the rows, the page table or None) of a cache side."""
    return (side.rows, side.pages) if isinstance(side, Paged) else (side, None)


def sequence_count(side: KVSide) -> int:
    """How many sequences' page tables a side holds (1 unless its table has a row per sequence)."""
    return side.pages.shape[0] if isinstance(side, Paged) and side.pages.dim() == 2 else 1


def sequence_rows(rows: int, sequences: int, side: KVSide) -> tuple[int, int]:
    """(rows of each sequence, the table's stride between sequences) of a launch over `rows` new
    rows of `sequences` sequences, one run after another: (rows, 0) for one. ValueError where
    the side's table has not a row per sequence or the rows do not split evenly: the kernels
    would read or write another sequence's pages."""
    if sequence_count(side) != sequences or rows % sequences:
        raise ValueError(f"{rows} rows of {sequences} sequences through a table of {sequence_count(side)}: "
                         "several sequences take a table row and the same rows each")
    return (rows, 0) if sequences == 1 else (rows // sequences, side.pages.stride(0))  # type: ignore[union-attr]


def sequence_side(side: KVSide, s: int) -> KVSide:
    """Sequence s's own view of a side whose table has a row per sequence; any other side as it is."""
    return Paged(side.rows, side.pages[s]) if sequence_count(side) > 1 else side


def side_capacity(side: KVSide) -> int:
    """Logical rows a side can hold (a sequence's, where it holds several): its table's pages, or
    its rows."""
    if isinstance(side, Paged):
        return side.pages.shape[-1] * PAGE_ROWS
    return (side.codes if isinstance(side, QuantRows) else side).shape[0]


def kv_rows(side: KVSide, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Logical rows [0, end) of a cache side as values in `dtype` (what attention reads)."""
    rows, pages = unpaged(side)
    at = slice(0, end) if pages is None else physical_rows(torch.arange(end, device=pages.device), pages)
    if isinstance(rows, torch.Tensor):
        return rows[at]
    scale = rows.scale[at] if rows.scale is not None else None
    return dequantize_kv(QuantRows(rows.kind, rows.codes[at], scale), dtype)


def store_kv(side: KVSide, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, heads, D] at logical row indices `rows` [T] of a cache side, quantized as it
    stores. Index copies with a device index: no host sync, so a CUDA graph can capture it."""
    side, pages = unpaged(side)
    rows = physical_rows(rows, pages)
    if isinstance(side, torch.Tensor):
        side.index_copy_(0, rows, x.to(side.dtype))
        return
    codes, scale = quantize_kv(x, side.kind, side.scale.dtype if side.scale is not None else torch.float16)
    side.codes.index_copy_(0, rows, codes)
    if scale is not None:
        side.scale.index_copy_(0, rows, scale)


# How a cache side is stored, as the Triton kernels take it (their K_KIND/V_KIND): FP8 reads as a
# cast of its bytes
CAST, FP8, Q8, Q4 = 0, 1, 2, 3


def side_args(rows: KVRows) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes, scales, kind) of a cache side for a kernel (attention, and the fused stores): the
    codes stand in for the scales where there are none (never read then); fp8 stays bytes that
    the kernels bitcast (Triton's interpreter cannot load float8 tensors)."""
    if not isinstance(rows, QuantRows):
        return rows, rows, CAST
    if rows.kind == "fp8":
        return rows.codes, rows.codes, FP8
    if rows.scale is None:
        return rows.codes, rows.codes, CAST
    return rows.codes, rows.scale, Q4 if rows.kind == "q4_0" else Q8


def paged_side_args(k_side: KVSide, v_side: KVSide
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, int],
                               Optional[torch.Tensor]]:
    """side_args of a layer's keys and of its values, and the page table both go through (None:
    rows not paged)."""
    (k, k_pages), (v, v_pages) = unpaged(k_side), unpaged(v_side)
    if k_pages is not v_pages:
        raise ValueError("a layer's keys and values go through one page table")
    return side_args(k), side_args(v), k_pages
