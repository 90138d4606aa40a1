"""The GEMM's inline-PTX dequantization (kernels/triton_quant.py `nibble_pairs`, asm=True), checked
without a GPU: its instructions, run here by a small emulator of the three it uses, give exactly
nibble_value's 1 + h/16 in bfloat16 and float16 for every byte; and Triton compiles the GEMM with
it for sm_90 (ptxas included), so a kernel that Triton refuses fails here, not first on the
device (a refactor of this code once did)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from flashtree.kernels.triton_quant import MAGIC_KINDS, NIBBLE_PAIRS_PTX, SCALE_PTX  # noqa: E402

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 in its default mode: output byte i is byte (selector >> 4i) & 7 of b:a."""
    pool = (b << 32) | a
    return sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def run_ptx(ptx: str, word: int) -> list[int]:
    """Execute the block on one input register ($4) and return $0-$3."""
    regs: dict[str, int] = {"$4": word}
    value = lambda tok: regs[tok] if tok in regs else int(tok, 0)  # noqa: E731
    for line in ptx.splitlines():
        m = re.match(r"(\S+)\s+(.*);$", line.strip())
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op == "prmt.b32":
            regs[args[0]] = _prmt(value(args[1]), value(args[2]), value(args[3]))
        elif op == "shl.b32":
            regs[args[0]] = (value(args[1]) << value(args[2])) & MASK32
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "lop3.b32":
            a, b, c, lut = (value(x) for x in args[1:])
            regs[args[0]] = sum(((lut >> (((a >> i & 1) << 2) | ((b >> i & 1) << 1) | (c >> i & 1))) & 1) << i
                                for i in range(32))
        else:
            raise AssertionError(f"an instruction the emulator does not know: {line!r}")
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_ptx_gives_one_plus_each_nibble_over_16_for_every_byte(dtype):
    ptx = NIBBLE_PAIRS_PTX[MAGIC_KINDS[dtype]]
    words = torch.arange(256, dtype=torch.uint8).view(64, 4)  # every byte value, in its column value % 4
    for row in words.tolist():
        out = run_ptx(ptx, int.from_bytes(bytes(row), "little"))
        # pack=4: the low values of bytes 0-3 are $0's and $1's halves, the high ones $2's and $3's
        halves = [(r >> (16 * i)) & 0xFFFF for r in out for i in (0, 1)]
        for shift, got in ((0, halves[:4]), (4, halves[4:])):
            want = (1 + ((torch.tensor(row) >> shift) & 15).float() / 16).to(dtype).view(torch.int16)
            assert got == [v & 0xFFFF for v in want.tolist()], (dtype, row, shift)


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


def test_the_gemm_with_inline_ptx_compiles_for_sm90():
    from flashtree.kernels.triton_quant import _gemm_kernel

    quant_sass = _quant_sass()
    for (dtype, ptr), bits in itertools.product(((torch.bfloat16, "*bf16"), (torch.float16, "*fp16")), (4, 8)):
        kind = MAGIC_KINDS[dtype]
        constants = dict(BITS=bits, GROUP=128, BLOCK_M=16, BLOCK_N=64, KIND=kind, HAS_BIAS=False, ASM=True,
                         PTX=NIBBLE_PAIRS_PTX[kind], SPTX=SCALE_PTX[kind])
        compiled = quant_sass.compile_for_sm90(_gemm_kernel, [ptr, "*fp32", "*u8", "*fp16", "*fp16", "*fp16", ptr]
                                               + ["i32"] * 8,
                                               constants, num_warps=4, num_stages=4)
        ptx = compiled.asm["ptx"].lower()
        mask = re.search(r"lop3\.b32 \$\d, \$\d, (0x[0-9A-F]+)", NIBBLE_PAIRS_PTX[kind]).group(1)
        assert mask.lower() in ptx and compiled.asm["cubin"]
        # int4 scales its codes into weights by packed fmas; int8 applies its scales per group
        assert ("fma.rn.bf16x2" in ptx or "fma.rn.f16x2" in ptx) == (bits == 4)


@pytest.mark.slow  # 6 s of sm_90 compiles
def test_the_gemv_variants_compile_and_the_sass_count_finds_their_main_loop():
    """The GEMV with and without its pipelined loop and its one-lop3 conversion compiles for
    sm_90, and benchmarks/quant_sass.py's loop finder picks a loop that holds at least one FFMA
    and one LOP3 per code a thread handles (fewer would mean it counted some other span)."""
    quant_sass = _quant_sass()
    for bits in (4, 8):
        rows = {(stages, asm): quant_sass.count(bits, block_n=16, block_words=128, num_warps=2, stages=stages, asm=asm)
                for stages in (1, 3) for asm in (False, True)}
        for row in rows.values():
            codes = row["codes_per_thread_per_loop"]
            assert codes == 16 * 128 * (32 // bits) // 64
            assert row["opcodes"]["FFMA"] >= codes and row["opcodes"]["LOP3"] >= codes, row["opcodes"]
            assert 3 <= row["instructions_per_code"] < 20
