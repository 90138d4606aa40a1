"""The Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1) on float32 CPU tensors,
against their definitions: a machine without a GPU still checks their indexing, masking, split
bookkeeping and the device-length reads (tests/test_gpu_kernels.py runs them compiled, in bf16).

The kernels run in a child process because the interpreter is chosen when `triton.jit` decorates
a kernel, at import time."""

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
    import json, os
    import torch
    from flashtree.kernels import use_triton
    from flashtree.kernels.attention import reference_attention
    from flashtree.kernels.triton_attention import MODE_ALL, MODE_CAUSAL, MODE_MASK, attention
    from flashtree.kernels.fused import qkv_rope_store, rms_norm, silu_mul
    from flashtree.models.common import RotaryTable
    from flashtree.runtime.ddtree import build_tree

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    def tree_mask(n, seed):
        g = torch.Generator().manual_seed(seed)
        logp = torch.log_softmax(torch.randn(15, 100, generator=g), -1).sort(-1, descending=True)
        return build_tree(1, logp.values, logp.indices, n - 1, True, 15).ancestor_mask()

    def kernel(q, k, v, length, scale, mask=None, causal=False):  # float32: tight enough to see
        mode = MODE_MASK if mask is not None else (MODE_CAUSAL if causal else MODE_ALL)  # one lost split
        return attention(q, k, v, length, scale, mode, mask.view(torch.uint8) if mask is not None else None,
                         None)

    def eager(fn):  # the plain-PyTorch definition of an op
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            return fn()
        finally:
            os.environ["TRITON_INTERPRET"] = "1"

    out = {"kernel_path": use_triton(torch.zeros(1))}  # the fused ops below take the Triton path
    torch.manual_seed(0)
    for heads, kvh, t, mode, length in [(32, 8, 1, "causal", 0), (32, 8, 1, "causal", 100),
                                        (32, 8, 1, "causal", 2048), (32, 8, 16, "causal", 700),
                                        (16, 8, 16, "all", 300), (32, 8, 23, "mask", 1000)]:
        k = torch.randn(length + t + 17, kvh, 128)
        v = torch.randn_like(k)
        q = torch.randn(t, heads, 128)
        mask = tree_mask(t, length) if mode == "mask" else None
        got = kernel(q, k, v, torch.tensor([length], dtype=torch.int32), 128 ** -0.5, mask, mode == "causal")
        ref = reference_attention(q, k, v, length, 128 ** -0.5, mask, mode == "causal", None)
        out[f"attention {heads}/{kvh} t={t} {mode} len={length}"] = rel(got, ref)
    k = torch.randn(3000, 8, 128)
    v = torch.randn_like(k)
    q = torch.randn(23, 32, 128)
    mask, lt = tree_mask(23, 1), torch.zeros(1, dtype=torch.int32)
    for length in (5, 900, 2900):  # one tensor, several lengths: the kernels read it on the device
        lt.fill_(length)
        got = kernel(q, k, v, lt, 0.09, mask)
        out[f"attention device length {length}"] = rel(got, reference_attention(q, k, v, length, 0.09, mask,
                                                                                False, None))
    x, r, w = torch.randn(7, 384), torch.randn(7, 384), 1 + 0.1 * torch.randn(384)
    (y, s), (y_ref, s_ref) = rms_norm(x, w, 1e-6, r), eager(lambda: rms_norm(x, w, 1e-6, r))
    out["rms_norm"], out["rms_norm residual sum"] = rel(y, y_ref), rel(s, s_ref)
    gu = torch.randn(5, 2 * 384)
    out["silu_mul"] = rel(silu_mul(gu), eager(lambda: silu_mul(gu)))
    rope = RotaryTable(64, {"rope_type": "default", "rope_theta": 1e6}, 4096)
    qkv, pos = torch.randn(9, (4 + 2 * 2) * 64), torch.randint(0, 4000, (9,))
    qn, kn, length = 1 + 0.1 * torch.randn(64), 1 + 0.1 * torch.randn(64), torch.tensor([100], dtype=torch.int32)
    caches = [torch.full((120, 2, 64), float("nan")) for _ in range(4)]
    q_k = qkv_rope_store(qkv, pos, rope.cos, rope.sin, qn, kn, 1e-6, caches[0], caches[1], length, 4, 2)
    q_e = eager(lambda: qkv_rope_store(qkv, pos, rope.cos, rope.sin, qn, kn, 1e-6, caches[2], caches[3],
                                       length, 4, 2))
    out["qkv_rope_store q"] = rel(q_k, q_e)
    out["qkv_rope_store k rows"] = rel(caches[0][100:109], caches[2][100:109])
    out["qkv_rope_store v rows"] = rel(caches[1][100:109], caches[3][100:109])
    out["qkv_rope_store rows outside untouched"] = bool(torch.isnan(caches[0][:100]).all()
                                                        and torch.isnan(caches[0][109:]).all())
    y_c, y_cref = rms_norm(x, w - 1, 1e-6, r, 1.0)[0], eager(lambda: rms_norm(x, w - 1, 1e-6, r, 1.0)[0])
    out["rms_norm zero-centered"] = rel(y_c, y_cref)
    from flashtree.kernels.gated_delta import TreeIndex, gated_delta_fold, gated_delta_rule
    t, hv, dk, dv = 9, 3, 16, 24
    qd, kd = (torch.nn.functional.normalize(torch.randn(t, hv, dk), dim=-1) for _ in range(2))
    vd, gd, bd = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
    s0 = torch.randn(hv, dk, dv)
    tree = TreeIndex.build([-1, 0, 1, 1, 0, 4, 5, 2, 7], 4, "cpu")
    for name, index in (("sequence", None), ("tree", tree)):
        got, got_state = gated_delta_rule(qd, kd, vd, gd, bd, s0, index)
        ref, ref_state = eager(lambda: gated_delta_rule(qd, kd, vd, gd, bd, s0, index))
        out[f"gated delta {name}"] = rel(got, ref)
        if index is None:
            out["gated delta final state"] = rel(got_state, ref_state)
    path = torch.tensor([0, 1, 2, 7, 8])
    folded = gated_delta_fold(s0, kd[path], vd[path], gd[path], bd[path])
    out["gated delta fold"] = rel(folded, eager(lambda: gated_delta_fold(s0, kd[path], vd[path], gd[path], bd[path])))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kernel_path_is_the_one_checked(results: dict) -> None:
    assert results["kernel_path"] is True


def test_kernels_match_their_definitions_in_float32(results: dict) -> None:
    results = {k: v for k, v in results.items() if k != "kernel_path"}
    assert results.pop("qkv_rope_store rows outside untouched") is True
    assert len(results) == 20
    bad = {name: err for name, err in results.items() if not err < 1e-5}
    assert not bad, bad
