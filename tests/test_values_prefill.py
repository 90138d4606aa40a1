"""A long causal prefill chunk over a quantized KV cache attends over the cache's values,
dequantized once (kernels/attention.py: values_prefill): the copy holds the values the attention
kernels read, bit for bit, through a page table too; the chunk's output is the attention of
those values; the path stays out of the deterministic mode and away from plain caches; and it
allocates no more than the memory plan reserves for it."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from interpreted import run_interpreted  # noqa: E402

from flashtree import kernels  # noqa: E402
from flashtree.kernels.attention import cache_attention, reference_attention, values_prefill  # noqa: E402
from flashtree.kernels.kv_storage import PAGE_ROWS, Paged, QuantRows, quantize_kv, scale_dtype  # noqa: E402

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
        end = 4 * PAGE_ROWS + 3  # not a whole block of the kernel's rows
        for label, side in (("rows", rows), ("paged", paged)):
            (c, s, k), _, pages = paged_side_args(side, side)
            got = cache_values(c, s, k, pages, end, 64, torch.float32)
            want = kv_rows(rows, end, torch.float32)
            out[f"{kind} {label}"] = [list(got.shape), int((got != want).sum()), bool(got.isnan().any())]
    print(json.dumps(out))
""")


def test_the_values_copy_reads_the_rows_the_table_names_bit_for_bit():
    found = run_interpreted(PAGED_SCRIPT)
    assert found == {f"{kind} {label}": [[4 * PAGE_ROWS + 3, 2, 64], 0, False]
                     for kind in ("q4_0", "q8_0", "fp8") for label in ("rows", "paged")}


def quantized_cache(kind: str, rows: int, kv_heads: int, dim: int, device: str) -> QuantRows:
    x = torch.randn(rows, kv_heads, dim, device=device, dtype=torch.bfloat16)
    return QuantRows(kind, *quantize_kv(x, kind, scale_dtype(kind, torch.bfloat16)))


def test_plain_caches_and_the_deterministic_mode_keep_the_kernel():
    q = torch.randn(300, 4, 64, dtype=torch.bfloat16)
    length = torch.tensor([100], dtype=torch.int32)
    plain = torch.randn(400, 2, 64, dtype=torch.bfloat16)
    assert values_prefill(q, plain, plain, length, 0.125) is None
    cache = quantized_cache("q4_0", 400, 2, 64, "cpu")
    kernels.set_deterministic(True)
    try:
        assert values_prefill(q, cache, cache, length, 0.125) is None
    finally:
        kernels.set_deterministic(False)



@pytest.mark.parametrize("heads,kv_heads,dim", [(24, 4, 256), (32, 8, 128)])
@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "fp8"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_chunk_attends_over_the_values_of_its_cache(heads, kv_heads, dim, kind, paged):
    torch.manual_seed(0)
    t, length = 300, 900
    capacity = 10 * PAGE_ROWS
    assert capacity >= length + t
    if kind == "fp8":
        x = torch.randn(capacity, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        k = v = QuantRows("fp8", x.to(torch.float8_e4m3fn).view(torch.uint8), None)
    else:
        k = quantized_cache(kind, capacity, kv_heads, dim, "cuda")
        v = quantized_cache(kind, capacity, kv_heads, dim, "cuda")
    if paged:  # the same rows, in a shuffled table's pages
        table = torch.randperm(capacity // PAGE_ROWS, device="cuda").to(torch.int32)
        order = (table.long()[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS, device="cuda")).flatten()

        def pool(side):
            codes = torch.empty_like(side.codes)
            codes[order] = side.codes
            scale = None
            if side.scale is not None:
                scale = torch.empty_like(side.scale)
                scale[order] = side.scale
            return QuantRows(side.kind, codes, scale)

        k_side, v_side = Paged(pool(k), table), Paged(pool(v), table)
    else:
        k_side, v_side = k, v
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    got = values_prefill(q, k_side, v_side, lengths, scale)
    assert got is not None
    assert torch.equal(cache_attention(q, k_side, v_side, lengths, scale, causal=True), got)
    want = reference_attention(q.float(), k, v, length, scale, None, True, None)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    # the kernel's own path over the same cache agrees as closely
    from flashtree.kernels.triton_attention import MODE_CAUSAL, attention

    kernel = attention(q, k_side, v_side, lengths, scale, MODE_CAUSAL, None, None)
    assert ((got.float() - kernel.float()).norm() / kernel.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_values_path_allocates_what_the_plan_reserves_and_runs_flash():
    from flashtree.kernels.attention import flash_runs

    heads, kv_heads, dim, t, length = 24, 4, 256, 2048, 30000
    k = quantized_cache("q4_0", length + t, kv_heads, dim, "cuda")
    v = quantized_cache("q4_0", length + t, kv_heads, dim, "cuda")
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
    values = torch.empty(1, kv_heads, length + t, dim, device="cuda", dtype=torch.bfloat16)
    assert flash_runs(q.transpose(0, 1)[None], values, values), "torch's flash attention takes 256-wide heads"
    del values
    values_prefill(q, k, v, lengths, dim ** -0.5)  # warm: Triton's compile, cuBLAS/flash workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = values_prefill(q, k, v, lengths, dim ** -0.5)
    torch.cuda.synchronize()
    reserved = 2 * (length + t) * kv_heads * dim * 2  # Layout.prefill_values_bytes at these rows
    chunk_outputs = 3 * out.numel() * out.element_size()  # flash's output, its log-sum-exp, the reshape
    assert torch.cuda.max_memory_allocated() - before <= reserved + chunk_outputs
