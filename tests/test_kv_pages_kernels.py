"""The Triton kernels over a paged cache (kernels/kv_storage.py: Paged), run by Triton's CPU
interpreter: attention and the fused K/V stores through a shuffled page table give the same bits
as over the same rows laid out in order, and read or write no row outside the sequence's pages
(those hold NaN here, which any read would spread); several sequences' rows in one launch give
the bits of a launch each."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")
pytestmark = pytest.mark.slow  # one interpreted script of about a minute

SCRIPT = textwrap.dedent("""
    import json
    import torch
    from flashtree import kernels
    from flashtree.kernels.kv_storage import PAGE_ROWS, Paged, QuantRows, quantize_kv
    from flashtree.kernels.triton_attention import MODE_ALL, MODE_CAUSAL, MODE_MASK, attention
    from flashtree.kernels.fused import gated_qkv_store, qkv_rope_store
    from flashtree.models.rope import RotaryTable
    from flashtree.runtime.ddtree import build_tree

    PAGES = 5
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([7, 2, 9, 4, 11], dtype=torch.int32)  # logical page i -> pool page table[i]
    phys = (table.long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS)).flatten()

    def side(kind, rows):  # the same values as contiguous rows and as a pool with NaN elsewhere
        pool_rows = torch.full((12 * PAGE_ROWS, *rows.shape[1:]), float("nan"))
        if kind is None:
            pool_rows[phys] = rows
            return rows, Paged(pool_rows, table)
        codes, scale = quantize_kv(rows, kind)
        pool_codes = torch.full((12 * PAGE_ROWS, *codes.shape[1:]), 0x77, dtype=codes.dtype)
        pool_scale = torch.full((12 * PAGE_ROWS, *scale.shape[1:]), float("nan"), dtype=scale.dtype)
        pool_codes[phys], pool_scale[phys] = codes, scale
        return QuantRows(kind, codes, scale), Paged(QuantRows(kind, pool_codes, pool_scale), table)

    def tree_mask(n):
        logp = torch.log_softmax(torch.randn(15, 100, generator=g), -1).sort(-1, descending=True)
        return build_tree(1, logp.values, logp.indices, n - 1, True, 15).ancestor_mask().view(torch.uint8)

    out = {}
    for det in (False, True):
        kernels.set_deterministic(det)
        for kind, t, mode, length, window in [(None, 16, "causal", 100, None), (None, 7, "all", 64, None),
                                              (None, 23, "mask", 200, None), (None, 1, "causal", 250, 50),
                                              ("q8_0", 16, "causal", 130, None), ("q4_0", 23, "mask", 190, None),
                                              (None, 66, "causal", 120, None)]:
            rows = torch.randn(PAGES * PAGE_ROWS, 2, 64, generator=g)
            (k, pk), (v, pv) = side(kind, rows), side(kind, torch.randn(rows.shape, generator=g))
            pv = Paged(pv.rows, pk.pages)  # one table for the layer
            q = torch.randn(t, 4, 64, generator=g)
            mask = tree_mask(t) if mode == "mask" else None
            m = {"all": MODE_ALL, "causal": MODE_CAUSAL, "mask": MODE_MASK}[mode]
            n = torch.tensor([length], dtype=torch.int32)
            want = attention(q, k, v, n, 0.125, m, mask, window)
            got = attention(q, pk, pv, n, 0.125, m, mask, window)
            name = f"attention {kind} t={t} {mode} len={length} window={window} deterministic={det}"
            out[name] = [bool(torch.equal(got, want)), bool(torch.isfinite(got).all())]
    kernels.set_deterministic(False)

    rope, rope32 = (RotaryTable(dim, {"rope_type": "default", "rope_theta": 1e4}, 1000) for dim in (64, 32))
    for kind in (None, "q8_0"):
        heads, kvh, t, length = 4, 2, 9, 120
        qkv = torch.randn(t, (heads + 2 * kvh) * 64, generator=g)
        pos = torch.arange(length, length + t)
        norm = torch.rand(64, generator=g) + 0.5
        for gated in (False, True):
            contiguous = [side(kind, torch.zeros(PAGES * PAGE_ROWS, kvh, 64))[0] for _ in range(2)]
            pools = [side(kind, torch.zeros(PAGES * PAGE_ROWS, kvh, 64))[1] for _ in range(2)]
            n = torch.tensor([length], dtype=torch.int32)
            if gated:
                qkv2 = torch.randn(t, (2 * heads + 2 * kvh) * 64, generator=g)
                a = gated_qkv_store(qkv2, rope32.cos[pos], rope32.sin[pos], norm, norm, 1e-6, *contiguous, n, heads, kvh, 32)
                b = gated_qkv_store(qkv2, rope32.cos[pos], rope32.sin[pos], norm, norm, 1e-6, *pools, n, heads, kvh, 32)
                same_q = all(torch.equal(x, y) for x, y in zip(a, b))
            else:
                a = qkv_rope_store(qkv, pos, rope.cos, rope.sin, norm, norm, 1e-6, *contiguous, n, heads, kvh)
                b = qkv_rope_store(qkv, pos, rope.cos, rope.sin, norm, norm, 1e-6, *pools, n, heads, kvh)
                same_q = torch.equal(a, b)
            stored = []
            for c, p in zip(contiguous, pools):
                c_codes = c if kind is None else c.codes
                p_codes = p.rows if kind is None else p.rows.codes
                at = phys[length:length + t]
                stored.append(bool(torch.equal(c_codes[length:length + t], p_codes[at])))
            out[f"store {kind} gated={gated}"] = [same_q, all(stored)]

    # three sequences over one pool, each its own pages: one launch for all, or one each
    tables = torch.tensor([[7, 2, 9, 4, 11], [1, 3, 5, 6, 8], [12, 10, 14, 13, 15]], dtype=torch.int32)

    def shared_pool(kind, rows):  # rows [3, PAGES * PAGE_ROWS, heads, D]: sequence s's at its pages
        flat = torch.full((16 * PAGE_ROWS, *rows.shape[2:]), float("nan"))
        for s in range(3):
            flat[(tables[s].long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS)).flatten()] = rows[s]
        if kind is None:
            return flat
        codes, scale = quantize_kv(flat.nan_to_num(), kind)
        return QuantRows(kind, codes, scale)

    for det in (False, True):
        kernels.set_deterministic(det)
        for kind, t, mode, lengths, window in [(None, 23, "mask", (200, 64, 131), None),
                                               (None, 16, "causal", (100, 250, 0), None),
                                               (None, 7, "all", (64, 65, 190), None),
                                               (None, 1, "causal", (250, 30, 120), 50),
                                               ("q4_0", 23, "mask", (190, 1, 128), None)]:
            k = shared_pool(kind, torch.randn(3, PAGES * PAGE_ROWS, 2, 64, generator=g))
            v = shared_pool(kind, torch.randn(3, PAGES * PAGE_ROWS, 2, 64, generator=g))
            q = torch.randn(3 * t, 4, 64, generator=g)
            masks = torch.stack([tree_mask(t) for _ in range(3)]) if mode == "mask" else None
            m = {"all": MODE_ALL, "causal": MODE_CAUSAL, "mask": MODE_MASK}[mode]
            n = torch.tensor(lengths, dtype=torch.int32)
            together = attention(q, Paged(k, tables), Paged(v, tables), n, 0.125, m, masks, window)
            rows = [tables[s] for s in range(3)]  # one table object a sequence, for both sides
            alone = torch.cat([attention(q[s * t:(s + 1) * t], Paged(k, rows[s]), Paged(v, rows[s]), n[s:s + 1],
                                         0.125, m, None if masks is None else masks[s], window) for s in range(3)])
            name = f"together attention {kind} t={t} {mode} lengths={lengths} window={window} deterministic={det}"
            out[name] = [bool(torch.equal(together, alone)), bool(torch.isfinite(together).all())]
    kernels.set_deterministic(False)

    # splits sized from the launch's keys (plan's balance): 4 splits of at least 64 keys shared by
    # the three sequences are each one's launch alone at the chunk the launch's keys give;
    # unbalanced, each one's launch alone at its own
    for kind, t, mode, lengths in [(None, 23, "mask", (200, 64, 131)), ("q4_0", 1, "causal", (250, 30, 120))]:
        k = shared_pool(kind, torch.randn(3, PAGES * PAGE_ROWS, 2, 64, generator=g))
        v = shared_pool(kind, torch.randn(3, PAGES * PAGE_ROWS, 2, 64, generator=g))
        q = torch.randn(3 * t, 4, 64, generator=g)
        masks = torch.stack([tree_mask(t) for _ in range(3)]) if mode == "mask" else None
        m = {"causal": MODE_CAUSAL, "mask": MODE_MASK}[mode]
        n = torch.tensor(lengths, dtype=torch.int32)
        keys = sum(lengths) + 3 * t
        chunk = -(-max(-(-keys // 4), 64) // 64) * 64
        rows = [tables[s] for s in range(3)]
        for balance in (1, 0):
            launch = {"nsplit": 4, "min_chunk": 64, "balance": balance}
            together = attention(q, Paged(k, tables), Paged(v, tables), n, 0.125, m, masks, None, launch)
            own = {"nsplit": 4, "min_chunk": chunk if balance else 64}
            alone = torch.cat([attention(q[s * t:(s + 1) * t], Paged(k, rows[s]), Paged(v, rows[s]), n[s:s + 1],
                                         0.125, m, None if masks is None else masks[s], None, own)
                               for s in range(3)])
            name = f"together attention {kind} t={t} {mode} lengths={lengths} balance={balance}"
            out[name] = [bool(torch.equal(together, alone)), bool(torch.isfinite(together).all())]

    # a 27B tree's 138 rows a KV head (23 tokens of 6 query heads, 256 wide) as a 128-row block
    # whose program computes the 16-row tail too: over three sequences, each alone at the chunk
    # the launch's keys give, and the bits of the tail in a launch of its own
    k = shared_pool("q4_0", torch.randn(3, PAGES * PAGE_ROWS, 1, 256, generator=g))
    v = shared_pool("q4_0", torch.randn(3, PAGES * PAGE_ROWS, 1, 256, generator=g))
    t, lengths, rows = 23, (150, 40, 90), [tables[s] for s in range(3)]
    q = torch.randn(3 * t, 6, 256, generator=g)
    masks = torch.stack([tree_mask(t) for _ in range(3)])
    n = torch.tensor(lengths, dtype=torch.int32)
    chunk = -(-max(-(-(sum(lengths) + 3 * t) // 4), 64) // 64) * 64
    fused = {"block_m": 128, "nsplit": 4, "min_chunk": 64, "tail": 2}  # one full block: the fused launch
    own = dict(fused, min_chunk=chunk)
    together = attention(q, Paged(k, tables), Paged(v, tables), n, 0.0625, MODE_MASK, masks, None, fused)
    apart = attention(q, Paged(k, tables), Paged(v, tables), n, 0.0625, MODE_MASK, masks, None, dict(fused, tail=1))
    alone = torch.cat([attention(q[s * t:(s + 1) * t], Paged(k, rows[s]), Paged(v, rows[s]), n[s:s + 1], 0.0625,
                                 MODE_MASK, masks[s], None, own) for s in range(3)])
    out["together attention q4_0 256-wide tree, its tail in the full block's program"] = [
        bool(torch.equal(together, alone) and torch.equal(together, apart)), bool(torch.isfinite(together).all())]

    for kind in (None, "q8_0"):
        heads, kvh, t = 4, 2, 5
        n = torch.tensor([120, 3, 64], dtype=torch.int32)
        pos = torch.cat([torch.arange(int(x), int(x) + t) for x in n])
        for gated in (False, True):
            sides = [[shared_pool(kind, torch.zeros(3, PAGES * PAGE_ROWS, kvh, 64)) for _ in range(2)]
                     for _ in range(2)]  # the launch for all, the launches one by one
            width = (2 * heads + 2 * kvh) * 64 if gated else (heads + 2 * kvh) * 64
            qkv = torch.randn(3 * t, width, generator=g)

            def store(span, sd, tab, ln):  # the rows of `span`, their sides, table and lengths
                if gated:
                    return gated_qkv_store(qkv[span], rope32.cos[pos[span]], rope32.sin[pos[span]], norm, norm,
                                           1e-6, Paged(sd[0], tab), Paged(sd[1], tab), ln, heads, kvh, 32)
                return qkv_rope_store(qkv[span], pos[span], rope.cos, rope.sin, norm, norm, 1e-6,
                                      Paged(sd[0], tab), Paged(sd[1], tab), ln, heads, kvh)
            a = store(slice(0, 3 * t), sides[0], tables, n)
            b = [store(slice(s * t, (s + 1) * t), sides[1], tables[s], n[s:s + 1]) for s in range(3)]
            if gated:
                same_q = all(torch.equal(x, torch.cat(y)) for x, y in zip(a, zip(*b)))
            else:
                same_q = torch.equal(a, torch.cat(b))
            codes = [[x if kind is None else x.codes for x in sd] for sd in sides]
            same_rows = all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(*codes))
            written = all(bool(x.nan_to_num().float().abs().sum() > 0) for x in codes[0])
            out[f"together store {kind} gated={gated}"] = [bool(same_q), same_rows and written]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def found() -> dict:
    return run_interpreted(SCRIPT, threads=2)


def assert_same_bits_read_in_pages(found: dict, prefix: str, count: int) -> None:
    """The `count` attention cases named `prefix`...: each the same bits as its reference, and
    finite (a row read outside the pages it may read would be NaN)."""
    cases = {k: v for k, v in found.items() if k.startswith(prefix)}
    assert len(cases) == count
    assert all(same for same, _ in cases.values()), [k for k, (same, _) in cases.items() if not same]
    assert all(finite for _, finite in cases.values()), "a row outside a sequence's pages was read"


def test_paged_attention_is_the_same_bits_as_rows_in_order(found: dict) -> None:
    assert_same_bits_read_in_pages(found, "attention", 14)


def test_paged_stores_write_the_rows_the_table_names(found: dict) -> None:
    cases = {k: v for k, v in found.items() if k.startswith("store")}
    assert len(cases) == 4 and all(q and stored for q, stored in cases.values()), cases


def test_several_sequences_attention_in_one_launch_is_each_alone_to_the_bit(found: dict) -> None:
    """Three sequences of different lengths over one pool, in one launch (a table row each), give
    the bits of three launches of one sequence: in every mask mode, with a window, over a q4_0
    cache, with and without the deterministic mode; with the splits sized from the launch's keys,
    the bits of each alone at that split size, also for a 27B tree whose tail rows the full
    block's program computes (and the bits of the tail in a launch of its own)."""
    assert_same_bits_read_in_pages(found, "together attention", 15)


def test_several_sequences_stores_in_one_launch_write_what_each_alone_writes(found: dict) -> None:
    cases = {k: v for k, v in found.items() if k.startswith("together store")}
    assert len(cases) == 4 and all(q and rows for q, rows in cases.values()), cases
