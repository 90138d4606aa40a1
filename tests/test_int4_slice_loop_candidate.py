"""benchmarks/int4_slice_loop.py's candidate GEMM (one slice of a run an iteration): run by
Triton's CPU interpreter against the float32 definition, and compiled for sm_90 with its PTX, where
the loop must keep the previous slice's wgmma in flight (a wait of 1), the property its timings
are meant to show. Interpreted in a child process: the interpreter is chosen when `triton.jit`
decorates a kernel, at import time. Its one-nibble PTX runs on test_quant_ptx's emulator."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, "benchmarks")
    from int4_slice_loop import rel_err, slice_loop_gemm
    from flashtree.kernels.reference import dequantize, tile_int4
    from flashtree.models.quant import pack_codes

    torch.manual_seed(0)
    out = {}
    # ragged row tiles (130 and 200 rows of W), one row and a tree's, K of 3 to 5 runs whole or
    # split over 2 or 3 programs (the last of 3 over 4 runs empty)
    for n, k, rows, split in ((130, 384, 1, 2), (64, 640, 23, 1), (200, 512, 17, 3), (96, 384, 64, 3)):
        codes = pack_codes(torch.randint(0, 16, (n, k), dtype=torch.uint8), 4)
        scale = (torch.rand(n, k // 128) * 1e-2 + 1e-3).half()
        minimum = (-torch.rand(n, k // 128) * 1e-1).half()
        x = torch.randn(rows, k)
        got = slice_loop_gemm(x, *tile_int4(codes, scale, minimum), asm=False, split=split)
        want = x @ dequantize(codes, scale, minimum, 4, 128, torch.float32).T
        out[f"{n}x{k} rows {rows} split {split}"] = rel_err(got, want)
    print(json.dumps(out))
""")


def test_the_slice_loop_candidate_computes_the_definition() -> None:
    found = run_interpreted(SCRIPT, threads=1)
    assert len(found) == 4
    for name, err in found.items():
        assert err < 1e-5, (name, err)  # float32 throughout: rounding only


@pytest.mark.parametrize("kind,magic", [(1, 0x4300), (2, 0x6400)])
def test_the_one_nibble_ptx_gives_magic_plus_the_nibble_of_each_word(kind: int, magic: int) -> None:
    """Two 16-bit words in $1 (pack=2: the first in the low half) and 4r in each half of $2: each
    half of $0 is the kind's magic exponent plus nibble r of its own word (triton_int4.quad_values'
    output r for one r chosen at run time)."""
    from int4_slice_loop import NIBBLE_PTX
    from test_quant_ptx import run_ptx

    gen = torch.Generator().manual_seed(0)
    for lo, hi in torch.randint(0, 1 << 16, (200, 2), generator=gen).tolist() + [[0xFFFF, 0], [0x8421, 0x1248]]:
        for r in range(4):
            [got] = run_ptx(NIBBLE_PTX[kind], {"$1": lo | hi << 16, "$2": 4 * r | 4 * r << 16}, outputs=1)
            assert got == (magic | (lo >> 4 * r) & 15) | (magic | (hi >> 4 * r) & 15) << 16, (lo, hi, r)


@pytest.mark.slow  # sm_90 compiles
@pytest.mark.parametrize("rows", [23, 64])
def test_the_candidate_keeps_one_wgmma_in_flight_when_compiled_for_sm90(rows: int) -> None:
    import triton
    from int4_slice_loop import NIBBLE_PTX, _slice_loop_kernel
    from quant_sass import compile_for_sm90

    from flashtree.kernels.triton_int4 import MAGIC_KINDS, SCALE_PTX
    from flashtree.kernels.triton_quant import gemm_launch

    kind = MAGIC_KINDS[torch.bfloat16]
    launch = gemm_launch(4, rows)
    constants = dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=launch["block_n"], RUN=128, ASM=True,
                     PTX=NIBBLE_PTX[kind], SPTX=SCALE_PTX[kind])
    types = ["*bf16", "*i16", "*fp16", "*fp16", "*bf16", "*fp32", "*i32"] + ["i32"] * 8
    ptx = compile_for_sm90(_slice_loop_kernel, types, constants, divisible=True, num_warps=launch["num_warps"],
                           num_stages=launch["num_stages"]).asm["ptx"]
    waits = [int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)]
    assert 1 in waits, waits  # inside the loop: the previous slice's wgmma still in flight
    assert "lop3.b32" in ptx and "fma.rn.bf16x2" in ptx  # the PTX dequantization is compiled in
