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
