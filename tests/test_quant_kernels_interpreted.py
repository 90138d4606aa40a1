"""The quantized GEMV/GEMM Triton kernels (kernels/triton_quant.py), run by Triton's CPU interpreter
on float32 tensors through QuantizedLinear's own forward, against the definition (dequantize, then
matmul): their nibble order, group bookkeeping and masking of ragged row and group tiles; and
the bit trick that turns codes into floats, in each activation dtype (the interpreter cannot
run the kernels on bf16 data, but can build the values).

A child process, as in tests/test_kernels_interpreted.py: the interpreter is chosen when
`triton.jit` decorates a kernel, at import time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json
    import torch
    import triton
    import triton.language as tl
    from flashtree.kernels.quant import kernel_applies
    from flashtree.kernels.reference import quant_linear
    from flashtree.kernels.triton_quant import one_plus_sixteenth
    from flashtree.models.quant import QuantizedLinear

    @triton.jit
    def magic(C, OUT, KIND: tl.constexpr):
        i = tl.arange(0, 16)
        tl.store(OUT + i, one_plus_sixteenth(tl.load(C + i), KIND).to(tl.float32))

    out = {}
    codes = torch.arange(16, dtype=torch.uint8)
    for kind in (0, 1, 2):  # the GEMM's float32, bfloat16 and float16 code values, exact
        got = torch.empty(16)
        magic[(1,)](codes, got, KIND=kind)
        out[f"magic {kind}"] = torch.equal(got, 1 + codes.float() / 16)
    torch.manual_seed(0)
    # K = 320 is 2.5 GEMV tiles of 128 and 10 groups of 32; N = 40 leaves ragged row tiles
    for bits in (8, 4):
        for group, k in ((32, 320), (64, 256), (128, 256)):
            for rows in (1, 7, 23):
                bias = torch.randn(40) if rows != 7 else None
                layer = QuantizedLinear.from_float(torch.randn(40, k), bits, group, bias)
                x = torch.randn(rows, 2 * k)[:, ::2]  # a column stride: the launcher makes it contiguous
                got = layer(x)
                want = quant_linear(x, layer.codes, layer.scale, layer.minimum, layer.bias, bits, group)
                name = f"int{bits} group {group} k {k} rows {rows}"
                out[name] = [kernel_applies(x, rows, bits, group), ((got - want).norm() / want.norm()).item()]
    print(json.dumps(out))
""")


def test_quantized_kernels_match_the_definition_in_float32() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(found.pop(f"magic {kind}") for kind in (0, 1, 2))
    assert len(found) == 18
    not_kernel = [name for name, (ran, _) in found.items() if not ran]
    assert not not_kernel, not_kernel
    bad = {name: err for name, (_, err) in found.items() if not err < 1e-5}
    assert not bad, bad
