"""The quantized KV cache (--kv-type / --v-type): every type against its definition in
kernels/reference.py, attention over a quantized cache, greedy speculative decoding equal to
greedy AR with the same KV type (a dense target and a hybrid), snapshots through every tier bit
for bit, a disk file of another KV type left alone, OOM recovery, the CLI and a live server with
the flags, the benchmark's random rows. (The Triton kernels: test_kernels_interpreted.py, and
compiled in test_gpu_kernels.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from flashtree import Engine
from flashtree.errors import ConfigError, EngineOutOfMemory
from flashtree.kernels.attention import cache_attention
from flashtree.kernels.fused import qkv_rope_store
from flashtree.kernels.kv_storage import FP8_MAX, KV_CODES, QBLOCK, QuantRows, dequantize_kv, quantize_kv
from flashtree.kernels.reference import sdpa, split_qkv
from flashtree.models.rope import RotaryTable
from flashtree.models.inputs import ForwardInput
from flashtree.models.kv_cache import KVCache
from flashtree.runtime.byte_counts import kv_value_bytes
from flashtree.runtime import faults
from tiny_models import make_draft, make_target

KINDS = list(KV_CODES)
PROMPTS = [[5 + (i * 7) % 300 for i in range(40)], [3, 77, 120, 45, 9, 300, 18, 200, 61] * 3]
TIE = 0.01  # a divergence is a tie if AR's own logit gap between the two tokens is under 1% of the spread



@pytest.mark.parametrize("kind", KINDS)
def test_quantize_dequantize_error_is_within_the_format_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-3, 2, 64).view(-1, 1, 1)
    x[0, 0, :QBLOCK] = 0  # an all-zero block decodes to zeros
    x[1, 0, 5] = 1000.0  # past fp8's range: saturates
    codes, scale = quantize_kv(x, kind)
    y = dequantize_kv(QuantRows(kind, codes, scale), torch.float32)
    assert codes.dtype == KV_CODES[kind][0] and y.shape == x.shape
    assert (y[0, 0, :QBLOCK] == 0).all()
    err = (y - x).abs()
    if kind == "bf16":
        assert (err <= x.abs() * 2 ** -8).all()
    elif kind == "fp8":
        assert y[1, 0, 5] == FP8_MAX
        inside = x.abs() <= FP8_MAX
        assert (err <= torch.maximum(x.abs() * 2 ** -4, torch.tensor(2.0 ** -10)))[inside].all()
    else:
        step = scale.float().abs().repeat_interleave(QBLOCK, dim=-1)
        amax = x.unflatten(-1, (-1, QBLOCK)).abs().amax(-1).repeat_interleave(QBLOCK, dim=-1)
        # half a step, plus the scale's float16 rounding; q4_0's positive side ends at code +7
        bound = 0.5 * step + amax * 2 ** -10 if kind == "q8_0" else step * 1.0 + amax * 2 ** -10
        assert (err <= bound).all()
        assert err.mean() < 0.3 * step.mean()  # most values round to the nearest level


@pytest.mark.parametrize("k_type,v_type", [("q8_0", None), ("q4_0", "q8_0"), ("fp8", "q4_0"), ("bf16", None),
                                           ("auto", "q4_0")])
def test_cache_layout_bytes_and_attention_over_the_dequantized_rows(k_type, v_type):
    cache = KVCache(2, 50, 2, 64, torch.float32, "cpu", k_type, v_type)
    kinds = (k_type, v_type or k_type)
    # what the memory plan counts (its table) is what the cache holds
    assert cache.bytes_per_token() == 2 * 2 * 64 * sum(kv_value_bytes(k, torch.float32) for k in kinds)
    g = torch.Generator().manual_seed(1)
    rope = RotaryTable(64, {"rope_type": "default", "rope_theta": 1e6}, 128)
    qkv = torch.randn(30, (8 + 2 * 2) * 64, generator=g)
    pos = torch.arange(30)
    q = qkv_rope_store(qkv, pos, rope.cos, rope.sin, None, None, 1e-6, *cache.layer(1), torch.tensor([0]), 8, 2)
    k_rows, v_rows = (side.rows for side in cache.layer(1))  # a cache alone: its pages in order
    _, k, v = split_qkv(qkv, pos, rope.cos, rope.sin, None, None, 1e-6, 8, 2, 64)
    for rows, values, kind in ((k_rows, k, kinds[0]), (v_rows, v, kinds[1])):  # stored = quantize(values)
        if kind == "auto":
            assert torch.equal(rows[:30], values)
            continue
        codes, scale = quantize_kv(values, kind)
        assert torch.equal(rows.codes[:30], codes) and (scale is None or torch.equal(rows.scale[:30], scale))
    assert all((t[0] == 0).all() for t in cache.pool.tensors.values())  # other layers untouched
    k_deq, v_deq = (r[:30] if isinstance(r, torch.Tensor) else
                    dequantize_kv(QuantRows(r.kind, r.codes[:30], r.scale[:30] if r.scale is not None else None),
                                  torch.float32) for r in (k_rows, v_rows))
    mask = torch.ones(30, 30, dtype=torch.bool).tril()
    got = cache_attention(q[20:], k_rows, v_rows, 20, 0.125, causal=True)
    assert torch.allclose(got, sdpa(q[20:], k_deq, v_deq, mask[20:], 0.125), atol=1e-6)


def test_block_types_need_whole_blocks_per_head():
    with pytest.raises(ConfigError, match="head_dim"):
        KVCache(1, 8, 2, 48, torch.float32, "cpu", "q4_0")


@torch.inference_mode()
def ar_logits(eng, prefix_prompt, tokens):
    """The logits greedy AR computes after `prompt + tokens`: the prompt in one chunk, then one
    token a step, on a cache of the engine's KV type."""
    t, c = eng.target, eng.config
    cache = t.new_cache(256, eng.dtype, eng.device, 1, c.kv_type, c.v_type)
    n = 0
    hidden = None
    for chunk in [prefix_prompt] + [[tok] for tok in tokens]:
        ids = torch.tensor(chunk)
        hidden, _ = t(ForwardInput.prefill(ids, cache, n))
        cache.keep_rows(n, None)  # a hybrid adopts its recurrent states
        n += len(chunk)
    return t.logits(hidden[-1])


def same_or_tie(ar_eng, prompt, a, b):
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return True
    z = ar_logits(ar_eng, prompt, a[:i])
    assert int(z.argmax()) == a[i]  # the recomputation is AR's own
    gap, spread = (z[a[i]] - z[b[i]]).item(), (z.max() - z.median()).item()
    print(f"first divergence at token {i}: AR's gap {gap:.4f}, spread {spread:.3f}")
    return gap <= TIE * spread


# q4_0 (the card's cache) in the fast suite; q8_0 and the mixed pair, 8 s each, are slow
@pytest.mark.parametrize("kv", [pytest.param(("q8_0", None), marks=pytest.mark.slow), ("q4_0", None),
                                pytest.param(("q8_0", "q4_0"), marks=pytest.mark.slow)])
def test_greedy_ddtree_and_chain_equal_greedy_ar_with_a_quantized_cache(kv):
    opts = dict(max_ctx=256, kv_type=kv[0], v_type=kv[1])
    ar = Engine.from_pretrained(max_sequences=1, mode="ar", **opts)
    spec = {m: Engine.from_pretrained(max_sequences=1, mode=m, budget=8, **opts) for m in ("ddtree", "chain")}
    for prompt in PROMPTS:
        want = ar.generate(prompt, max_tokens=32, stop_token_ids=[]).token_ids
        for mode, eng in spec.items():
            got = eng.generate(prompt, max_tokens=32, stop_token_ids=[]).token_ids
            assert same_or_tie(ar, prompt, want, got), mode


@pytest.mark.parametrize("draft_kv", [pytest.param("q8_0", marks=pytest.mark.slow), "q4_0"])
def test_a_quantized_draft_cache_keeps_greedy_output_exact_and_acceptance_close(draft_kv):
    """--draft-kv-type stores the draft's context rows as codes: the target still decides every
    token (greedy ddtree equals AR exactly: the target's cache is float32 here), and the embedded
    draft's proposals, read through the codes, are accepted about as often."""
    ar = Engine.from_pretrained(max_sequences=1, mode="ar", max_ctx=256)
    plain = Engine.from_pretrained(max_sequences=1, mode="ddtree", budget=8, max_ctx=256)
    coded = Engine.from_pretrained(max_sequences=1, mode="ddtree", budget=8, max_ctx=256, draft_kv_type=draft_kv)
    assert coded.state.draft.kinds == {"k": draft_kv, "v": draft_kv}
    assert coded.state.draft.pool.nbytes * 3 < plain.state.draft.pool.nbytes  # float32 rows against 34 or 18 bytes a 32
    assert coded.state.layout() != plain.state.layout()  # a snapshot of one is not loaded into the other
    prompts = [ar.tokenizer.encode(p) for p in ("def fibonacci(n):\n    ",
                                                "Write a function that sorts a list of numbers in Python.")]
    steps = {"plain": 0, "coded": 0}
    for prompt in prompts:
        want = ar.generate(prompt, max_tokens=48, stop_token_ids=[]).token_ids
        for name, eng in (("plain", plain), ("coded", coded)):
            got = eng.generate(prompt, max_tokens=48, stop_token_ids=[])
            assert got.token_ids == want, name
            steps[name] += got.stats.steps
    assert steps["coded"] <= 1.1 * steps["plain"]  # the same tokens in at most 10% more steps


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A Qwen3.5-shaped hybrid with a head_dim of 32 (one block) and its draft."""
    root = tmp_path_factory.mktemp("hybrid_kv")
    target = make_target(root / "target", arch="qwen3_5", layers=5, hidden=128)
    return target, make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 3])


def test_a_hybrid_with_a_quantized_cache_decodes_like_ar_and_snapshots_bit_for_bit(hybrid_pair):
    opts = dict(device="cpu", max_ctx=256, kv_type="q4_0", v_type="q8_0", cache_min_tokens=8)
    ar = Engine.from_pretrained(str(hybrid_pair[0]), mode="ar", max_sequences=1, **opts)
    assert ar.state.target.kv.kinds == {"k": "q4_0", "v": "q8_0"}
    assert ar.state.target.ssm.dtype == torch.float32  # recurrent states are not quantized
    spec = Engine.from_pretrained(str(hybrid_pair[0]), str(hybrid_pair[1]), mode="ddtree", budget=8, max_sequences=1,
                                  **opts)
    a, b = PROMPTS
    want = ar.generate(a, max_tokens=24, stop_token_ids=[]).token_ids
    assert same_or_tie(ar, a, want, spec.generate(a, max_tokens=24, stop_token_ids=[]).token_ids)
    n = spec.state.length
    before = {k: t.clone() for k, t in spec.state.rows(n).items()}
    spec.generate(b, max_tokens=4, stop_token_ids=[])  # a's state goes to the device tier
    spec.cache.restore(spec.cache.best(list(spec.cache.entries[0].tokens))[0], n, spec.state)
    for name, t in spec.state.rows(n).items():
        assert torch.equal(t.clone().view(torch.uint8), before[name].view(torch.uint8)), name


def snapshot_engine(tmp_path, **kw):
    return Engine.from_pretrained(max_sequences=1, mode="ddtree", budget=8, max_ctx=256, kv_type="q8_0", v_type="q4_0",
                                  cache_min_tokens=8, **kw)


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_snapshots_of_a_quantized_cache_restore_bit_for_bit_from_every_tier(tmp_path, tier):
    budgets = {"device": {}, "host": dict(prefix_cache_slots=0),
               "disk": dict(prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))}[tier]
    eng = snapshot_engine(tmp_path, **budgets)
    a, b = PROMPTS
    first = eng.generate(a, max_tokens=10, stop_token_ids=[])
    n = eng.state.length
    before = {k: t.clone() for k, t in eng.state.rows(n).items()}
    assert {"tk", "tv", "tk_scale", "tv_scale", "dk", "dv"} == set(before)
    assert before["tk"].dtype == torch.int8 and before["tv"].dtype == torch.uint8
    eng.generate(b, max_tokens=4, stop_token_ids=[])  # overwrites the live rows; a's go to a tier
    assert eng.cache.stats()[tier]["entries"] == 1
    eng.cache.restore(eng.cache.best(a + first.token_ids)[0], n, eng.state)
    after = eng.state.rows(n)
    for name, t in before.items():
        assert torch.equal(after[name].clone().view(torch.uint8), t.view(torch.uint8)), name
    assert eng.cache.stats()[tier]["hits"] == 1


def test_a_disk_file_of_another_kv_type_is_not_loaded(tmp_path):
    eng = snapshot_engine(tmp_path, prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path))
    eng.generate(PROMPTS[0], max_tokens=4, stop_token_ids=[])
    eng.generate(PROMPTS[1], max_tokens=4, stop_token_ids=[])
    assert eng.cache.stats()["disk"]["entries"] == 1
    same = snapshot_engine(tmp_path, cache_dir=str(tmp_path))
    assert same.cache.stats()["disk"]["entries"] == 1
    other = Engine.from_pretrained(max_sequences=1, mode="ddtree", budget=8, max_ctx=256, kv_type="q4_0", cache_dir=str(tmp_path))
    assert other.cache.stats()["disk"]["entries"] == 0
    other_draft = snapshot_engine(tmp_path, cache_dir=str(tmp_path), draft_kv_type="q8_0")
    assert other_draft.cache.stats()["disk"]["entries"] == 0


def test_snapshots_of_a_quantized_draft_cache_restore_bit_for_bit_from_disk(tmp_path):
    eng = snapshot_engine(tmp_path, prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path),
                          draft_kv_type="q4_0")
    a, b = PROMPTS
    first = eng.generate(a, max_tokens=10, stop_token_ids=[])
    n = eng.state.length
    before = {k: t.clone() for k, t in eng.state.rows(n).items()}
    assert before["dk"].dtype == before["dv"].dtype == torch.uint8 and {"dk_scale", "dv_scale"} < set(before)
    eng.generate(b, max_tokens=4, stop_token_ids=[])
    restarted = snapshot_engine(tmp_path, prefix_cache_slots=0, host_cache_bytes=0, cache_dir=str(tmp_path),
                                draft_kv_type="q4_0")  # a new process's engine reads the file
    assert restarted.cache.stats()["disk"]["entries"] >= 1
    restarted.cache.restore(restarted.cache.best(a + first.token_ids)[0], n, restarted.state)
    for name, t in restarted.state.rows(n).items():
        assert torch.equal(t.clone().view(torch.uint8), before[name].view(torch.uint8)), name
    assert restarted.generate(a + first.token_ids, max_tokens=6, stop_token_ids=[]).token_ids == \
        eng.generate(a + first.token_ids, max_tokens=6, stop_token_ids=[]).token_ids


def test_oom_with_a_quantized_cache_loses_the_cache_not_the_request(tmp_path):
    a, b = PROMPTS
    ref = snapshot_engine(tmp_path)
    want = {name: ref.generate(p, max_tokens=10, stop_token_ids=[]).token_ids for name, p in (("a", a), ("b", b))}
    ref.clear_caches()
    want["a"] = ref.generate(a, max_tokens=10, stop_token_ids=[]).token_ids
    eng = snapshot_engine(tmp_path, host_cache_bytes=0)
    eng.generate(a, max_tokens=10, stop_token_ids=[])
    eng.generate(b, max_tokens=10, stop_token_ids=[])  # a snapshotted on the device
    faults.configure("verify:oom:2")
    with pytest.raises(EngineOutOfMemory):
        eng.generate(a, max_tokens=10, stop_token_ids=[])  # b snapshotted, a restored, then the fault
    assert eng.cache.stats()["device"]["entries"] == 0
    faults.configure("snapshot_restore:oom:1")
    eng.generate(b, max_tokens=10, stop_token_ids=[])
    faults.configure("")
    assert eng.generate(a, max_tokens=10, stop_token_ids=[]).token_ids == want["a"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FLASHTREE_FAULTS"}
    return subprocess.run([sys.executable, "-m", "flashtree.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**env, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # a CLI process loading torch and the pair: 15 s
def test_generate_cli_with_a_q4_0_cache(tiny_pair):
    r = cli("generate", "--kv-type", "q4_0", "--v-type", "q8_0", "--prompt", "hello", "--max-tokens", "8",
            "--max-ctx", "128", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"] and out["finish_reason"] in ("stop", "length")
    for args, word in ((("--kv-type", "q3"), "kv-type"), (("--target", str(tiny_pair[0]), "--kv-type", "q8_0"),
                                                         "head_dim")):  # the tiny target's head_dim is 16
        bad = cli("generate", *args, "--prompt", "x", "--max-tokens", "1")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert word in bad.stderr.strip().splitlines()[-1]  # argparse's usage may come before it


@pytest.mark.parametrize("kind", ["fp8", "q4_0"])
def test_the_benchmark_fills_a_quantized_cache_with_the_codes_of_random_rows(kind):
    from flashtree.bench.measure import random_rows

    cache = KVCache(2, 64, 2, 64, torch.bfloat16, "cpu", kind, "q8_0")
    random_rows(cache)
    for side in cache.layer(1):
        values = dequantize_kv(side.rows, torch.float32)
        assert torch.isfinite(values).all() and 0.8 < values.std().item() < 1.2


def test_a_server_with_a_quantized_cache_answers_as_the_engine_does(tmp_path):
    """serve takes the flags through to its worker: the openai SDK's greedy completion is the
    in-process engine's with the same KV types, and a snapshot's bytes are rows of that cache."""
    from serve_harness import Server

    a, b = PROMPTS[0] * 3, PROMPTS[1]
    eng = Engine.from_pretrained(max_sequences=1, max_ctx=1024, kv_type="q4_0", v_type="q8_0")
    srv = Server(None, None, tmp_path / "server.log", "--kv-type", "q4_0", "--v-type", "q8_0", "--max-sequences", "1")
    try:
        got = srv.client().completions.create(model="x", prompt=a, max_tokens=16, temperature=0)
        srv.client().completions.create(model="x", prompt=b, max_tokens=4, temperature=0)  # a is snapshotted
        device = srv.get("/props").json()["prefix_cache"]["tiers"]["device"]
    finally:
        srv.stop()
    want = eng.generate(a, max_tokens=16)
    assert got.choices[0].text == eng.tokenizer.decode(want.token_ids)
    rows, rest = divmod(device["bytes"], eng.state.bytes_per_token())
    assert device["entries"] == 1 and rest == 0 and len(a) <= rows <= len(a) + 16


@pytest.mark.parametrize("dtype,k_scale", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.float16)])
def test_a_bfloat16_models_q4_0_cache_keeps_bfloat16_scales(dtype, k_scale):
    """kv_storage.scale_dtype: a bfloat16 model's q4_0 scales in bfloat16, every other (q8_0's,
    a float16 or float32 model's) in float16; rows stored through the cache are quantize_kv's at that dtype, and the
    cache's layout (the disk tier's fingerprint) names it, so a file of the other dtype is
    another layout's."""
    from flashtree.kernels.kv_storage import scale_dtype, store_kv

    cache = KVCache(2, 64, 2, 64, dtype, "cpu", "q4_0", "q8_0")
    scales = {name: t.dtype for name, t in cache.pool.tensors.items() if name.endswith("_scale")}
    assert scales == {"k_scale": k_scale, "v_scale": torch.float16}
    assert scale_dtype("q4_0", dtype) == k_scale and scale_dtype("q8_0", dtype) == torch.float16
    x = (torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0)) * 300).to(dtype)
    k, _ = cache.layer(1)
    store_kv(k, torch.arange(5), x)
    codes, scale = quantize_kv(x, "q4_0", k_scale)
    assert scale.dtype == k_scale
    assert torch.equal(cache.pool.tensors["k"][1][:5], codes) and torch.equal(cache.pool.tensors["k_scale"][1][:5],
                                                                                 scale)
    assert ("k_scale", str(k_scale), (2, 2)) in cache.layout()[3]
