"""The GEMM's inline-PTX dequantization of int4 (kernels/triton_int4.py, asm=True), checked
without a GPU by a small emulator of the instructions it uses: `quad_values` gives magic + h for
each nibble of two 16-bit words, and `scaled_codes`' two packed fmas turn that into (h - 8) *
scale + (minimum + 8 * scale), rounded once. And Triton compiles the GEMM for sm_90 (ptxas
included), int4 with that PTX and int8 without any, so a kernel that Triton refuses fails here,
not first on the device (a refactor of this code once did)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from flashtree.kernels.triton_int4 import MAGIC_KINDS, QUAD_PTX, SCALE_PTX  # noqa: E402


def _fma_x2(a: int, b: int, c: int, dtype: torch.dtype) -> int:
    """fma.rn.{bf16,f16}x2: per 16-bit half a * b + c, exact, then rounded once to dtype (the
    operands here are few-bit values, so their float64 sum is exact)."""
    def halves(r: int) -> torch.Tensor:
        return torch.tensor([r & 0xFFFF, r >> 16], dtype=torch.int32).to(torch.int16).view(dtype).double()
    out = (halves(a) * halves(b) + halves(c)).to(dtype).view(torch.int16).int() & 0xFFFF
    return int(out[0]) | int(out[1]) << 16


def run_ptx(ptx: str, inputs: dict[str, int], outputs: int = 4) -> list[int]:
    """Execute the block on its input registers (e.g. {"$4": word}) and return $0..$(outputs-1)."""
    regs: dict[str, int] = dict(inputs)
    value = lambda tok: regs[tok] if tok in regs else int(tok, 0)  # noqa: E731
    for line in ptx.splitlines():
        m = re.match(r"(\S+)\s+(.*);$", line.strip())
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op == "shr.u32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            dtype = torch.bfloat16 if op == "fma.rn.bf16x2" else torch.float16
            regs[args[0]] = _fma_x2(*(value(x) for x in args[1:]), dtype)
        elif op == "lop3.b32":
            a, b, c, lut = (value(x) for x in args[1:])
            regs[args[0]] = sum(((lut >> (((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1))) & 1) << i
                                for i in range(32))
        else:
            raise AssertionError(f"an instruction the emulator does not know: {line!r}")
    return [regs[f"${i}"] for i in range(outputs)]


def _bits16(values: torch.Tensor, dtype: torch.dtype) -> list[int]:
    return (values.to(dtype).view(torch.int16).int() & 0xFFFF).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_words_become_weights_h_times_scale_plus_minimum(dtype):
    """quad_values on two 16-bit words (pack=2: the first in the low half of $4): output r holds
    magic + nibble r of each word, the word's own in its own half; then scaled_codes' fmas give
    (h - 8) * scale + (minimum + 8 * scale) in one rounding, which is h * scale + minimum for
    scales and minima that dtype holds exactly."""
    kind = MAGIC_KINDS[dtype]
    magic = 128 if dtype == torch.bfloat16 else 1024
    scale, minimum = 0.375, -3.0  # exact in both dtypes, as is every h * scale + minimum here
    s2, c2 = (_bits16(torch.tensor([v, v], dtype=torch.float64), dtype) for v in (scale, minimum + 8 * scale))
    operands = {"$2": s2[0] | s2[1] << 16, "$3": c2[0] | c2[1] << 16}
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 16, (300, 2), generator=gen).tolist() + [[0, 0xFFFF], [0x8421, 0x1248]]
    for lo, hi in words:
        out = run_ptx(QUAD_PTX[kind], {"$4": lo | hi << 16})
        for r, reg in enumerate(out):
            h = torch.tensor([(lo >> 4 * r) & 15, (hi >> 4 * r) & 15])
            assert [reg & 0xFFFF, reg >> 16] == _bits16(magic + h.double(), dtype), (dtype, lo, hi, r)
            got = run_ptx(SCALE_PTX[kind], {"$1": reg, **operands}, 1)[0]
            assert [got & 0xFFFF, got >> 16] == _bits16(h.double() * scale + minimum, dtype), (dtype, lo, hi, r)


def _needs_nvidia_backend() -> None:
    import triton

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")


def _quant_sass():
    """benchmarks/quant_sass.py (not a package): its sm_90 compile and SASS count."""
    import importlib.util
    from pathlib import Path

    _needs_nvidia_backend()
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_sass.py"
    spec = importlib.util.spec_from_file_location("quant_sass", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernels_state_their_fp_fusion_so_a_compile_neither_warns_nor_changes_it():
    """Every Triton compile asks for the FP-fusion default, which warns when the environment does
    not set it (3.10 turns fusion off); flashtree.kernels keeps the fusion its kernels were checked
    with, in a process whose environment does not say."""
    code = ("import warnings, triton, flashtree.kernels; warnings.simplefilter('error'); "
            "print(triton.knobs.language.fp_fusion_enabled(None))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_the_gemm_with_inline_ptx_compiles_for_sm90():
    from flashtree.kernels.triton_quant import _gemm_kernel, gemm_constants

    quant_sass = _quant_sass()
    for (dtype, ptr), bits in itertools.product(((torch.bfloat16, "*bf16"), (torch.float16, "*fp16")), (4, 8)):
        constants = gemm_constants(bits, 128, 16, 64, MAGIC_KINDS[dtype], False, True)
        compiled = quant_sass.compile_for_sm90(_gemm_kernel, quant_sass.gemm_types(bits, ptr), constants,
                                               num_warps=4, num_stages=4)
        ptx = compiled.asm["ptx"].lower()
        assert compiled.asm["cubin"] and (constants["PTX"] != "") == (bits == 4)
        if bits == 4:
            mask = re.search(r"lop3\.b32 \$\d, \S+, (0x[0-9A-F]+)", constants["PTX"]).group(1)
            assert mask.lower() in ptx
        # int4 scales its codes into weights by packed fmas; int8 applies its scales per group
        assert ("fma.rn.bf16x2" in ptx or "fma.rn.f16x2" in ptx) == (bits == 4)


def test_the_gemm_that_prefetches_its_successor_compiles_for_sm90():
    """The GEMM's epilogue that sends the next linear's weights to L2 assembles for sm_90 (the
    bulk prefetch is sm_90 PTX, so only a compile checks it here) and issues one predicated bulk
    prefetch a lane."""
    from flashtree.kernels.triton_quant import _gemm_kernel, gemm_constants

    quant_sass = _quant_sass()
    constants = gemm_constants(4, 128, 16, 64, MAGIC_KINDS[torch.bfloat16], False, True) | dict(PREFETCH=64)
    compiled = quant_sass.compile_for_sm90(_gemm_kernel, quant_sass.gemm_types(4), constants, num_warps=2,
                                           num_stages=3)
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and ptx.count("cp.async.bulk.prefetch.L2.global") == 1
    plain = quant_sass.compile_for_sm90(_gemm_kernel, quant_sass.gemm_types(4),
                                        gemm_constants(4, 128, 16, 64, MAGIC_KINDS[torch.bfloat16], False, True),
                                        num_warps=2, num_stages=3)
    assert "cp.async.bulk.prefetch" not in plain.asm["ptx"]


def test_the_table_layout_gemm_compiles_for_sm90():
    """The IQ4 table layout's GEMM (a lookup of each code, no inline PTX), bf16, tiled, as the
    engine launches it over IQ4_XS's two levels (int8 sub-scales, float16 super-scales, in the
    file's super-blocks of 8 groups and in a column order's narrower ones) and IQ4_NL's float16
    scales: it compiles for sm_90 without a GPU."""
    from flashtree.kernels.triton_quant import _gemm_kernel, gemm_constants

    quant_sass = _quant_sass()
    layouts = [("*i8", "*fp16", 8), ("*i8", "*fp16", 2), ("*fp16", None, 0)]  # scale, super-scale, groups each
    for (block_m, block_n), (scale, second, super_groups) in itertools.product(((16, 64), (32, 128)), layouts):
        constants = gemm_constants(4, 32, block_m, block_n, MAGIC_KINDS[torch.bfloat16], False, False,
                                   tiled=True, table=True, super_groups=super_groups)  # one row's launch, a tree's
        compiled = quant_sass.compile_for_sm90(_gemm_kernel, quant_sass.gemm_types(4, scale=scale, second=second),
                                               constants, num_warps=4, num_stages=3)
        assert compiled.asm["cubin"] and "fma.rn.bf16x2" not in compiled.asm["ptx"].lower()


@pytest.mark.slow  # 10 s of sm_90 compiles
def test_small_int8_groups_scale_their_codes_for_fewer_instructions():
    """The routing rule INT8_SCALED_BELOW rests on: compiled for sm_90 at a tree's 23 rows, int8
    in groups of 16 and 32 (GGUF's Q6_K, Q8_0) costs fewer SASS instructions a code with its
    codes scaled into weights (several groups a step) than with the per-group epilogue, and in
    groups of 128 the epilogue stays, with its sums of x."""
    from flashtree.kernels.triton_quant import INT8_SCALED_BELOW, gemm_constants, int8_step

    quant_sass = _quant_sass()
    per_code = {(group, scaled): quant_sass.count_gemm(8, 23, group=group, scaled=scaled)["instructions_per_code"]
                for group in (16, 32) for scaled in (True, False)}
    assert per_code[16, True] < per_code[16, False] / 2 and per_code[32, True] < per_code[32, False]
    assert int8_step(16, 5120) == int8_step(32, 5120) == 128 and int8_step(32, 320) == 64
    assert int8_step(16, 5120, scaled=False) == 16 and int8_step(128, 5120) == 128
    assert gemm_constants(8, 16, 32, 64, 1, False, True, k=5120)["SCALE8"] and INT8_SCALED_BELOW == 128
    assert not gemm_constants(8, 128, 32, 64, 1, False, True, k=5120)["SCALE8"]


@pytest.mark.slow  # 8 s of sm_90 compiles
def test_int4_in_groups_of_32_loads_a_runs_scales_through_the_pipeline():
    """Tiled int4 in groups under a run (GGUF's Q4_K, what the 24 GB card's linears load as)
    keeps a run's scales and minima contiguous a row (reference.int4_scale_unit), so that the
    GEMM's main loop, compiled for sm_90 at one row and at 23, stages them with cp.async: no
    synchronous LDG and no more barriers than in groups of 128. Read one group at a time (2
    bytes a row) they were 8 LDG and 17 barriers a run; with the run's tile a 27B's linears at
    23 rows take about as long in groups of 32 as in 128 (`python benchmarks/quant_gemv.py
    --tiled --group 32`, and `--group 128`, time them)."""
    quant_sass = _quant_sass()
    for rows in (1, 23):
        ops = {group: quant_sass.count_gemm(4, rows, tiled=True, group=group)["opcodes"] for group in (32, 128)}
        assert ops[32].get("LDG", 0) == 0 and ops[32]["LDGSTS"] >= ops[128]["LDGSTS"], (rows, ops[32])
        assert ops[32].get("BAR", 0) <= ops[128].get("BAR", 0) and ops[32].get("STS", 0) == 0, (rows, ops[32])


@pytest.mark.slow  # 6 s of sm_90 compiles
def test_the_gemv_variants_compile_and_the_sass_count_finds_their_main_loop():
    """The GEMV with and without its pipelined loop and its one-lop3 conversion compiles for
    sm_90, and benchmarks/quant_sass.py's loop finder picks a loop that holds at least one FFMA
    and one LOP3 per code a thread handles (fewer would mean it counted some other span)."""
    quant_sass = _quant_sass()
    rows = {(stages, asm): quant_sass.count(block_n=16, block_words=128, num_warps=2, stages=stages, asm=asm)
            for stages in (1, 3) for asm in (False, True)}
    for row in rows.values():
        codes = row["codes_per_thread_per_loop"]
        assert codes == 16 * 128 * 4 // 64
        assert row["opcodes"]["FFMA"] >= codes and row["opcodes"]["LOP3"] >= codes, row["opcodes"]
        assert 3 <= row["instructions_per_code"] < 20
