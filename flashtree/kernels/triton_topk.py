"""Triton kernels of the draft's candidates (tree.draft_top_k): each row's top K log-probs of
logits over a vocabulary, without writing the log-probs of the whole vocabulary first.

A row's work is cut along the vocabulary into chunks of CHUNK logits, one program each, so that
the 15 rows of a draft block (or the 120 of eight) fill the GPU: a program reads its chunk once,
keeps the chunk's max and its sum of exp(x - max) for the row's log-sum-exp, and takes the
chunk's top K by K rounds of argmax (each round's winner masked out; a round is one reduction
of (value, first index) pairs, as tl.argmax is itself, not a max and then an argmax: each
reduction across the program's warps waits on shared memory). A second kernel, a
program a row, folds the chunks' sums into the log-sum-exp and takes the top K of the chunks'
candidates by the same rounds. A round's argmax is the first position of the max, and the
candidates lie in chunk order, each chunk's in its rounds' order, so equal logits come out in
vocabulary order: the row's K largest by (value descending, index ascending), whatever the
chunking (the definition: a stable descending sort).

Every row runs the same reductions over the same chunks whatever rows come with it, so a row's
candidates do not follow the rows beside it (a shared draft phase's blocks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits a program of the first kernel reads (16 KB of float32)
CHUNK_WARPS = 4  # warps a program of the first kernel runs (`python benchmarks/draft_topk.py` times others)


@triton.jit
def _top_k_chunk_kernel(X, PV, PI, PM, PS, V, stride_x, C, K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk program_id(1) of row program_id(0): its max, its sum of exp(x - max), and its top K
    (values and vocabulary indices, best first; -inf past a short last chunk's logits)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    at = tl.arange(0, CHUNK)
    cols = c * CHUNK + at
    ok = cols < V
    x = tl.load(X + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
    ranks = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.zeros([KP], tl.int32)
    for i in range(K):
        best, j = tl.max(x, 0, return_indices=True)  # one (value, first index) reduction
        vals = tl.where(ranks == i, best, vals)
        ids = tl.where(ranks == i, tl.minimum(c * CHUNK + j, V - 1), ids)
        x = tl.where(at == j, float("-inf"), x)
    out = (row * C + c) * K + ranks
    tl.store(PV + out, vals, mask=ranks < K)
    tl.store(PI + out, ids, mask=ranks < K)
    tl.store(PM + row * C + c, m)
    tl.store(PS + row * C + c, s)


@triton.jit
def _top_k_merge_kernel(PV, PI, PM, PS, OV, OI, C, K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
                  NP: tl.constexpr):
    """Row program_id(0)'s top K log-probs: its chunks' candidates' K best, each minus the row's
    log-sum-exp (as log_softmax rounds it: (x - max) - log(sum))."""
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, CP)
    c_ok = cs < C
    m = tl.load(PM + row * C + cs, mask=c_ok, other=float("-inf"))
    s = tl.load(PS + row * C + cs, mask=c_ok, other=0.0)
    top = tl.max(m, 0)
    log_sum = tl.log(tl.sum(tl.where(c_ok, s * tl.exp(m - top), 0.0), 0))
    n = tl.arange(0, NP)
    n_ok = n < C * K
    cand = tl.load(PV + row * C * K + n, mask=n_ok, other=float("-inf"))
    cand_ids = tl.load(PI + row * C * K + n, mask=n_ok, other=0)
    ranks = tl.arange(0, KP)
    vals = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int64)
    for i in range(K):
        best, j = tl.max(cand, 0, return_indices=True)
        token = tl.sum(tl.where(n == j, cand_ids, 0), 0)
        vals = tl.where(ranks == i, (best - top) - log_sum, vals)
        ids = tl.where(ranks == i, token.to(tl.int64), ids)
        cand = tl.where(n == j, float("-inf"), cand)
    tl.store(OV + row * K + ranks, vals, mask=ranks < K)
    tl.store(OI + row * K + ranks, ids, mask=ranks < K)


def top_k_log_probs(logits: torch.Tensor, k: int, chunk: int = CHUNK,
                    warps: int = CHUNK_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, k] float32, indices [R, k] long): the top k of each row of log_softmax(logits
    [R, V]), best first, equal values in index order. Allocates with torch only and reads nothing
    on the host: a captured phase can hold it. `chunk` (a power of two) and `warps`: the first
    kernel's launch."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    kp = triton.next_power_of_2(k)
    f32 = dict(dtype=torch.float32, device=logits.device)
    part_vals = torch.empty(rows, chunks, k, **f32)
    part_ids = torch.empty(rows, chunks, k, dtype=torch.int32, device=logits.device)
    part_max, part_sum = torch.empty(rows, chunks, **f32), torch.empty(rows, chunks, **f32)
    vals = torch.empty(rows, k, **f32)
    ids = torch.empty(rows, k, dtype=torch.long, device=logits.device)
    if rows == 0:
        return vals, ids
    _top_k_chunk_kernel[(rows, chunks)](logits, part_vals, part_ids, part_max, part_sum, vocab, logits.stride(0),
                                  chunks, K=k, KP=kp, CHUNK=chunk, num_warps=warps)
    _top_k_merge_kernel[(rows,)](part_vals, part_ids, part_max, part_sum, vals, ids, chunks, K=k, KP=kp,
                           CP=triton.next_power_of_2(chunks), NP=triton.next_power_of_2(chunks * k), num_warps=4)
    return vals, ids
