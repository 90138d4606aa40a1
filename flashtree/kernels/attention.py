"""Attention of T new tokens over a KV cache: the one attention op of the CUDA path.

The new tokens' keys and values already sit in rows [length, length + T) of the cache. Every new
token sees the committed rows [0, length) (inside `window`, if given); among the new rows it sees
what `block_mask` allows (a tree's ancestors-and-self), or rows up to its own (`causal`), or all
of them (neither: the draft's bidirectional block). `length` may be a device tensor, which is
what lets one captured CUDA graph serve every context length.

The cache may be quantized (kv_storage.QuantRows): both paths dequantize the rows they read, the
Triton kernel in registers as it loads each key block, the definition before its SDPA. Rows are
logical: a live sequence's cache (kv_storage.Paged) maps them through its page table.

A long prefill chunk over a quantized cache is the exception (values_prefill): its many row
blocks would each dequantize every key again, so the cache's rows are dequantized once, a span
at a time, and the chunk attends over those values with torch's fused attention.

Several sequences whose caches share a pool go through one call, one launch on the CUDA path: a
length per sequence, their rows one run of T after another, a table row per sequence. A batched
forward's attention layer is then one launch, not one per sequence, and each sequence's rows are
computed exactly as alone (the launch plan is a function of T and the table's size, the same for
each): batching changes no bits of the attention.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from . import deterministic, use_triton
from .reference import prefix_block_mask, sdpa
from .kv_storage import CAST, KVSide, kv_rows, paged_side_args, sequence_rows, sequence_side


DET_CHUNK = 512  # keys a split takes at least in the deterministic mode
DET_SPLITS = 64  # splits at most there: a longer cache takes longer ones
# New rows of a causal chunk from which a quantized cache is dequantized once for it (values_prefill)
VALUES_PREFILL_ROWS = 256
# Context rows a layer's copy of values holds at most (values_prefill's spans)
VALUES_SPAN = 16384
# An attention of a chunk's rows over one span of values, with its log-sum-exp (fused_attention)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


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
        if (mode == MODE_CAUSAL and window is None and sequences == 1 and sixteen and t >= VALUES_PREFILL_ROWS
                and q.is_cuda and not torch.cuda.is_current_stream_capturing()):
            out = values_prefill(q, k_cache, v_cache, length, scale)
            if out is not None:
                return out
        return kernel(q, k_cache, v_cache, length, scale, mode, mask, window)
    if sequences == 1:
        return reference_attention(q, k_cache, v_cache, int(length), scale, block_mask, causal, window)
    return torch.cat([reference_attention(q[s * t:(s + 1) * t], sequence_side(k_cache, s), sequence_side(v_cache, s),
                                          int(length[s]), scale, None if block_mask is None else block_mask[s],
                                          causal, window) for s in range(sequences)])


def values_prefill(q: torch.Tensor, k_cache: KVSide, v_cache: KVSide, length: torch.Tensor, scale: float,
                   attend: Optional[Attend] = None) -> Optional[torch.Tensor]:
    """A causal prefill chunk's attention over a quantized cache, from the cache's values, by
    `attend` (default: torch's fused attention on this GPU, fused_attention): None (the Triton
    kernel then runs, as for any forward) where the cache is plain, there is no such attention
    here, or in the deterministic mode. cache_attention calls it on CUDA outside graph capture.

    Why: the kernel dequantizes keys and values in registers as it loads them, once a row block,
    and a chunk of T rows has T * heads / (64 * kv_heads) row blocks a KV head (192 for a 2048-row
    chunk of Qwen3.5-27B), so over a q4_0 cache that dequantizing, repeated for every block, is
    most of a long chunk's attention. Here the cache's rows are dequantized once
    (triton_kv_read.cache_values: the same values, bit for bit), a span at a time: the committed
    rows in spans of at most VALUES_SPAN, unmasked, then the chunk's own rows under the causal
    mask (a square: every backend's causal mask is that one). Each span's attention comes with its
    log-sum-exp, and the spans merge by it in float32. A span's copy and the merge are what the
    memory plan reserves (Layout.prefill_values_bytes): bounded, whatever the context. The sums
    are torch's fused kernel's, not the Triton kernel's: the deterministic mode keeps its own
    launch, whose split positions make a row's bits the same in any chunk. The context's length
    is read on the host (one sync a layer, for a chunk that takes milliseconds)."""
    from .triton_kv_read import cache_values

    (k_codes, k_scale, k_kind), (v_codes, v_scale, v_kind), pages = paged_side_args(k_cache, v_cache)
    if (k_kind == CAST and v_kind == CAST) or deterministic():
        return None
    t, heads, dim = q.shape
    qh = q.transpose(0, 1)[None]
    attend = attend or fused_attention(qh, qh.new_empty(1, k_codes.shape[1], t, dim))
    if attend is None:
        return None
    committed = int(length.reshape(-1)[0])
    spans = [(lo, min(lo + VALUES_SPAN, committed)) for lo in range(0, committed, VALUES_SPAN)]
    acc = lse = None
    for lo, hi in spans + [(committed, committed + t)]:
        k = cache_values(k_codes, k_scale, k_kind, pages, lo, hi, dim, q.dtype).transpose(0, 1)[None]
        v = cache_values(v_codes, v_scale, v_kind, pages, lo, hi, dim, q.dtype).transpose(0, 1)[None]
        out, span_lse = attend(qh, k, v, hi > committed, scale)
        span_lse = span_lse.reshape(1, heads, -1)[..., :t, None].float()
        if acc is None:
            acc, lse = out.float(), span_lse
            continue
        merged = torch.logaddexp(lse, span_lse)
        acc.mul_(torch.exp(lse - merged)).addcmul_(out, torch.exp(span_lse - merged))
        lse = merged
    return acc[0].to(q.dtype).transpose(0, 1).reshape(t, heads * dim)


def fused_attention(q: torch.Tensor, k: torch.Tensor) -> Optional[Attend]:
    """Torch's fused attention of q [1, Hq, T, D] over keys and values shaped like k [1, Hkv, S, D]
    on this GPU, as a function (q, k, v, causal, scale) -> (output [1, Hq, T, D], its natural
    log-sum-exp, T values a head; causal: the square mask of a chunk over its own rows): cuDNN's
    where it runs (the fastest at these shapes on an H100), else flash attention's; None where
    neither takes grouped heads, since anything else would copy the keys and values a query head
    or materialise the scores."""
    try:
        params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, False, True)
    except TypeError:  # a torch without grouped heads in its fused kernels
        return None
    if torch.backends.cuda.can_use_cudnn_attention(params):
        return lambda q, k, v, causal, scale: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    if torch.backends.cuda.can_use_flash_attention(params):
        return lambda q, k, v, causal, scale: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[:2]
    return None


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
