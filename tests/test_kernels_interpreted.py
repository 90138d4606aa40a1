"""The Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1) on float32 CPU tensors,
against their definitions: a machine without a GPU still checks their indexing, masking, split
bookkeeping and the device-length reads (tests/test_gpu_kernels.py runs them compiled, in bf16).

The kernels run in a child process because the interpreter is chosen when `triton.jit` decorates
a kernel, at import time; one child per part (attention, the device-read lengths, the fused ops),
so that each part reports as its own test and none runs for a minute without showing progress."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

SCRIPT = textwrap.dedent("""
    import itertools, json, os, sys
    import torch
    from flashtree.kernels import use_triton
    from flashtree.kernels.attention import reference_attention
    from flashtree.kernels.triton_attention import MODE_ALL, MODE_CAUSAL, MODE_MASK, attention
    from flashtree.kernels.fused import qkv_rope_store, rms_norm, silu_mul
    from flashtree.models.rope import RotaryTable
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

    def attention_cases(out):
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

    def device_length_cases(out):
        k = torch.randn(3000, 8, 128)
        v = torch.randn_like(k)
        q = torch.randn(23, 32, 128)
        mask, lt = tree_mask(23, 1), torch.zeros(1, dtype=torch.int32)
        for length in (5, 900, 2900):  # one tensor, several lengths: the kernels read it on the device
            lt.fill_(length)
            got = kernel(q, k, v, lt, 0.09, mask)
            out[f"attention device length {length}"] = rel(got, reference_attention(q, k, v, length, 0.09, mask,
                                                                                    False, None))

    def fused_cases(out):
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

    def hybrid_cases(out):  # Qwen3.5: the zero-centered norm and the gated delta rule
        x, r, w = torch.randn(7, 384), torch.randn(7, 384), 0.1 * torch.randn(384)
        y, y_ref = rms_norm(x, w, 1e-6, r, 1.0)[0], eager(lambda: rms_norm(x, w, 1e-6, r, 1.0)[0])
        out["rms_norm zero-centered"] = rel(y, y_ref)
        from flashtree.kernels.gated_delta import TreeIndex, gated_delta_fold, gated_delta_rule
        from flashtree.kernels.triton_gated_delta import scan
        t, hv, dk, dv = 9, 3, 16, 24
        q, k = (torch.nn.functional.normalize(torch.randn(t, hv, dk), dim=-1) for _ in range(2))
        v, g, b = torch.randn(t, hv, dv), -torch.rand(t, hv), torch.rand(t, hv)
        s0 = torch.randn(hv, dk, dv)
        tree = TreeIndex.build([-1, 0, 1, 1, 0, 4, 5, 2, 7], 4, "cpu")
        for name, index in (("sequence", None), ("tree", tree)):
            got, got_state = gated_delta_rule(q, k, v, g, b, s0, index)
            ref, ref_state = eager(lambda: gated_delta_rule(q, k, v, g, b, s0, index))
            out[f"gated delta {name}"] = rel(got, ref)
            if index is None:
                out["gated delta final state"] = rel(got_state, ref_state)
        padded = TreeIndex.static(12, 4, "cpu")  # a captured graph's buffers: 3 padding rows after the tree
        padded.fill_(tree)
        pad = lambda x: torch.cat([x, x[:3]])  # noqa: E731
        want = eager(lambda: gated_delta_rule(q, k, v, g, b, s0, tree))[0]
        got = gated_delta_rule(pad(q), pad(k), pad(v), pad(g), pad(b), s0, padded)[0][:9]
        out["gated delta tree in static buffers"] = rel(got, want)
        # its 6 segments on 2 programs a slice, 3 each
        got = scan(pad(q), pad(k), pad(v), pad(g), pad(b), s0, padded, None, segment_programs=2)[:9]
        out["gated delta tree, several segments a program"] = rel(got, want)
        path = torch.tensor([0, 1, 2, 7, 8])
        folded = gated_delta_fold(s0, k[path], v[path], g[path], b[path])
        out["gated delta fold"] = rel(folded, eager(lambda: gated_delta_fold(s0, k[path], v[path], g[path], b[path])))
        live = s0.clone()  # the commit folds the live state in place
        gated_delta_fold(live, k[path], v[path], g[path], b[path], out=live)
        out["gated delta fold in place"] = rel(live, folded)

    def delta_input_cases(out):  # Qwen3.5's DeltaNet prologue and epilogue around the scan
        from flashtree.kernels.gated_delta import DeltaRows, TreeIndex, delta_inputs, gated_output
        hk, hv, dk, dv, kw = 2, 4, 16, 24, 4  # GQA repeat 2; a value dim that needs masking
        channels = 2 * hk * dk + hv * dv
        weight, a_log, dt_bias = torch.randn(channels, kw), torch.randn(hv), torch.randn(hv)
        window = torch.randn(kw - 1, channels)

        def rows_in(t, tree):  # node-buffer-like destinations: a layer axis, so rows are strided
            k, v, g, b = (torch.full((t, 3, *shape), float("nan")) for shape in ((hv, dk), (hv, dv), (hv,), (hv,)))
            win = torch.full((t, 3, kw - 1, channels) if tree else (3, kw - 1, channels), float("nan"))
            return DeltaRows(k[:, 1], v[:, 1], g[:, 1], b[:, 1], win[:, 1] if tree else win[1])

        for name, t, parents in (("ar", 1, None), ("sequence", 2, None), ("chunk", 7, None),
                                 ("tree", 9, [-1, 0, 1, 1, 0, 4, 5, 2, 7])):
            proj = torch.randn(t, channels + hv * dv + 2 * hv)
            proj[:, -hv:] *= 15  # softplus on both sides of its threshold
            tree = TreeIndex.build(parents, kw, "cpu") if parents else None
            got, ref = rows_in(t, tree is not None), rows_in(t, tree is not None)
            q = delta_inputs(proj, window, weight, a_log, dt_bias, hk, dk, dv, tree, got)
            q_ref = eager(lambda: delta_inputs(proj, window, weight, a_log, dt_bias, hk, dk, dv, tree, ref))
            out[f"delta inputs {name} q"] = rel(q, q_ref)
            for field in ("k", "v", "g", "beta", "windows"):
                out[f"delta inputs {name} {field}"] = rel(getattr(got, field), getattr(ref, field))
        x, z, w = torch.randn(5, hv, dv), torch.randn(5, hv * dv), torch.randn(dv)
        out["gated output norm"] = rel(gated_output(x, z, w, 1e-6, torch.float32),
                                       eager(lambda: gated_output(x, z, w, 1e-6, torch.float32)))

    def gated_qkv_cases(out):  # Qwen3.5's gated attention: zero-centered q/k norm, partial RoPE, gate
        from flashtree.kernels.fused import gated_qkv_store
        heads, kvh, d, rot, t = 4, 2, 64, 16, 5
        rope = RotaryTable(rot, {"rope_type": "default", "rope_theta": 1e7}, 4096)
        pos = torch.randint(0, 4000, (t,))
        cos, sin = rope.cos[pos], rope.sin[pos]
        qkv = torch.randn(t, (2 * heads + 2 * kvh) * d)
        qn, kn, length = 0.1 * torch.randn(d), 0.1 * torch.randn(d), torch.tensor([50], dtype=torch.int32)
        caches = [torch.full((60, kvh, d), float("nan")) for _ in range(4)]
        q, gate = gated_qkv_store(qkv, cos, sin, qn, kn, 1e-6, caches[0], caches[1], length, heads, kvh, rot)
        q_e, gate_e = eager(lambda: gated_qkv_store(qkv, cos, sin, qn, kn, 1e-6, caches[2], caches[3], length,
                                                    heads, kvh, rot))
        out["gated qkv q"], out["gated qkv gate"] = rel(q, q_e), rel(gate, gate_e)
        out["gated qkv k rows"] = rel(caches[0][50:55], caches[2][50:55])
        out["gated qkv v rows"] = rel(caches[1][50:55], caches[3][50:55])
        out["gated qkv rows outside untouched"] = float(not (torch.isnan(caches[0][:50]).all()
                                                            and torch.isnan(caches[0][55:]).all()))

    def hybrid_engine_cases(out):  # every hybrid kernel inside a tiny model: prefill chunks, trees, commits
        import tempfile
        from pathlib import Path
        sys.path.insert(0, "tests")
        from tiny_models import make_draft, make_target
        from flashtree import Engine
        root = Path(tempfile.mkdtemp())
        target = make_target(root / "target", arch="qwen3_5", layers=4)
        pair = (str(target), str(make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 3])))
        prompt = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9]

        def generate(mode):
            eng = Engine.from_pretrained(*pair, device="cpu", max_ctx=64, mode=mode, prefill_ubatch=5)
            return eng.generate(prompt, max_tokens=10, stop_token_ids=[]).token_ids

        ar = eager(lambda: generate("ar"))  # (an AR step is a one-node tree: ddtree covers its kernels)
        for mode in ("ddtree", "chain"):
            tokens = generate(mode)
            out[f"hybrid engine {mode}: tokens that differ from eager AR"] = sum(
                a != b for a, b in zip(tokens, ar)) + abs(len(tokens) - len(ar))

    def kv_quant_cases(out):  # quantized caches: the split kernel dequantizes, the fused stores quantize
        from flashtree.kernels.kv_storage import QuantRows, dequantize_kv, quantize_kv

        def side(kind, x):
            return x if kind is None else QuantRows(kind, *quantize_kv(x, kind))

        for kk, vk, t, mode in [("q8_0", "q4_0", 1, "causal"), ("fp8", "q8_0", 7, "mask"), ("q4_0", None, 5, "all"),
                                ("bf16", "fp8", 3, "causal")]:
            k, v = side(kk, torch.randn(340, 2, 64)), side(vk, torch.randn(340, 2, 64))
            q, mask = torch.randn(t, 8, 64), tree_mask(t, 3) if mode == "mask" else None
            got = kernel(q, k, v, torch.tensor([300], dtype=torch.int32), 0.125, mask, mode == "causal")
            out[f"kv attention {kk}/{vk} t={t} {mode}"] = rel(got, reference_attention(q, k, v, 300, 0.125, mask,
                                                                                           mode == "causal", None))
        from flashtree.kernels.fused import gated_qkv_store
        rope = RotaryTable(64, {"rope_type": "default", "rope_theta": 1e6}, 4096)
        qkv, pos = torch.randn(9, (4 + 2 * 2) * 64), torch.randint(0, 4000, (9,))
        gated_qkv = torch.randn(9, (2 * 4 + 2 * 2) * 64)
        gated_rope = RotaryTable(16, {"rope_type": "default", "rope_theta": 1e7}, 4096)
        qn, kn, length = 1 + 0.1 * torch.randn(64), 1 + 0.1 * torch.randn(64), torch.tensor([100], dtype=torch.int32)
        stores = {"dense": lambda sides: qkv_rope_store(qkv, pos, rope.cos, rope.sin, qn, kn, 1e-6, *sides, length,
                                                        4, 2),
                  "gated": lambda sides: gated_qkv_store(gated_qkv, gated_rope.cos[pos], gated_rope.sin[pos],
                                                         qn - 1, kn - 1, 1e-6, *sides, length, 4, 2, 16)}
        for (store, write), kind in itertools.product(stores.items(), ("fp8", "q8_0", "q4_0")):
            kernel_sides, eager_sides = ([side(kind, torch.zeros(120, 2, 64)) for _ in range(2)] for _ in range(2))
            write(kernel_sides)
            eager(lambda: write(eager_sides))
            for name, a, b in zip("kv", kernel_sides, eager_sides):
                got, ref = dequantize_kv(a, torch.float32), dequantize_kv(b, torch.float32)
                # the interpreter's float32 -> float8 conversion (not the GPU's) drops the carry when
                # the mantissa rounds up into the next power of two (half the right value), and
                # rounds subnormals (below 2^-6) down a step of 2^-9
                carry = (got * 2 == ref) & (ref.abs().log2() == ref.abs().log2().round())
                subnormal = (ref.abs() < 2 ** -6) & ((got - ref).abs() <= 2 ** -9)
                interp = (carry | subnormal) & (kind == "fp8")
                out[f"kv store {store} {kind} {name} rows equal"] = bool(((got == ref) | interp)[100:109].all())
                out[f"kv store {store} {kind} {name} rows outside untouched"] = bool(
                    (got[:100] == 0).all() and (got[109:] == 0).all())
        # Qwen3.5's 256-wide heads in a tree, the value dims split over two programs a row block
        # (plan()'s launch where a GPU's shared memory does not hold WIDE_TREE_LAUNCH; after the
        # stores, whose random rows stay as they were)
        k, v = side("q4_0", torch.randn(340, 2, 256)), side("q8_0", torch.randn(340, 2, 256))
        q, mask = torch.randn(23, 12, 256), tree_mask(23, 4)
        got = attention(q, k, v, torch.tensor([300], dtype=torch.int32), 0.0625, MODE_MASK, mask.view(torch.uint8),
                        None, {"block_m": 64, "tail": 0, "v_parts": 2, "nsplit": 32})
        out["kv attention q4_0/q8_0 256-wide tree, value dims in two parts"] = rel(
            got, reference_attention(q, k, v, 300, 0.0625, mask, False, None))
        # its 138 rows a KV head as full row blocks and a tail block (64 + 64 + 16, 128 + 16): the
        # tail launch's rows start past the full blocks' and the merge covers both; with tail 2
        # the full block's program computes the tail's rows too, the same bits as two launches
        tails = {}
        for block_m, parts, tail in ((64, 2, 1), (128, 1, 1), (128, 1, 2)):
            got = attention(q, k, v, torch.tensor([300], dtype=torch.int32), 0.0625, MODE_MASK, mask.view(torch.uint8),
                            None, {"block_m": block_m, "tail": tail, "v_parts": parts, "nsplit": 4})
            tails[block_m, tail] = got
            out[f"kv attention 256-wide tree, {block_m}-row blocks and a tail{' in their program' * (tail == 2)}"] = rel(
                got, reference_attention(q, k, v, 300, 0.0625, mask, False, None))
        out["kv attention 256-wide tree: the tail in the full block's program differs from its own launch"] = float(
            not torch.equal(tails[128, 1], tails[128, 2]))

    out = {"kernel_path": use_triton(torch.zeros(1))}  # the ops below take the Triton path
    torch.manual_seed(0)
    {"attention": attention_cases, "device_length": device_length_cases, "fused": fused_cases,
     "hybrid": hybrid_cases, "delta_inputs": delta_input_cases,
     "gated_qkv": gated_qkv_cases, "hybrid_engine": hybrid_engine_cases,
     "kv_quant": kv_quant_cases}[sys.argv[1]](out)
    print(json.dumps(out))
""")


PARTS = {"attention": 6, "device_length": 3, "fused": 6, "hybrid": 8, "delta_inputs": 25, "gated_qkv": 5,
         "hybrid_engine": 2, "kv_quant": 9}  # part: float32 comparisons
_results: dict[str, dict] = {}


def results(part: str) -> dict:
    """What the script prints for one part, run once per session."""
    if part not in _results:
        _results[part] = run_interpreted(SCRIPT, part)
    return _results[part]


def test_the_kernel_path_is_the_one_checked() -> None:
    assert results("fused")["kernel_path"] is True


# The interpreter runs the attention kernels at real model shapes (32 heads, up to 3000 keys) for
# about a minute on two cores, and a tiny hybrid engine (every kernel, AR and ddtree) for several:
# slow tests. The fused ops take seconds and stay in the fast suite.
SLOW = ("attention", "device_length", "hybrid_engine", "kv_quant", "delta_inputs")  # 10-17 s each


@pytest.mark.parametrize("part", [pytest.param(part, marks=pytest.mark.slow)
                                  if part in SLOW else part for part in PARTS])
def test_kernels_match_their_definitions_in_float32(part: str) -> None:
    found = {k: v for k, v in results(part).items() if k != "kernel_path"}
    if part == "fused":
        assert found.pop("qkv_rope_store rows outside untouched") is True
    if part == "kv_quant":  # quantized rows: the kernel's codes and scales are the definition's
        flags = {k: found.pop(k) for k in list(found) if k.startswith("kv store")}
        assert len(flags) == 24 and all(flags.values()), flags
    assert len(found) == PARTS[part]
    bad = {name: err for name, err in found.items() if not err < 1e-5}
    assert not bad, bad
