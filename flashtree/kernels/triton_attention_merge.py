"""How the attention kernel (triton_attention.py) splits a step's keys among its programs and
how the splits' partials are merged: the keys a split takes (split_chunk), which sequence and
split a program of a launch over several sequences has (nth_split), the fold of one split into
a running result (merge_step: the one definition of the merge, for the merge kernel and for a
program that walks its splits itself) and the merge kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_pdl import pdl_start

NEG = tl.constexpr(-1.0e30)  # "no key seen yet": finite, so exp2(NEG - NEG) never makes a NaN


@triton.jit
def split_chunk(LEN, T, kend, nsplit, S, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BALANCE: tl.constexpr):
    """Keys per split: at least MIN_CHUNK, whole key blocks, and either this sequence's keys
    `kend` over nsplit or, with BALANCE, the keys of every sequence of the launch (S of them,
    LEN[s] + T each) over nsplit. Balanced, each program of a launch over several sequences
    walks about as many keys as the others, however their lengths differ, and no more of them
    than one sequence's launch would use (a long sequence beside short ones takes most of the
    splits): fewer partials to write and merge than nsplit splits a sequence. No sequence needs
    more than nsplit splits, since its keys are at most the launch's, and all of them together
    at most nsplit + S (a sequence's last split may be short). Splits that start at or past
    `kend` have nothing to do (short contexts use only a few)."""
    keys = kend
    if BALANCE:
        keys = 0
        for s in range(0, S):
            keys += tl.load(LEN + s).to(tl.int32) + T
    chunk = tl.maximum(tl.cdiv(keys, nsplit), MIN_CHUNK)
    return tl.cdiv(chunk, BLOCK_N) * BLOCK_N


@triton.jit
def nth_split(LEN, T, S, chunk, w):
    """(sequence, its split) of the launch's split w, counting every sequence's splits of `chunk`
    keys in turn; (S, 0) past the last of them."""
    seq = S
    split = w * 0
    first = w * 0
    for s in range(0, S):
        n = tl.cdiv(tl.load(LEN + s).to(tl.int32) + T, chunk)
        hit = (w >= first) & (w < first + n)
        seq = tl.where(hit, s, seq)
        split = tl.where(hit, w - first, split)
        first += n
    return seq, split


@triton.jit
def merge_step(m_run, l_run, acc, m_s, l_s, o_s):
    """Fold one split's partial (m_s, l_s, o_s) into the running (m_run, l_run, acc), in the
    order the splits come: the one definition of the merge, for the merge kernel and for a
    program that walks its splits itself (SEQ), so that both give the same bits. A row the split
    saw no key of (l_s 0) adds nothing."""
    m_new = tl.maximum(m_run, m_s)
    a = tl.exp2(m_run - m_new)
    b = tl.exp2(m_s - m_new)
    o_s = tl.where((l_s > 0)[:, None], o_s, 0.0)
    return m_new, l_run * a + l_s * b, acc * a[:, None] + o_s * b[:, None]


MERGE_DIMS = 64  # head dims a program of merge_kernel merges


@triton.jit(do_not_specialize=["nsplit"])
def merge_kernel(PO, PM, PL, OUT, LEN, stride_ot, T, R, nsplit, KVH: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, BLOCK_M: tl.constexpr,
                  MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BALANCE: tl.constexpr = False,
                  PDL: tl.constexpr = False):
    """Merge the partials of the splits that had keys (online, split by split), DC of the head's
    dims a program. The loop stops at the last active split, which the device length gives (17
    of 32 at a 4K context, 5 at 1K), and its loads are pipelined (cp.async, two splits ahead):
    walking the splits one load at a time leaves it latency-bound, and unrolling the loop was
    slower still (`flashtree bench`'s kernel profiles time the merge). A tile of DC = 64 dims
    keeps two splits' float32 partials in flight within a consumer GPU's shared memory at 128
    rows a block. Axis 1 is (sequence, KV head), as in _split_kernel."""
    pdl_start(PDL)
    seq = tl.program_id(1) // KVH
    kvh = tl.program_id(1) % KVH
    kend = tl.load(LEN + seq).to(tl.int32) + T
    OUT += seq * T * stride_ot
    active = tl.cdiv(kend, split_chunk(LEN, T, kend, nsplit, tl.num_programs(1) // KVH, MIN_CHUNK, BLOCK_N,
                                        BALANCE))
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // G
    head = kvh * G + rows % G
    d = tl.program_id(2) * DC + tl.arange(0, DC)
    m_run = tl.full([BLOCK_M], NEG, tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DC], tl.float32)
    for s in tl.range(0, tl.minimum(active, nsplit), num_stages=3):
        part = (s * tl.num_programs(1) + tl.program_id(1)) * R + rows
        l_s = tl.load(PL + part)
        o_s = tl.load(PO + part[:, None] * D + d[None, :])  # garbage where l_s is 0: not written
        m_run, l_run, acc = merge_step(m_run, l_run, acc, tl.load(PM + part), l_s, o_s)
    out = acc / l_run[:, None]
    tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * D + d[None, :],
             out.to(OUT.dtype.element_ty), mask=(tok < T)[:, None])
