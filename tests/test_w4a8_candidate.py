"""benchmarks/w4a8_gemm.py's candidate kernels (int8 x on integer tensor cores, docs/PERFORMANCE.md),
run by Triton's CPU interpreter against what they claim to compute: x rounded to int8 per run of
128 columns against the codes times their scales, exact x against the minima. Their timings
(`python benchmarks/w4a8_gemm.py`) rest on this. A child process: the interpreter is
chosen when `triton.jit` decorates a kernel, at import time."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, "benchmarks")
    from w4a8_gemm import definition, rel_err, w4a8
    from flashtree.kernels.reference import tile_int4
    from flashtree.models.quant import pack_codes

    torch.manual_seed(0)
    out = {}
    # ragged row tiles (130 rows), one row and a tree's, groups of a run and below it, K of 2 to
    # 4 runs whole or split over 2 or 3 programs
    for n, k, rows, group, tiled, split in ((96, 512, 1, 128, False, 1), (130, 384, 5, 32, True, 2),
                                            (64, 256, 23, 64, True, 1), (200, 512, 17, 128, True, 3)):
        codes = pack_codes(torch.randint(0, 16, (n, k), dtype=torch.uint8), 4)
        scale = (torch.rand(n, k // group) * 1e-2 + 1e-3).half()
        minimum = (-torch.rand(n, k // group) * 1e-1).half()
        x = torch.randn(rows, k)
        w = tile_int4(codes, scale, minimum) if tiled else (codes, scale, minimum)
        got = w4a8(x, *w, group, tiled=tiled, asm=False, split=split)
        out[f"{n}x{k} rows {rows} group {group} split {split}"] = [
            rel_err(got, definition(x, codes, scale, minimum, group, True)),
            rel_err(got, definition(x, codes, scale, minimum, group, False))]
    print(json.dumps(out))
""")


def test_the_w4a8_candidate_computes_its_definition() -> None:
    found = run_interpreted(SCRIPT, threads=1)
    assert len(found) == 4
    for name, (own, exact) in found.items():
        assert own < 1e-5, (name, own)  # exact integer dots: float32 rounding only
        assert 1e-3 < exact < 3e-2, (name, exact)  # x's rounding to int8 shows against exact x
