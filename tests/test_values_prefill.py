"""A long causal prefill chunk over a quantized KV cache attends over the cache's values,
dequantized once a span (kernels/attention.py: values_prefill): the copy holds the values the
attention kernels read, bit for bit, through a page table too (on the CPU, by Triton's
interpreter); on the GPU the chunk's output is the attention of those values, over one span or
several; the path stays out of the deterministic mode and away from plain caches; and it
allocates no more than the memory plan reserves for it."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from interpreted import run_interpreted  # noqa: E402

from flashtree import kernels  # noqa: E402
from flashtree.kernels import attention as attention_module  # noqa: E402
from flashtree.kernels.attention import cache_attention, reference_attention, values_prefill  # noqa: E402
from flashtree.kernels.kv_storage import PAGE_ROWS, Paged, QuantRows, quantize_kv, scale_dtype  # noqa: E402
from flashtree.kernels.triton_attention import MODE_CAUSAL, attention  # noqa: E402

PAGED_SCRIPT = textwrap.dedent("""
    import json
    import torch
    from flashtree.kernels.kv_storage import PAGE_ROWS, Paged, QuantRows, kv_rows, paged_side_args, quantize_kv
    from flashtree.kernels.triton_kv_read import cache_values

    g = torch.Generator().manual_seed(0)
    table = torch.tensor([7, 2, 9, 4, 11], dtype=torch.int32)  # logical page i -> pool page table[i]
    phys = (table.long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS)).flatten()
    out = {}
    for kind in ("q4_0", "q8_0", "fp8"):
        x = torch.randn(5 * PAGE_ROWS, 2, 64, generator=g)
        if kind == "fp8":
            codes, scale = x.to(torch.float8_e4m3fn).view(torch.uint8), None
        else:
            codes, scale = quantize_kv(x, kind)
        # the pool: the sequence's rows at its pages, codes that decode to NaN or garbage elsewhere
        pool_codes = torch.full((12 * PAGE_ROWS, *codes.shape[1:]), 0x7F, dtype=codes.dtype)
        pool_codes[phys] = codes
        pool_scale = None
        if scale is not None:
            pool_scale = torch.full((12 * PAGE_ROWS, *scale.shape[1:]), float("nan"), dtype=scale.dtype)
            pool_scale[phys] = scale
        rows, paged = QuantRows(kind, codes, scale), Paged(QuantRows(kind, pool_codes, pool_scale), table)
        start, end = PAGE_ROWS - 5, 4 * PAGE_ROWS + 3  # across pages, not whole blocks of the kernel's rows
        for label, side in (("rows", rows), ("paged", paged)):
            (c, s, k), _, pages = paged_side_args(side, side)
            got = cache_values(c, s, k, pages, start, end, 64, torch.float32)
            want = kv_rows(rows, end, torch.float32)[start:]
            out[f"{kind} {label}"] = [list(got.shape), int((got != want).sum()), bool(got.isnan().any())]
    print(json.dumps(out))
""")


def test_the_values_copy_reads_the_rows_the_table_names_bit_for_bit():
    found = run_interpreted(PAGED_SCRIPT)
    assert found == {f"{kind} {label}": [[3 * PAGE_ROWS + 8, 2, 64], 0, False]
                     for kind in ("q4_0", "q8_0", "fp8") for label in ("rows", "paged")}


SPANS_SCRIPT = textwrap.dedent("""
    import json, math
    import torch
    from flashtree.kernels import attention
    from flashtree.kernels.attention import reference_attention, values_prefill
    from flashtree.kernels.kv_storage import QuantRows, quantize_kv

    def attend(q, k, v, causal, scale):  # a fused attention's contract, in float32 on the CPU
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
        scores = q.float() @ k.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ v).to(q.dtype), scores.logsumexp(-1)

    g = torch.Generator().manual_seed(0)
    out = {}
    for span, length, t in ((16384, 0, 40), (16384, 200, 40), (64, 200, 40), (64, 192, 70), (50, 200, 64)):
        attention.VALUES_SPAN = span
        k = QuantRows("q4_0", *quantize_kv(torch.randn(length + t, 2, 64, generator=g), "q4_0"))
        v = QuantRows("q4_0", *quantize_kv(torch.randn(length + t, 2, 64, generator=g), "q4_0"))
        q = torch.randn(t, 4, 64, generator=g)
        got = values_prefill(q, k, v, torch.tensor([length]), 0.125, attend)
        want = reference_attention(q, k, v, length, 0.125, None, True, None)
        out[f"{span} {length} {t}"] = (got - want).abs().max().item()
    print(json.dumps(out))
""")


def test_spans_merged_by_their_log_sum_exp_are_the_attention_over_all_rows():
    """values_prefill's spans (one, several, a short last committed one, none before the chunk)
    merged in float32 give the chunk's causal attention over the whole cache: run on the CPU with
    an attention of the fused kernels' contract computed in float32."""
    found = run_interpreted(SPANS_SCRIPT)
    assert len(found) == 5 and max(found.values()) < 1e-5, found


def quantized_cache(kind: str, rows: int, kv_heads: int, dim: int) -> QuantRows:
    x = torch.randn(rows, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    if kind == "fp8":
        return QuantRows("fp8", x.to(torch.float8_e4m3fn).view(torch.uint8), None)
    return QuantRows(kind, *quantize_kv(x, kind, scale_dtype(kind, torch.bfloat16)))


def paged_copy(side: QuantRows, table: torch.Tensor) -> Paged:
    """The same rows in the pool pages a shuffled `table` names."""
    order = (table.long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS, device=table.device)).flatten()
    codes = torch.empty_like(side.codes)
    codes[order] = side.codes
    scale = None
    if side.scale is not None:
        scale = torch.empty_like(side.scale)
        scale[order] = side.scale
    return Paged(QuantRows(side.kind, codes, scale), table)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("span", [attention_module.VALUES_SPAN, 256])
@pytest.mark.parametrize("heads,kv_heads,dim", [(24, 4, 256), (32, 8, 128)])
@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "fp8"])
@pytest.mark.parametrize("paged", [False, True])
def test_a_long_chunk_attends_over_the_values_of_its_cache(monkeypatch, span, heads, kv_heads, dim, kind, paged):
    """Over one span and over several (a span of 256 rows: four committed spans, the last one
    short, then the chunk's own), merged by their log-sum-exp."""
    monkeypatch.setattr(attention_module, "VALUES_SPAN", span)
    torch.manual_seed(0)
    t, length = 300, 900
    capacity = 10 * PAGE_ROWS
    k, v = quantized_cache(kind, capacity, kv_heads, dim), quantized_cache(kind, capacity, kv_heads, dim)
    k_side, v_side = k, v
    if paged:
        table = torch.randperm(capacity // PAGE_ROWS, device="cuda").to(torch.int32)
        k_side, v_side = paged_copy(k, table), paged_copy(v, table)
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    got = values_prefill(q, k_side, v_side, lengths, scale)
    assert got is not None and got.shape == (t, heads * dim) and got.dtype == q.dtype
    assert torch.equal(cache_attention(q, k_side, v_side, lengths, scale, causal=True), got)
    want = reference_attention(q.float(), k, v, length, scale, None, True, None)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    kernel = attention(q, k_side, v_side, lengths, scale, MODE_CAUSAL, None, None)  # its own path, in registers
    assert ((got.float() - kernel.float()).norm() / kernel.float().norm()).item() < 1e-2


@pytest.mark.gpu
@cuda
def test_plain_caches_and_the_deterministic_mode_keep_the_kernel():
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16)
    length = torch.tensor([100], dtype=torch.int32, device="cuda")
    plain = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert values_prefill(q, plain, plain, length, 0.125) is None
    cache = quantized_cache("q4_0", 400, 2, 64)
    assert values_prefill(q, cache, cache, length, 0.125) is not None
    kernels.set_deterministic(True)
    try:
        assert values_prefill(q, cache, cache, length, 0.125) is None
    finally:
        kernels.set_deterministic(False)


@pytest.mark.gpu
@cuda
def test_the_values_path_allocates_what_the_plan_reserves():
    heads, kv_heads, dim, t, length = 24, 4, 256, 2048, 40000
    k, v = quantized_cache("q4_0", length + t, kv_heads, dim), quantized_cache("q4_0", length + t, kv_heads, dim)
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
    assert values_prefill(q, k, v, lengths, dim ** -0.5) is not None  # warm: Triton's compile, flash's workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = values_prefill(q, k, v, lengths, dim ** -0.5)
    torch.cuda.synchronize()
    span = max(attention_module.VALUES_SPAN, t)
    reserved = 2 * span * kv_heads * dim * 2 + t * heads * dim * (4 + 2 * 2)  # Layout.prefill_values_bytes
    returned = out.numel() * out.element_size()  # the forward's own activation, counted apart
    log_sum_exp = 3 * heads * t * 4
    assert torch.cuda.max_memory_allocated() - before <= reserved + returned + log_sum_exp
