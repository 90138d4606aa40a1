"""Running a script under Triton's CPU interpreter, for the tests that check kernels without a GPU
(or the same script compiled, on one).

The interpreter is chosen when `triton.jit` decorates a kernel, at import time, so the script
runs in a child process with TRITON_INTERPRET=1; it prints its findings as JSON on its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, threads: Optional[int] = None, interpret: bool = True) -> Any:
    """`script` (Python source) run from the repository root with `args`, under the interpreter
    (torch on `threads` OpenMP threads where given), or with `interpret` False compiled for the
    GPU, from a file (Triton compiles a kernel from its source file); what its last line of
    output says."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0", "PYTHONPATH": str(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as folder:
        if interpret:
            command = ["-c", script]
        else:
            path = Path(folder) / "script.py"
            path.write_text(script)
            command = [str(path)]
        proc = subprocess.run([sys.executable, *command, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Prepended to an interpreted script whose assertions need a tile's dot to give each row the same
# bits whatever the tile's other rows hold, as a GPU's MMA does (the deterministic mode's tests).
# The interpreter runs tl.dot as numpy's matmul, whose BLAS kernel on some CPUs (an AMD EPYC
# without AVX-512: rows 6-11 of every 12) sums a row in an order that follows its neighbours; a
# float32 dot here is instead einsum's own loop, each output summed over K in order.
ROW_INVARIANT_DOT = """
import numpy as _np
from triton.runtime import interpreter as _interpreter

_matmul_dot = _interpreter.InterpreterBuilder.create_dot

def _row_invariant_dot(self, a, b, d, *args):
    if a.data.dtype == _np.float32 and b.data.dtype == _np.float32 and a.data.ndim == 2:
        return _interpreter.TensorHandle(_np.einsum("mk,kn->mn", a.data, b.data, optimize=False) + d.data,
                                         d.dtype.scalar)
    return _matmul_dot(self, a, b, d, *args)

_interpreter.InterpreterBuilder.create_dot = _row_invariant_dot
"""
