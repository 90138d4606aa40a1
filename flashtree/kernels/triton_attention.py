"""Triton split-K attention of T new tokens over a KV cache (flash-decoding with a tree mask).

Why a kernel of our own: the committed length is read from a device scalar, so one captured CUDA
graph serves every context length and the work follows the real length, not the capacity; GQA
is handled by letting each program take the G query heads of one KV head as extra rows (K/V are
never copied per query head; each row block reads a key once); and the in-block mask (causal,
all-visible, or a tree's ancestors-and-self) is applied only in the few key blocks past the
committed context.

Rows of a KV head: r -> token r // G, query head kv_head * G + r % G. Keys are split into
nsplit chunks (sized from the device lengths, at least a minimum chunk) so short-query steps still
fill the GPU; each split writes an unnormalised partial (acc, max, sum) and a second kernel merges
them. With nsplit == 1 (long prefill chunks) the first kernel writes the output directly. A
launch may run each split as V_PARTS programs, each with its share of the value dims (all compute
the scores), so that a smaller float32 accumulator fits in registers (attention_launch.plan says
where).

A quantized cache (kv_storage.QuantRows) is read as stored (triton_kv_read.py): each key block's
codes and block scales are loaded and dequantized in registers (kinds CAST and FP8: a cast; Q8:
code * scale; Q4: (nibble - 8) * scale), so only the quantized bytes cross the memory bus.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import deterministic
from .attention_launch import deterministic_plan, plan, row_launches, smaller_launches
from .kv_storage import CAST, KVSide, paged_side_args, sequence_rows, side_capacity
from .triton_attention_merge import MERGE_DIMS, NEG, merge_kernel, merge_step, nth_split, split_chunk
from .triton_kv_read import code_words, load_rows, pool_rows
from .triton_pdl import launch_options, pdl_start

LOG2E = 1.4426950408889634
MODE_ALL, MODE_CAUSAL, MODE_MASK = 0, 1, 2


@triton.jit
def _online_update(q, k, v, qk_scale, vis, m_i, l_i, acc, MASKED: tl.constexpr):
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        qk = tl.where(vis, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, k_head, v_head, ks_head, vs_head, MASK, PAGES, lo, hi, length, tok, row_ok, d, dv, first,
                  stride_kn, stride_vn, stride_ksn, stride_vsn, T, window, qk_scale, tok_lo, tok_hi,
                  BLOCK_M: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
                  BY_DEPTH: tl.constexpr = False, T_PAD: tl.constexpr = 16, PAGED: tl.constexpr = False,
                  ASM: tl.constexpr = False, q2=None, tok2=None, row_ok2=None, TAIL_M: tl.constexpr = 0):
    """The unnormalised attention (max, sum, acc [BLOCK_M, DV]) of a row block's queries q over
    the keys [lo, hi) of one KV head, key blocks at multiples of BLOCK_N from lo; with TAIL_M,
    also that of a second block of TAIL_M rows (q2, its tokens tok2, rows in range row_ok2) over
    the same keys, each key block loaded and dequantized once for both (else the second three
    repeat the first's).

    BY_DEPTH (the deterministic mode's trees; the block's rows are tokens tok_lo..tok_hi): in the
    key blocks past the whole committed ones each token's ancestors, stored at rows length +
    their node index, are read at the positions an AR step would find them, length + their
    depth (the k-th ancestor in node order is at depth k: a parent comes before its children),
    so that every sum over a key block adds the same values in the same places as the AR step
    of that token would. A token's ancestors are the first nodes of the path of any descendant,
    so those blocks are read once a path: for each token of the block that no later token of
    the block descends from, its ancestors-and-self, updating the rows of the path's tokens that
    no earlier path updated, each over the keys up to its own depth. Every other key of the pass
    is masked for them, and every key for the other rows, which leaves their max, sum and acc
    exactly as they were (a factor exp2(0) = 1, terms 0). A chain is then one pass over those
    blocks, a tree one for each path that ends in the row block. The whole committed blocks
    before them are the same for every token and read once for the block.

    PAGED: the logical rows of each key block are read at the pool rows the sequence's page
    table PAGES gives them (pool_rows); the sums are the same, over the same values."""
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    if TAIL_M > 0:
        m_2 = tl.full([TAIL_M], NEG, tl.float32)
        l_2 = tl.zeros([TAIL_M], tl.float32)
        acc_2 = tl.zeros([TAIL_M, DV], tl.float32)
    DT = q.dtype

    # whole key blocks of committed context: visible to every row, no mask work
    free_end = lo
    if not HAS_WINDOW:
        free_end = tl.maximum(lo, lo + (tl.minimum(hi, length) - lo) // BLOCK_N * BLOCK_N)
    for start in range(lo, free_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        at = pool_rows(PAGES, cols, cols >= 0, PAGED)
        k = load_rows(k_head, ks_head, at, stride_kn, stride_ksn, d, 0, cols, DT, K_KIND, False, ASM)
        v = load_rows(v_head, vs_head, at, stride_vn, stride_vsn, dv, first, cols, DT, V_KIND, False, ASM)
        m_i, l_i, acc = _online_update(q, k, v, qk_scale, row_ok[:, None], m_i, l_i, acc, False)
        if TAIL_M > 0:
            m_2, l_2, acc_2 = _online_update(q2, k, v, qk_scale, row_ok2[:, None], m_2, l_2, acc_2, False)

    # the rest: context tail, window, and the new tokens under the in-block mask
    for start in range(free_end, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        rel = cols - length
        if BY_DEPTH:
            nodes = tl.arange(0, T_PAD)
            done = tok < 0  # the rows this key block has updated
            for t in range(tok_lo, tok_hi + 1):  # a pass for each path: t's, where it ends in the block
                later = (nodes > t) & (nodes <= tok_hi)
                if tl.sum((tl.load(MASK + nodes * T + t, mask=later, other=0) != 0).to(tl.int32), 0) == 0:
                    # position length + k holds the k-th node of t's path (its ancestors-and-self)
                    anc = (tl.load(MASK + t * T + nodes, mask=nodes < T, other=0) != 0).to(tl.int32)
                    seen = tl.cumsum(anc, 0)  # the path's nodes in node order up to each node
                    n_anc = tl.sum(anc, 0)
                    node = tl.sum((seen[None, :] < (rel + 1)[:, None]).to(tl.int32), 1)
                    at = tl.where(rel >= 0, length + node, cols)
                    key_ok = (cols < length) | ((rel >= 0) & (rel < n_anc))
                    at = pool_rows(PAGES, at, key_ok, PAGED)
                    k = load_rows(k_head, ks_head, at, stride_kn, stride_ksn, d, 0, key_ok, DT, K_KIND, True, ASM)
                    v = load_rows(v_head, vs_head, at, stride_vn, stride_vsn, dv, first, key_ok, DT, V_KIND, True,
                                  ASM)
                    # the rows of the path's tokens not updated by an earlier path, each over its own
                    # ancestors-and-self: the path's first (depth + 1) nodes
                    mine = row_ok & (done == 0) & (tl.load(MASK + t * T + tok, mask=row_ok, other=0) != 0)
                    row_anc = tl.sum(((nodes[None, :] <= tok[:, None]) & (anc[None, :] != 0)).to(tl.int32), 1)
                    vis = (cols < length)[None, :] | ((rel >= 0)[None, :] & (rel[None, :] < row_anc[:, None]))
                    vis = vis & mine[:, None]
                    if HAS_WINDOW:
                        vis = vis & ((length + row_anc - 1)[:, None] - cols[None, :] < window)
                    m_i, l_i, acc = _online_update(q, k, v, qk_scale, vis, m_i, l_i, acc, True)
                    done = done | mine
        else:
            col_ok = cols < hi
            at = pool_rows(PAGES, cols, col_ok, PAGED)
            k = load_rows(k_head, ks_head, at, stride_kn, stride_ksn, d, 0, col_ok, DT, K_KIND, True, ASM)
            v = load_rows(v_head, vs_head, at, stride_vn, stride_vsn, dv, first, col_ok, DT, V_KIND, True, ASM)
            vis = _visible(MASK, tok, row_ok, cols, col_ok, length, T, window, MODE, HAS_WINDOW)
            m_i, l_i, acc = _online_update(q, k, v, qk_scale, vis, m_i, l_i, acc, True)
            if TAIL_M > 0:
                vis = _visible(MASK, tok2, row_ok2, cols, col_ok, length, T, window, MODE, HAS_WINDOW)
                m_2, l_2, acc_2 = _online_update(q2, k, v, qk_scale, vis, m_2, l_2, acc_2, True)
    if TAIL_M == 0:  # one return for both: the second three repeat the first
        m_2, l_2, acc_2 = m_i, l_i, acc
    return m_i, l_i, acc, m_2, l_2, acc_2


@triton.jit
def _visible(MASK, tok, row_ok, cols, col_ok, length, T, window, MODE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Which keys cols (those in the launch's range: col_ok) the rows of tokens tok see past the
    committed context's whole blocks: the committed keys (in the window), and of the new tokens'
    all (MODE 0), those up to the row's own (1), or the tree's ancestors-and-self (2: MASK)."""
    rel = cols - length
    is_new = (rel >= 0) & col_ok
    vis = ((cols < length) & col_ok)[None, :]
    if HAS_WINDOW:
        vis = vis & ((length + tok)[:, None] - cols[None, :] < window)
    if MODE == 0:
        vis = vis | is_new[None, :]
    elif MODE == 1:
        vis = vis | (is_new[None, :] & (rel[None, :] <= tok[:, None]))
    else:
        allowed = tl.load(MASK + tok[:, None] * T + rel[None, :], mask=row_ok[:, None] & is_new[None, :], other=0)
        vis = vis | (allowed != 0)
    return vis


# nsplit is a plain argument, compiled once for every value: plan() derives it from the chunk's
# length, and a prefill's last chunk has a new length each turn (each new value compiled anew
# would be two kernel compiles, seconds, in every turn of a conversation); row0 likewise, and the
# strides between sequences (0 for one)
@triton.jit(do_not_specialize=["nsplit", "row0", "stride_ps", "stride_ms", "S"])
def _split_kernel(Q, K, V, KS, VS, OUT, PO, PM, PL, LEN, MASK, PAGES,
                  stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                  stride_ksn, stride_ksh, stride_vsn, stride_vsh, stride_ot, stride_ps, stride_ms,
                  T, window, qk_scale, R, nsplit, row0, S,
                  KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MIN_CHUNK: tl.constexpr, MODE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr, V_PARTS: tl.constexpr = 1,
                  SEQ: tl.constexpr = False, BY_DEPTH: tl.constexpr = False, T_PAD: tl.constexpr = 16,
                  PAGED: tl.constexpr = False, BALANCE: tl.constexpr = False, ASM: tl.constexpr = False,
                  PDL: tl.constexpr = False, TAIL_M: tl.constexpr = 0):
    """The partial (or, with one split, the output) of row block program_id(0) // V_PARTS of KV
    head program_id(1) over split program_id(2)'s keys, for part program_id(0) % V_PARTS of the
    value dims: each part computes the same scores and its share of P V, so a 256-wide head's
    float32 accumulator takes half the registers at V_PARTS 2 (at 4 warps and 64 rows the whole
    one spills), for the scores' work twice. The launch's row blocks start at row `row0` (a
    tree's tail block, plan()'s `tail_m`, is a launch of its own after the full blocks). With
    SEQ (the deterministic mode's prefill chunks; one program along axis 2) the program walks
    all nsplit splits itself, each as a split program would, and folds them with merge_step as
    the merge kernel does: the same bits as split + merge, with no partials in memory. With
    BY_DEPTH (the deterministic mode's trees) each token of a row block reads its ancestors
    where an AR step would (_attend_range); T_PAD: T's power of two. PAGED:
    the cache's rows through the page table PAGES (kernels/kv_storage.py: Paged).

    Axis 1 is (sequence, KV head) of a launch over S sequences: sequence s's T rows follow the
    ones before it in Q and OUT, its length is LEN[s], its table and mask start s strides
    (stride_ps, stride_ms) in. With BALANCE axis 1 is the KV head, and axis 2 the launch's
    splits, every sequence's in turn (nth_split; nsplit + S programs hold them all), so that
    no program is launched for a split past a sequence's keys (which balanced splits of 8
    sequences made most of an axis of nsplit a sequence). A program does what it would in a
    launch of its sequence alone, and writes its partial where that one would.

    With TAIL_M (a tree's one full row block and its tail, neither SEQ nor BY_DEPTH) the program
    of the full block also computes the TAIL_M rows after it, over the same dequantized key
    blocks (_attend_range), and writes them as the tail block's program would."""
    pdl_start(PDL)
    pid_m = tl.program_id(0) // V_PARTS
    DV: tl.constexpr = D // V_PARTS
    first = (tl.program_id(0) % V_PARTS) * DV
    dv = first + tl.arange(0, DV)
    if BALANCE:
        kvh = tl.program_id(1)
        chunk = split_chunk(LEN, T, 0, nsplit, S, MIN_CHUNK, BLOCK_N, True)
        seq, split = nth_split(LEN, T, S, chunk, tl.program_id(2))
        if seq >= S:  # past the launch's splits
            return
    else:
        seq = tl.program_id(1) // KVH
        kvh = tl.program_id(1) % KVH
        split = tl.program_id(2)
    length = tl.load(LEN + seq).to(tl.int32)
    Q += seq * T * stride_qt
    OUT += seq * T * stride_ot
    PAGES += seq * stride_ps
    MASK += seq * stride_ms
    rows = row0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows // G < T
    tok = rows // G
    tok_lo = (row0 + pid_m * BLOCK_M) // G  # the block's tokens (BY_DEPTH reads each one's ancestors)
    tok_hi = tl.minimum((row0 + pid_m * BLOCK_M + BLOCK_M + TAIL_M - 1) // G, T - 1)
    head = kvh * G + rows % G
    kend = length + T
    if not BALANCE:
        chunk = split_chunk(LEN, T, kend, nsplit, S, MIN_CHUNK, BLOCK_N, False)
    d = tl.arange(0, D)
    q_at = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    causal_end = kend
    if MODE == 1:
        causal_end = length + tok_hi + 1
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    ks_head = KS + kvh * stride_ksh
    vs_head = VS + kvh * stride_vsh

    if SEQ:
        q = tl.load(q_at, mask=row_ok[:, None], other=0.0)
        m_run = tl.full([BLOCK_M], NEG, tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        out = tl.zeros([BLOCK_M, DV], tl.float32)
        for s in range(0, tl.cdiv(kend, chunk)):
            lo = s * chunk
            hi = tl.minimum(tl.minimum(lo + chunk, kend), causal_end)
            m_s, l_s, o_s, _, _, _ = _attend_range(
                q, k_head, v_head, ks_head, vs_head, MASK, PAGES, lo, hi, length, tok, row_ok, d, dv, first,
                stride_kn, stride_vn, stride_ksn, stride_vsn, T, window, qk_scale, tok_lo, tok_hi, BLOCK_M, DV,
                BLOCK_N, MODE, HAS_WINDOW, K_KIND, V_KIND, BY_DEPTH, T_PAD, PAGED, ASM)
            m_run, l_run, out = merge_step(m_run, l_run, out, m_s, l_s, o_s)
        tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * D + dv[None, :],
                 (out / l_run[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
        return
    lo = split * chunk
    if lo >= kend:  # a split past the context (short contexts use fewer than the grid's): the merge reads none
        return
    hi = tl.minimum(tl.minimum(lo + chunk, kend), causal_end)
    q = tl.load(q_at, mask=row_ok[:, None], other=0.0)
    q2, tok2, row_ok2 = None, None, None  # no tail rows
    if TAIL_M > 0:
        rows2 = row0 + BLOCK_M + tl.arange(0, TAIL_M)
        row_ok2 = rows2 // G < T
        tok2 = rows2 // G
        head2 = kvh * G + rows2 % G
        q2 = tl.load(Q + tok2[:, None] * stride_qt + head2[:, None] * stride_qh + d[None, :],
                     mask=row_ok2[:, None], other=0.0)
    m_i, l_i, acc, m_2, l_2, acc_2 = _attend_range(
        q, k_head, v_head, ks_head, vs_head, MASK, PAGES, lo, hi, length, tok, row_ok, d, dv, first, stride_kn,
        stride_vn, stride_ksn, stride_vsn, T, window, qk_scale, tok_lo, tok_hi, BLOCK_M, DV, BLOCK_N, MODE,
        HAS_WINDOW, K_KIND, V_KIND, BY_DEPTH, T_PAD, PAGED, ASM, q2, tok2, row_ok2, TAIL_M)
    part = (split * S * KVH + seq * KVH + kvh) * R  # the split's partials of this sequence's KV head
    _store_rows(OUT, PO, PM, PL, m_i, l_i, acc, rows, row_ok, tok, head, part, stride_ot, dv, first, nsplit, D)
    if TAIL_M > 0:
        _store_rows(OUT, PO, PM, PL, m_2, l_2, acc_2, rows2, row_ok2, tok2, head2, part, stride_ot, dv, first,
                    nsplit, D)


@triton.jit
def _store_rows(OUT, PO, PM, PL, m_i, l_i, acc, rows, row_ok, tok, head, part, stride_ot, dv, first, nsplit,
                D: tl.constexpr):
    """A row block's result for its rows in range (row_ok): with one split its output (acc /
    sum), else its partial (max, sum, acc) among the split's partials at `part`."""
    if nsplit == 1:
        tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * D + dv[None, :],
                 (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
    else:
        at = part + rows
        if first == 0:  # every part computes the same max and sum
            tl.store(PM + at, m_i, mask=row_ok)
            tl.store(PL + at, l_i, mask=row_ok)
        tl.store(PO + at[:, None] * D + dv[None, :], acc, mask=((l_i > 0) & row_ok)[:, None])


_LOADED: dict[tuple, dict[str, int]] = {}  # a kernel plan() chose -> the first of its launches that loaded


def attention(q: torch.Tensor, k_cache: KVSide, v_cache: KVSide, length: torch.Tensor,
              scale: float, mode: int, mask: torch.Tensor | None, window: int | None,
              launch: Optional[dict[str, int]] = None) -> torch.Tensor:
    """See kernels.attention.cache_attention; `length` is an integer tensor, an element a sequence.
    `launch` overrides plan()'s block_m, nsplit, block_n, warps, stages, min_chunk, v_parts or
    tail (the benchmark's knobs, benchmarks/prefill_attention.py). A launch that needs more
    shared memory than the device has (Triton's OutOfResources, raised before the kernel runs)
    gives way to the next of smaller_launches(), and the one that loads is remembered for the
    same shapes. `tail` 1: the rows past the full blocks make a tail row block (row_launches),
    a launch of 4 warps with the full blocks' key blocks and stages; 2: where there is one full
    block, its program computes the tail's rows too (not in the deterministic mode, whose trees
    read a token's ancestors a row block at a time). Several sequences (`length` [S],
    kernels.attention.cache_attention) are one launch of each kernel, its axis 1 every
    sequence's KV heads."""
    rows_all, heads, dim = q.shape
    sequences = length.numel()
    t, stride_ps = sequence_rows(rows_all, sequences, k_cache)  # each sequence's rows, its table's offset
    (k_codes, k_scale, k_kind), (v_codes, v_scale, v_kind), pages = paged_side_args(k_cache, v_cache)
    k_codes, v_codes = code_words(k_codes, k_kind), code_words(v_codes, v_kind)
    kv_heads = k_codes.shape[1]
    group = heads // kv_heads
    capacity = side_capacity(k_cache)  # a paged sequence's rows: its launch is an unpaged cache's
    if deterministic():
        chosen = deterministic_plan(t, dim, capacity)
    else:
        chosen = plan(t, heads, kv_heads, q.device, dim, k_kind == CAST and v_kind == CAST, capacity, sequences)
    if launch:
        chosen.update(launch)
    by_depth = deterministic() and mode == MODE_MASK  # a tree's tokens read their ancestors by depth
    t_pad = max(16, triton.next_power_of_2(t)) if by_depth else 16  # a constant elsewhere: one compile any length
    blocks = row_launches(group * t, chosen["block_m"], bool(chosen["tail"]))
    first, tail_m, tail_blocks = blocks[-1]
    rows_padded = first + tail_m * tail_blocks
    merge_m = min(b for _, b, _ in blocks)  # divides every block's rows, so the blocks tile the partials
    nsplit = chosen["nsplit"]
    seq = bool(chosen.get("seq", 0))  # the program walks the splits itself: no partials, no merge
    fused_tail = 0  # tail 2: one full block's program computes the tail block's rows too
    if chosen["tail"] == 2 and len(blocks) == 2 and blocks[0][2] == 1 and not (seq or by_depth):
        fused_tail, blocks = blocks[1][1], blocks[:1]
    merged = nsplit > 1 and not seq
    balance = bool(chosen["balance"]) and sequences > 1  # one sequence: its own keys either way
    out = torch.empty(rows_all, heads * dim, dtype=q.dtype, device=q.device)
    if merged:
        po = torch.empty(nsplit, sequences * kv_heads, rows_padded, dim, dtype=torch.float32, device=q.device)
        pm = torch.empty(nsplit, sequences * kv_heads, rows_padded, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        po = pm = pl = out  # unused
    mask_arg = mask if mask is not None else q
    loaded = None
    for row0, block_m, m_blocks in blocks:
        # what the compiled kernel depends on (not m_blocks or nsplit, which every chunk length changes)
        key = (q.device.index, dim, k_kind, v_kind, mode, window is not None, block_m, seq, by_depth, pages is not None,
               balance, fused_tail, *(chosen[k] for k in ("block_n", "warps", "stages", "min_chunk", "v_parts")))
        if loaded is not None:  # a tail block: the full blocks' key blocks and stages
            cands = [dict(loaded, warps=4)]
        else:
            cands = [_LOADED[key]] if key in _LOADED else smaller_launches(dict(chosen, block_m=block_m),
                                                                           deterministic())
        for i, cand in enumerate(cands):
            try:
                grid = (m_blocks * chosen["v_parts"], kv_heads if balance else sequences * kv_heads,
                        1 if seq else nsplit + sequences if balance else nsplit)
                _split_kernel[grid](
                    q, k_codes, v_codes, k_scale, v_scale, out, po, pm, pl, length, mask_arg,
                    pages if pages is not None else length,
                    q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1),
                    v_codes.stride(0), v_codes.stride(1), k_scale.stride(0), k_scale.stride(1),
                    v_scale.stride(0), v_scale.stride(1), out.stride(0),
                    stride_ps, t * t if mask is not None and sequences > 1 else 0,
                    t, window or 0, scale * LOG2E, rows_padded, nsplit, row0, sequences,
                    KVH=kv_heads, G=group, D=dim, BLOCK_M=block_m, BLOCK_N=cand["block_n"],
                    MIN_CHUNK=chosen["min_chunk"],
                    MODE=mode, HAS_WINDOW=window is not None, K_KIND=k_kind, V_KIND=v_kind,
                    V_PARTS=chosen["v_parts"], SEQ=seq, BY_DEPTH=by_depth, T_PAD=t_pad, PAGED=pages is not None,
                    BALANCE=balance, ASM=q.is_cuda, TAIL_M=fused_tail, num_warps=cand["warps"],
                    num_stages=cand["stages"], **launch_options(q.device))
            except OutOfResources:
                if i == len(cands) - 1:
                    raise
                continue
            if loaded is None:
                _LOADED[key] = loaded = cand
            break
    if merged:
        dims = min(dim, MERGE_DIMS)
        merge_kernel[(rows_padded // merge_m, sequences * kv_heads, dim // dims)](
            po, pm, pl, out, length, out.stride(0), t, rows_padded, nsplit, KVH=kv_heads,
            G=group, D=dim, DC=dims, BLOCK_M=merge_m, MIN_CHUNK=chosen["min_chunk"], BLOCK_N=loaded["block_n"],
            BALANCE=balance, num_warps=loaded["warps"] if merge_m == blocks[0][1] else 4, **launch_options(q.device))
    return out
