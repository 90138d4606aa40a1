"""Attention of T new tokens over a KV cache: the one attention op of the CUDA path.

The new tokens' keys and values already sit in rows [length, length + T) of the cache. Every new
token sees the committed rows [0, length) (inside `window`, if given); among the new rows it sees
what `block_mask` allows (a tree's ancestors-and-self), or rows up to its own (`causal`), or all
of them (neither: the draft's bidirectional block). `length` may be a device tensor, which is
what lets one captured CUDA graph serve every context length.

The cache may be quantized (kv_storage.QuantRows): both paths dequantize the rows they read, the
Triton kernel in registers as it loads each key block, the definition before its SDPA. Rows are
logical: a live sequence's cache (kv_storage.Paged) maps them through its page table.

Several sequences whose caches share a pool go through one call, one launch on the CUDA path: a
length per sequence, their rows one run of T after another, a table row per sequence. A batched
forward's attention layer is then one launch, not one per sequence, and each sequence's rows are
computed exactly as alone (the launch plan is a function of T and the table's size, the same for
each): batching changes no bits of the attention.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import deterministic, use_triton
from .reference import prefix_block_mask, sdpa
from .kv_storage import KVSide, kv_rows, sequence_rows, sequence_side


DET_CHUNK = 512  # keys a split takes at least in the deterministic mode
DET_SPLITS = 64  # splits at most there: a longer cache takes longer ones


def deterministic_chunk(cache_rows: int, key_block: int = 64) -> int:
    """The keys of one split of the deterministic mode's attention over a cache of `cache_rows`
    rows (triton_attention.deterministic_plan): DET_CHUNK, or for a cache of more than
    DET_SPLITS of them the whole key blocks that split it in DET_SPLITS. A function of the
    cache's size alone, so that a row's keys are merged at the same positions in any launch;
    rows computed over another size (a snapshot) need not be the same bits."""
    per_split = -(-cache_rows // DET_SPLITS)  # ceiling divisions
    return max(DET_CHUNK, -(-per_split // key_block) * key_block)


def cache_attention(q: torch.Tensor, k_cache: KVSide, v_cache: KVSide,
                    length: Union[int, torch.Tensor], scale: float,
                    block_mask: Optional[torch.Tensor] = None, causal: bool = False,
                    window: Optional[int] = None) -> torch.Tensor:
    """q [T, Hq, D]; k_cache, v_cache [capacity, Hkv, D] (one layer), or their quantized
    QuantRows, either through a page table (kv_storage.Paged); block_mask [T, T] bool or
    uint8 (True = visible). With `window`, context row j is visible to new token i only if
    (length + i) - j < window. Returns [T, Hq * D].

    S sequences at once: `length` [S], q [S * T, Hq, D] (sequence s's rows at [s T, (s + 1) T)),
    the sides' tables [S, pages] over one pool, block_mask [S, T, T]."""
    if block_mask is not None and causal:
        raise ValueError("give either block_mask or causal, not both")
    sequences = length.numel() if isinstance(length, torch.Tensor) else 1
    t, _ = sequence_rows(q.shape[0], sequences, k_cache)
    sequence_rows(q.shape[0], sequences, v_cache)
    dim = q.shape[-1]
    sixteen = q.dtype in (torch.bfloat16, torch.float16)  # or float32 in the deterministic mode (the interpreter)
    if use_triton(q) and dim & (dim - 1) == 0 and (sixteen or deterministic()):
        from .triton_attention import MODE_ALL, MODE_CAUSAL, MODE_MASK, attention as kernel

        if not isinstance(length, torch.Tensor):
            length = torch.full((1,), length, dtype=torch.int32, device=q.device)
        mask = None
        if block_mask is not None:
            mask = block_mask.contiguous()
            mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mode = MODE_MASK if mask is not None else (MODE_CAUSAL if causal else MODE_ALL)
        return kernel(q, k_cache, v_cache, length, scale, mode, mask, window)
    if sequences == 1:
        return reference_attention(q, k_cache, v_cache, int(length), scale, block_mask, causal, window)
    return torch.cat([reference_attention(q[s * t:(s + 1) * t], sequence_side(k_cache, s), sequence_side(v_cache, s),
                                          int(length[s]), scale, None if block_mask is None else block_mask[s],
                                          causal, window) for s in range(sequences)])


def reference_attention(q: torch.Tensor, k_cache: KVSide, v_cache: KVSide, length: int,
                        scale: float, block_mask: Optional[torch.Tensor], causal: bool,
                        window: Optional[int]) -> torch.Tensor:
    """The definition: SDPA over the committed rows and the new ones, with no mask at all where
    every row sees everything (the math path's numerics then equal transformers'). Quantized
    rows are dequantized to q's dtype first: the attention of the values they stand for."""
    t = q.shape[0]
    end = length + t
    if window is None and block_mask is None and (not causal or t == 1):
        mask = None
    else:
        if block_mask is not None:
            inner = block_mask.to(torch.bool)
        else:
            inner = torch.ones(t, t, dtype=torch.bool, device=q.device)
            inner = inner.tril() if causal else inner
        mask = prefix_block_mask(length, inner)
        if window is not None:
            rows = torch.arange(length, end, device=q.device)[:, None]
            cols = torch.arange(length, device=q.device)[None, :]
            mask[:, :length] &= (rows - cols) < window
    return sdpa(q, kv_rows(k_cache, end, q.dtype), kv_rows(v_cache, end, q.dtype), mask, scale)
