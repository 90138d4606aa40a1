"""Static instruction count of our int8 GEMV's main loop (kernels/triton_gemv.py), and of the
int4 GEMM's at its default launches for one row and for a tree (kernels/triton_quant.py GEMM_LAUNCH),
compiled for sm_90 on any machine, no GPU needed: Triton's own ptxas and nvdisasm give the SASS.

    python benchmarks/quant_sass.py [--block-n 16] [--block-words 128] [--num-warps 2]

It counts the kernel with and without its one-lop3 code conversion (`asm`) and with and without
the pipelined loop (STAGES 3: the loads go through shared memory, asynchronously). Its integer
arguments are compiled as divisible by 16, as Triton's runtime specializes them for real shapes
(that is what lets the loads become 16-byte vectors).

The loop handles block_words int32 words (whole groups of 128 codes) of each of a program's rows. Dividing its SASS
instructions by the codes a thread handles gives the instructions a code costs. With that, an
H200's issue rate gives the fastest the kernel could run if it were issue-bound:
4 schedulers x 32 lanes per SM per clock, at most 1.98 GHz, 132 SMs. Comparing that bound with the
measured rate (benchmarks/results/quant_gemv_h200.json) says whether instruction count is what
limits the kernel. The count depends on the Triton version, which the JSON records. Measure with
the device's version: `pip install --target DIR triton==X`, then run this with `PYTHONPATH=DIR`.

Writes benchmarks/results/quant_sass_sm90.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashtree.kernels.reference import INT4_RUN
from flashtree.kernels.triton_gemv import _gemv_kernel
from flashtree.kernels.triton_int4 import MAGIC_KINDS
from flashtree.kernels.triton_quant import _gemm_kernel, gemm_constants, gemm_launch

# NVIDIA's H200 figures (spec sheet, not measured): SMs, the boost clock, thread-instructions
# issued per SM per clock (4 schedulers x 32 lanes)
H200 = {"sms": 132, "max_clock_hz": 1.98e9, "issue_per_sm_per_clock": 128}
GROUP = 128
# the GEMV's pointer and integer arguments in order (x regrouped in float32, codes as int32 words,
# scale, minimum, bias, out, split-K partials and counters)
GEMV_TYPES = ["*fp32", "*i32", "*fp16", "*fp16", "*fp16", "*bf16", "*fp32", "*i32"] + ["i32"] * 5


def gemm_types(bits: int, x: str = "*bf16", scale: str = "*fp16", second: Optional[str] = None) -> list[str]:
    """The GEMM's argument types: x, its group sums, codes (int4 as 16-bit words), scale, minimum
    (`second`, by default the scale's type: a table layout's launch passes its scale, or IQ4_XS's
    float16 super-scales), bias, the table (float32; its scale where there is none), out, split-K
    partials and counters, then 8 integers, then the L2 prefetch's address and bytes."""
    return ([x, "*fp32", "*i16" if bits == 4 else "*u8", scale, second or scale, "*fp16", "*fp32", x, "*fp32",
             "*i32"] + ["i32"] * 8 + ["i64", "i32"])


def compile_for_sm90(kernel, types: list[str], constants: dict, divisible: bool = False, **options):
    """`kernel` compiled for sm_90 with Triton's own toolchain, no GPU needed: its runtime
    arguments (in order, those not in `constants`) typed by `types`; `divisible` compiles every
    runtime argument as divisible by 16, as the runtime does for real shapes and allocations."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constants = defaults | constants  # a constexpr left out takes its default (PDL: off)
    runtime = [name for name in kernel.arg_names if name not in constants]
    signature = dict(zip(runtime, types, strict=True)) | {name: "constexpr" for name in constants}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in runtime} if divisible else None
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode counts between the loop's label and its backward branch (the longest such span)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best: tuple[int, int] = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `?\(?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            best = max(best, (labels[m.group(1)], i), key=lambda span: span[1] - span[0])
    ops: collections.Counter = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def count(block_n: int, block_words: int, num_warps: int, stages: int = 1, asm: bool = False) -> dict:
    """The int8 GEMV's main loop (kernels/triton_gemv.py) at these launch parameters."""
    block_g = max(1, block_words * 4 // GROUP)  # as the launcher (for K a multiple of it)
    constants = dict(GROUP=GROUP, BLOCK_N=block_n, BLOCK_G=block_g, HAS_BIAS=False, REGROUPED=True,
                     ASM=asm, STAGES=stages)
    compiled = compile_for_sm90(_gemv_kernel, GEMV_TYPES, constants, divisible=True, num_warps=num_warps)
    return {"kernel": "gemv", "bits": 8, "block_n": block_n, "block_g": block_g, "num_warps": num_warps,
            "stages": stages, "asm": asm,
            **loop_cost(compiled, block_n * block_g * GROUP // (32 * num_warps))}


def count_gemm(bits: int, rows: int, tiled: bool = False, group: int = GROUP, scaled: Optional[bool] = None) -> dict:
    """The GEMM's main loop (kernels/triton_quant.py) at its default launch (GEMM_LAUNCH) for
    `rows` rows of x (1: a tile of 16, 23: of 32), bfloat16 x, inline-PTX dequantization, codes
    in groups of `group`: one step of each of a program's rows an iteration (an int4 run, int8's
    int8_step, `scaled` as gemm_constants takes it); `tiled`: int4 as the engine places it on
    CUDA (models/quant.py tile_for_kernels)."""
    launch = gemm_launch(bits, rows)
    block_m = max(16, triton.next_power_of_2(rows))
    constants = gemm_constants(bits, group, block_m, launch["block_n"], MAGIC_KINDS[torch.bfloat16], False, True,
                               tiled, scaled=scaled)
    compiled = compile_for_sm90(_gemm_kernel, gemm_types(bits), constants, divisible=True,
                                num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    step = constants["STEP8"] if bits == 8 else INT4_RUN
    return {"kernel": "gemm", "bits": bits, "rows": rows, "tiled": tiled, "group": group, "block_m": block_m,
            **launch, "asm": True, **loop_cost(compiled, launch["block_n"] * step // (32 * launch["num_warps"]))}


def loop_cost(compiled, codes_per_thread: int) -> dict:
    """The main loop's SASS instructions (Triton's own nvdisasm) per code a thread handles, and the
    H200's issue bound at that count."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    ops = loop_opcodes(sass)
    per_code = sum(ops.values()) / codes_per_thread
    bound = H200["sms"] * H200["max_clock_hz"] * H200["issue_per_sm_per_clock"] / per_code
    return {"loop_instructions": sum(ops.values()), "codes_per_thread_per_loop": codes_per_thread,
            "instructions_per_code": per_code, "opcodes": dict(ops.most_common()), "issue_bound_codes_per_s": bound}


def measured_us(row: dict, kernel: str) -> float:
    """A quant_gemv_h200.json row's time for `kernel` at its defaults: the routed one's, or the
    other launcher's among the row's alternatives."""
    if row.get("ours_kernel", "gemv") == kernel:
        return row["ours_default_us"]
    return row["ours_sweep"][json.dumps({"kernel": kernel})]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-n", type=int, default=16)
    ap.add_argument("--block-words", type=int, default=128)
    ap.add_argument("--num-warps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    rows = [count(args.block_n, args.block_words, args.num_warps, stages, asm)
            for stages in (1, 3) for asm in (False, True)]
    rows += [count_gemm(4, m, tiled) for m in (1, 23) for tiled in (False, True)]
    measured = Path(__file__).parent / "results" / "quant_gemv_h200.json"
    if measured.is_file():  # the measured M=1 rate of the 27B shape's linears, in codes a second
        data = json.loads(measured.read_text())
        for row in rows:
            if (row["kernel"] == "gemv" and (row["stages"] != 3 or not row["asm"]) or row.get("rows", 1) != 1
                    or row.get("tiled")):
                continue  # the defaults at one row, rows in order, are what was measured
            sel = [r for r in data["rows"] if r["bits"] == row["bits"] and r["M"] == 1]
            if not sel:  # that width was not in the measured run
                continue
            codes = sum(r["N"] * r["K"] for r in sel)
            row["measured_codes_per_s"] = codes / (sum(measured_us(r, row["kernel"]) for r in sel) * 1e-6)
            row["measured_over_issue_bound"] = row["measured_codes_per_s"] / row["issue_bound_codes_per_s"]
    result = {"target": "sm_90", "triton": triton.__version__, "h200": H200, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "quant_sass_sm90.json"
    path.write_text(json.dumps(result, indent=1))
    for row in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "opcodes"}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
