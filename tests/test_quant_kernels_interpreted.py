"""The quantized GEMV/GEMM Triton kernels (kernels/triton_gemv.py, triton_quant.py) and prefill's
dequantization (triton_dequant.py), run by Triton's CPU interpreter
on float32 tensors through QuantizedLinear's own forward, against the definition (dequantize, then
matmul): their nibble order, group bookkeeping, split-K partials and masking of ragged row and
group tiles; and the GEMV's bit trick that turns codes of int32 words into floats, exactly, at
every position. The GEMM's inline-PTX dequantization of int4 (asm=True) runs only on CUDA
(benchmarks/quant_gemv.py and tests/test_gpu_quant.py); its instructions are emulated, and the
kernel compiled for sm_90, in tests/test_quant_ptx.py.

A child process, as in tests/test_kernels_interpreted.py: the interpreter is chosen when
`triton.jit` decorates a kernel, at import time."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

SCRIPT = textwrap.dedent("""
    import json
    import torch
    import triton
    import triton.language as tl
    from flashtree.kernels.quant import kernel_applies
    from flashtree.kernels.reference import dequantize, quant_linear
    from flashtree.kernels import triton_dequant
    from flashtree.kernels.triton_gemv import code_value, gemv
    from flashtree.kernels.triton_quant import gemm
    from flashtree.models.quant import QuantizedLinear

    @triton.jit
    def words(C, OUT):
        i = tl.arange(0, 64)
        w = tl.load(C + i)
        for j in tl.static_range(4):
            tl.store(OUT + j * 64 + i, code_value(w, w >> 16, j))

    out = {}
    raw = torch.randint(0, 256, (64, 4), dtype=torch.uint8)
    got = torch.empty(4, 64)  # the GEMV's int8 codes of int32 words (little-endian), exact
    words[(1,)](raw.view(torch.int32).flatten(), got)
    out["words"] = torch.equal(got.t(), raw.float())
    # split-K (20 groups of 32 in blocks of 2 over 8 splits of 2 leave the last three empty; 5
    # int4 runs of 128 over 3 splits, and in groups of a run over 2 and 5 at one row), x read in
    # place, the pipelined loop, called directly
    int8 = QuantizedLinear.from_float(torch.randn(24, 640), 8, 32, torch.randn(24))
    int4 = QuantizedLinear.from_float(torch.randn(24, 640), 4, 32, torch.randn(24))
    int4_g128 = QuantizedLinear.from_float(torch.randn(24, 640), 4, 128, torch.randn(24))
    int8_g16 = QuantizedLinear.from_float(torch.randn(24, 640), 8, 16, torch.randn(24))
    int8_g128 = QuantizedLinear.from_float(torch.randn(24, 640), 8, 128, torch.randn(24))
    for name, (fn, rows, layer, kw) in {
            "gemv": (gemv, 1, int8, dict(block_n=16)),
            "gemv split, ragged rows, empty splits": (gemv, 1, int8, dict(block_n=16, split=8, block_words=8)),
            "gemv x as is": (gemv, 1, int8, dict(regroup=False)),
            "gemv without pipelining": (gemv, 1, int8, dict(split=2, block_n=8, num_stages=1)),
            "gemm split": (gemm, 23, int4, dict(split=3, block_n=16)),
            "gemm one row, split": (gemm, 1, int4, dict(split=3, block_n=16, num_warps=1)),
            "gemm one row, groups of a run, split 3 + 2": (gemm, 1, int4_g128, dict(split=2, block_n=16)),
            "gemm one row, groups of a run, split 1 + 1 + 1 + 1 + 1": (gemm, 1, int4_g128, dict(split=5)),
            # int8 in groups of 16 scales its codes, 128 a step: 5 steps over 3 splits, ragged rows
            "gemm int8 scaled, split": (gemm, 23, int8_g16, dict(split=3, block_n=16)),
            "gemm int8 scaled, one row": (gemm, 1, int8_g16, dict(split=2)),
            "gemm int8 groups of 16, epilogue": (gemm, 7, int8_g16, dict(scale_codes=False)),
            "gemm int8 groups of 128, scaled": (gemm, 7, int8_g128, dict(scale_codes=True))}.items():
        x = torch.randn(rows, 640)
        got = fn(x, layer.codes, layer.scale, layer.minimum, layer.bias, layer.bits, layer.group, **kw)
        want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, layer.bits, layer.group)
        out[name] = [True, ((got - want).norm() / want.norm()).item()]
    # prefill's dequantization, exact: ragged row tiles, and K = 320 in tiles of 64
    for bits, group, k in ((4, 32, 1280), (8, 128, 1280), (4, 64, 384), (4, 16, 256), (4, 128, 384)):
        layer = QuantizedLinear.from_float(torch.randn(20, k), bits, group, None)
        got = triton_dequant.dequantize_into(torch.empty(20, k), layer.codes, layer.scale, layer.minimum,
                                             bits, group)
        want = dequantize(layer.codes, layer.scale, layer.minimum, bits, group, torch.float32)
        out[f"dequantize int{bits} group {group}"] = [True, 0.0 if torch.equal(got, want) else 1.0]
    layer = QuantizedLinear.from_float(torch.randn(40, 1024), 8, 128, None)
    x = torch.randn(1, 1024)
    got = gemv(x, layer.codes, layer.scale, layer.minimum, None, 8, 128, block_n=16)
    want = quant_linear(x, layer.codes, layer.scale, layer.minimum, None, 8, 128)
    out["gemv int8"] = [True, ((got - want).norm() / want.norm()).item()]
    torch.manual_seed(0)
    # K = 320 is 2.5 GEMV tiles of 128 and 10 groups of 32; int4's K whole runs of 128, its
    # groups below one run loaded per slice of 32; N = 40 leaves ragged row tiles
    for bits, shapes in ((8, ((32, 320), (64, 256), (128, 256), (16, 128))), (4, ((32, 384), (64, 256), (128, 256)))):
        for group, k in shapes:
            for rows in (1, 7, 23):
                bias = torch.randn(40) if rows != 7 else None
                layer = QuantizedLinear.from_float(torch.randn(40, k), bits, group, bias)
                x = torch.randn(rows, 2 * k)[:, ::2]  # a column stride: the launcher makes it contiguous
                got = layer(x)
                want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, bits, group)
                name = f"int{bits} group {group} k {k} rows {rows}"
                out[name] = [kernel_applies(x, rows, bits, group), ((got - want).norm() / want.norm()).item()]
    # int4 tiled in blocks of 64 rows (reference.tile_rows): one ragged block (40 rows), two whole
    # and a ragged one (130); the GEMM through the layer's forward, prefill's dequantization
    # exact, whole or in slices of tiles, and the draft's row slices of a tiled layer
    import copy
    from flashtree.models.quant import linear_rows
    for group, k in ((32, 384), (64, 256), (128, 256)):
        for n in (40, 130):
            layer = QuantizedLinear.from_float(torch.randn(n, k), 4, group, torch.randn(n))
            tiled = copy.deepcopy(layer).tile_()
            for rows in (1, 23):
                x = torch.randn(rows, k)
                want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, 4, group)
                out[f"tiled group {group} n {n} rows {rows}"] = [kernel_applies(x, rows, 4, group),
                                                                 ((tiled(x) - want).norm() / want.norm()).item()]
            got = triton_dequant.dequantize_into(torch.empty(n, k), tiled.codes, tiled.scale, tiled.minimum, 4, group,
                                                 tiled=True)
            out[f"tiled dequantize group {group} n {n}"] = [True, 0.0 if torch.equal(got, layer.dequantized()) else 1.0]
    x = torch.randn(70, 256)
    want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, 4, 128)
    scratch = triton_dequant.dequant_scratch_bytes
    triton_dequant.dequant_scratch_bytes = lambda: 100 * 256 * 4  # 100 rows a slice: 64 when tiled
    got = triton_dequant.dequantized_linear(x, tiled.codes, tiled.scale, tiled.minimum, tiled.bias, 4, 128, True)
    triton_dequant.dequant_scratch_bytes = scratch
    out["tiled prefill in slices of tiles"] = [True, ((got - want).norm() / want.norm()).item()]
    for rows in (slice(64, 130), slice(0, 64), slice(32, 100)):  # whole tiles, and not
        want = quant_linear(x[:3], layer.codes[rows], layer.scale[rows], layer.minimum[rows], layer.bias[rows], 4, 128)
        got = linear_rows(tiled, x[:3], rows)
        out[f"tiled rows {rows.start}:{rows.stop}"] = [True, ((got - want).norm() / want.norm()).item()]
    # several sequences' trees (65 to SLICED_MAX_ROWS rows): the GEMM in launches of GEMM_MAX_ROWS
    x = torch.randn(100, 256)
    got = tiled(x)
    want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, 4, 128)
    out["tiled 100 rows in launches of 64"] = [torch.equal(got, torch.cat([tiled(x[:64]), tiled(x[64:])])),
                                               ((got - want).norm() / want.norm()).item()]
    # every split launch above left its tiles' counters at zero for the next one
    from flashtree.kernels import triton_split
    out["split-K counters back at zero"] = [True, float(triton_split._LOCKS[x.device].abs().sum())]
    print(json.dumps(out))
""")


@pytest.mark.slow  # every quantized kernel at real tile shapes under the interpreter
def test_quantized_kernels_match_the_definition_in_float32() -> None:
    found = run_interpreted(SCRIPT, threads=1)
    assert found.pop("words")
    assert len(found) == 38 + 12 + 6 + 1 + 5 + 1
    not_kernel = [name for name, (ran, _) in found.items() if not ran]
    assert not not_kernel, not_kernel
    bad = {name: err for name, (_, err) in found.items() if not err < 1e-5}
    assert not bad, bad


TABLE_SCRIPT = textwrap.dedent("""
    import copy
    import json
    import sys
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q
    from flashtree.checkpoint.gguf_codes import decompose
    from flashtree.kernels import triton_dequant
    from flashtree.kernels.quant import kernel_applies
    from flashtree.kernels.reference import quant_linear
    from flashtree.kernels.triton_quant import gemm
    from flashtree.models.quant import QuantizedLinear, linear_rows
    sys.path.insert(0, "tests")
    from gguf_convert import random_blocks

    def rel(got, want):
        return ((got - want).norm() / want.norm()).item()

    def table_layer(n, k, lookup, super_groups):
        # as the file stores them (IQ4_NL: a float16 d per group; IQ4_XS: a float16 d per 8 groups
        # over an int8 sub-scale in [-32, 31] a group), gguf's valid random blocks decomposed as
        # the loader does; IQ4_XS's narrower super-blocks (a column order's) made up alike
        bias = torch.randn(n)
        if super_groups in (None, 8):
            c = decompose(lookup, random_blocks(n, k, Q[lookup], np.random.default_rng(n)), (n, k))
            return QuantizedLinear.from_codes(c.codes, c.scale, None, 32, 4, bias, lookup, c.superscale)
        d = ((torch.rand(n, k // 32 // super_groups) + 0.5) / 64).half().float()
        sub = torch.randint(-32, 32, (n, k // 32)).float()
        return QuantizedLinear.from_codes(torch.randint(0, 16, (n, k)), sub, None, 32, 4, bias, lookup, d)

    def want_of(layer, x, rows=slice(None)):
        superscale = None if layer.superscale is None else layer.superscale[rows]
        return quant_linear(x, layer.codes[rows], layer.scale[rows], None, layer.bias[rows], 4, 32, layer.values,
                            superscale)

    torch.manual_seed(0)
    out = {}
    k = 512
    for lookup, super_groups in (("IQ4_XS", 8), ("IQ4_XS", 2), ("IQ4_NL", None)):
        kind = f"{lookup}/{super_groups}"
        for n in (40, 130):  # one ragged tile of 64 rows; two whole and a ragged one
            layer = table_layer(n, k, lookup, super_groups)
            tiled = copy.deepcopy(layer).tile_()
            for rows in (1, 7, 23):
                x = torch.randn(rows, k)
                want = want_of(layer, x)
                for name, lin in (("row major", layer), ("tiled", tiled)):
                    out[f"{kind} {name} n {n} rows {rows}"] = [kernel_applies(x, rows, 4, 32), rel(lin(x), want)]
            got = gemm(x, layer.codes, layer.scale, None, layer.bias, 4, 32, split=3, block_n=16, table=layer.values,
                       superscale=layer.superscale)
            out[f"{kind} split n {n}"] = [True, rel(got, want)]
            for name, lin in (("row major", layer), ("tiled", tiled)):  # prefill's dequantization, exact
                got = triton_dequant.dequantize_into(torch.empty(n, k), lin.codes, lin.scale, None, 4, 32,
                                                     lin.tiled, lin.values, lin.superscale)
                out[f"{kind} dequantize {name} n {n}"] = [True, 0.0 if torch.equal(got, layer.dequantized()) else 1.0]
        x = torch.randn(70, k)
        want = want_of(layer, x)
        scratch = triton_dequant.dequant_scratch_bytes
        triton_dequant.dequant_scratch_bytes = lambda: 100 * k * 4  # 100 rows a slice: 64 when tiled
        got = triton_dequant.dequantized_linear(x, tiled.codes, tiled.scale, None, tiled.bias, 4, 32, True,
                                                tiled.values, tiled.superscale)
        triton_dequant.dequant_scratch_bytes = scratch
        out[f"{kind} prefill in slices of tiles"] = [True, rel(got, want)]
        for rows in (slice(64, 130), slice(32, 100)):  # the draft's row slices: whole tiles, and not
            want = want_of(layer, x[:3], rows)
            out[f"{kind} tiled rows {rows.start}:{rows.stop}"] = [True, rel(linear_rows(tiled, x[:3], rows), want)]
    print(json.dumps(out))
""")


@pytest.mark.slow  # every IQ4 kernel at real tile shapes under the interpreter
def test_the_table_layout_kernels_match_the_definition_in_float32() -> None:
    """The IQ4 table layout (models/quant.py `lookup`): IQ4_NL's one level and IQ4_XS's two in the
    file's super-blocks of 8 groups (from gguf's valid random blocks), and IQ4_XS's in super-blocks
    of 2 (a column order's narrowing: two a run); the GEMM at one row and a tree's, row major and
    tiled, split along K, the draft's row slices, and prefill's dequantization (exact), whole and
    in slices, against the definition."""
    found = run_interpreted(TABLE_SCRIPT, threads=1)
    assert len(found) == 3 * (2 * 6 + 2 * 3 + 3)
    not_kernel = [name for name, (ran, _) in found.items() if not ran]
    assert not not_kernel, not_kernel
    bad = {name: err for name, (_, err) in found.items() if not err < 1e-5}
    assert not bad, bad
