"""Paged KV on the GPU: the compiled attention kernel and the fused stores through a shuffled page
table give the same bits as over the same rows in order (bf16; plain and q4_0 sides; decode
splits, a tree, a prefill chunk; the deterministic mode's launches), several sequences in one
launch give each one's bits alone, and a pool smaller than
every sequence's --max-ctx serves two sessions in turn, each resuming from its snapshot."""

import pytest
import torch

from flashtree import Engine, kernels
from flashtree.kernels.kv_storage import PAGE_ROWS, Paged, QuantRows, quantize_kv
from flashtree.kernels.triton_attention import MODE_ALL, MODE_CAUSAL, MODE_MASK, attention
from flashtree.runtime.engine import ASSETS
from test_sequences import A, B

pytestmark = pytest.mark.gpu


def sides(kind, rows, table, pool_pages):
    """The rows in order, and the same rows in a pool through `table` (NaN or junk elsewhere)."""
    phys = (table.long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS, device="cuda")).flatten()
    if kind is None:
        pool = torch.full((pool_pages * PAGE_ROWS, *rows.shape[1:]), float("nan"), dtype=rows.dtype, device="cuda")
        pool[phys] = rows
        return rows, Paged(pool, table)
    codes, scale = quantize_kv(rows, kind)
    pool_codes = torch.full((pool_pages * PAGE_ROWS, *codes.shape[1:]), 0x77, dtype=codes.dtype, device="cuda")
    pool_scale = torch.full((pool_pages * PAGE_ROWS, *scale.shape[1:]), float("nan"), dtype=scale.dtype,
                            device="cuda")
    pool_codes[phys], pool_scale[phys] = codes, scale
    return QuantRows(kind, codes, scale), Paged(QuantRows(kind, pool_codes, pool_scale), table)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind,dim,t,mode,length", [
    (None, 128, 1, "causal", 5000), (None, 128, 23, "mask", 3000), (None, 128, 512, "causal", 1000),
    ("q4_0", 256, 1, "causal", 6000), ("q4_0", 256, 23, "mask", 4000)])
def test_paged_attention_is_the_same_bits_as_rows_in_order(kind, dim, t, mode, length, deterministic):
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-(length + t) // PAGE_ROWS) + 3
    table = (torch.randperm(2 * pages, device="cuda", generator=g)[:pages] + 1).int()
    rows = [torch.randn(pages * PAGE_ROWS, 4, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"]
    (k, pk), (v, pv) = (sides(kind, r, table, 2 * pages + 1) for r in rows)
    q = torch.randn(t, 24, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.tril(torch.ones(t, t, dtype=torch.uint8, device="cuda")) if mode == "mask" else None
    n = torch.tensor([length], dtype=torch.int32, device="cuda")
    m = MODE_MASK if mode == "mask" else MODE_CAUSAL
    kernels.set_deterministic(deterministic)
    try:
        want = attention(q, k, v, n, dim ** -0.5, m, mask, None)
        got = attention(q, pk, pv, n, dim ** -0.5, m, mask, None)
    finally:
        kernels.set_deterministic(False)
    assert torch.isfinite(got).all(), "a row outside the sequence's pages was read"
    assert torch.equal(got, want)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind,dim,t,mode,lengths", [
    (None, 128, 23, "mask", (3000, 700, 4100)), (None, 128, 16, "all", (2000, 64, 0)),
    ("q4_0", 256, 23, "mask", (4000, 1, 2500)), ("q4_0", 256, 1, "causal", (6000, 30, 900))])
def test_several_sequences_in_one_launch_are_each_alone_to_the_bit(kind, dim, t, mode, lengths, deterministic):
    """Three sequences of one pool, each its own pages, through one launch (a table row and a
    length each) give the bits of a launch of each alone, split and merged or not: alone at the
    split size the launch's keys give (plan's balance; 16 splits of at least 64 keys here), or,
    deterministic, at the fixed one."""
    g = torch.Generator(device="cuda").manual_seed(1)
    pages = -(-(max(lengths) + t) // PAGE_ROWS) + 1
    tables = (torch.randperm(3 * pages, device="cuda", generator=g) + 1).int().view(3, pages)
    pool = [torch.randn((3 * pages + 1) * PAGE_ROWS, 4, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in "kv"]
    if kind is not None:
        pool = [QuantRows(kind, *quantize_kv(r, kind)) for r in pool]
    q = torch.randn(3 * t, 24, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    masks = torch.tril(torch.ones(3, t, t, dtype=torch.uint8, device="cuda")) if mode == "mask" else None
    n = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    m = {"mask": MODE_MASK, "causal": MODE_CAUSAL, "all": MODE_ALL}[mode]
    own = [tables[s] for s in range(3)]
    launch = own_launch = None
    if not deterministic:
        launch = {"nsplit": 16, "min_chunk": 64}
        chunk = -(-max(-(-(sum(lengths) + 3 * t) // 16), 64) // 64) * 64
        own_launch = {"nsplit": 16, "min_chunk": chunk}
    kernels.set_deterministic(deterministic)
    try:
        together = attention(q, Paged(pool[0], tables), Paged(pool[1], tables), n, dim ** -0.5, m, masks, None,
                             launch)
        alone = [attention(q[s * t:(s + 1) * t], Paged(pool[0], own[s]), Paged(pool[1], own[s]), n[s:s + 1],
                           dim ** -0.5, m, None if masks is None else masks[s], None, own_launch) for s in range(3)]
    finally:
        kernels.set_deterministic(False)
    assert torch.equal(together, torch.cat(alone))


def test_a_small_pool_serves_two_sessions_in_turn():
    eng = Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda", dtype="bfloat16",
                                 mode="ddtree", budget=22, max_ctx=1024, prefill_ubatch=64, max_sequences=2,
                                 kv_pool_tokens=1024, cache_min_tokens=1)
    conversation, side = A * 8, B * 6
    first = eng.generate(conversation, max_tokens=32, stop_token_ids=[])
    eng.generate(side, max_tokens=32, stop_token_ids=[])
    again = eng.generate(conversation + first.token_ids, max_tokens=32, stop_token_ids=[])
    assert again.stats.cached_tokens == len(conversation) + 31, "restored after its pages went to the side request"
    fresh = Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda", dtype="bfloat16",
                                   mode="ddtree", budget=22, max_ctx=1024, prefill_ubatch=64, max_sequences=1)
    fresh.generate(conversation, max_tokens=32, stop_token_ids=[])
    assert again.token_ids == fresh.generate(conversation + first.token_ids, max_tokens=32,
                                             stop_token_ids=[]).token_ids


def test_a_preempted_sequence_resumes_and_both_answers_are_their_own():
    """Two generations side by side (captured graphs, shared steps) in a pool that holds about one
    of them: one is preempted and restored; each answer is its alone one, or differs at a bf16 tie
    (a shared verify's GEMMs over more rows may round otherwise)."""
    import copy

    from test_gpu_decode import same_or_tie
    from test_sequences import side_by_side

    def engine(sequences, **kw):
        return Engine.from_pretrained(str(ASSETS / "target"), str(ASSETS / "draft"), device="cuda",
                                      dtype="bfloat16", mode="ddtree", budget=22, max_ctx=1024, prefill_ubatch=64,
                                      max_sequences=sequences, **kw)

    prompts = (A * 8, B * 6)
    alone = engine(1)
    want = [alone.generate(p, max_tokens=64, stop_token_ids=[]).token_ids for p in prompts]
    eng = engine(2, kv_pool_tokens=1024)
    streams = [eng.stream(p, max_tokens=64, stop_token_ids=[]) for p in prompts]
    _, errors = side_by_side(streams)
    assert not errors and sum(s.result.stats.preemptions for s in streams) >= 1
    ref32 = copy.deepcopy(eng.target).float()
    for prompt, s, w in zip(prompts, streams, want):
        assert same_or_tie(ref32, prompt, s.result.token_ids, w, model=eng.target)
