"""The deterministic mode on the GPU: compiled in bf16, its kernels give a row the same bits
whatever rows come with it, and the engine's greedy output (the embedded pair, random-token
prompts, whose flat distributions make near-ties common) is bit-identical whatever the prefix
cache held, the prefill chunk sizes, an out-of-memory fallback, the decode mode, and another
request sharing its decode steps."""

from __future__ import annotations

import pytest
import torch

from flashtree.kernels import set_deterministic
from flashtree.kernels.kv_storage import QuantRows, quantize_kv
from flashtree.kernels.triton_attention import MODE_CAUSAL, MODE_MASK, attention
from flashtree.kernels.triton_invariant import invariant_linear
from flashtree.models.quant import QuantizedLinear
from flashtree.runtime import faults
from flashtree.runtime.ddtree import build_tree
from test_sequences import side_by_side

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture
def det_mode():
    set_deterministic(True)
    yield
    set_deterministic(False)


def same_rows(fn, x: torch.Tensor) -> bool:
    """A row's bits whatever rows come with it: all at once, one at a time, a tree's 23."""
    whole = fn(x)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    tree = torch.cat([fn(x[i:i + 23]) for i in range(0, x.shape[0], 23)])
    return bool(torch.equal(whole, alone) and torch.equal(whole, tree))


@pytest.mark.parametrize("rows", [70, 600])
def test_linears_give_each_row_the_same_bits(det_mode, rows):
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, 4096, device=DEV, generator=g).bfloat16()
    w = (torch.randn(1536, 4096, device=DEV, generator=g) / 64).bfloat16()
    assert same_rows(lambda r: invariant_linear(r, w, None), x)
    ref = x.float() @ w.float().T
    assert ((invariant_linear(x, w, None).float() - ref).norm() / ref.norm()).item() < 1e-2
    for bits in (4, 8):
        layer = QuantizedLinear.from_float(w, bits, 128)
        if bits == 4:
            layer.tile_()  # as the engine holds int4 on CUDA
        assert same_rows(layer, x), bits


@pytest.mark.parametrize("heads,kvh,dim,kind", [(32, 8, 128, None), (24, 4, 256, "q4_0")])
def test_attention_rows_are_the_same_in_a_chunk_a_step_and_a_tree(det_mode, heads, kvh, dim, kind):
    cap, base = 9000, 8200
    g = torch.Generator(device=DEV).manual_seed(dim)
    k = torch.randn(cap, kvh, dim, device=DEV, generator=g).bfloat16()
    v = torch.randn(cap, kvh, dim, device=DEV, generator=g).bfloat16()
    q = torch.randn(cap, heads, dim, device=DEV, generator=g).bfloat16()
    if kind is not None:
        k, v = (QuantRows(kind, *quantize_kv(x, kind)) for x in (k, v))

    def attend(start, t, mask=None):
        length = torch.tensor([start], dtype=torch.int32, device=DEV)
        return attention(q[start:start + t], k, v, length, dim ** -0.5, MODE_MASK if mask is not None else MODE_CAUSAL,
                         mask.view(torch.uint8) if mask is not None else None, None)

    chunk = attend(base, 512)  # a prefill chunk; then the same rows in chunks of 37, and as AR steps
    assert torch.equal(chunk, torch.cat([attend(base + i, min(37, 512 - i)) for i in range(0, 512, 37)]))
    assert torch.equal(chunk[500:], torch.cat([attend(base + i, 1) for i in range(500, 512)]))
    logp = torch.log_softmax(torch.randn(22, 50), -1).sort(-1, descending=True)
    chain = build_tree(1, logp.values, logp.indices, 22, True, 22).ancestor_mask().to(DEV)
    assert torch.equal(chain, torch.ones_like(chain).tril())  # a chain: the causal mask
    assert torch.equal(attend(base + 489, 23, chain), chunk[489:512])
    # a branching tree: each node's row is, to the bit, the AR step's over its ancestors in order
    logp = torch.log_softmax(torch.randn(8, 50) / 0.3, -1).sort(-1, descending=True)
    mask = build_tree(1, logp.values, logp.indices, 22, False, 8).ancestor_mask().to(DEV)
    assert (mask.sum(1) < torch.arange(1, 24, device=DEV)).any()
    got = attend(base, 23, mask)
    for node in range(23):
        path = mask[node].nonzero().flatten()
        q2 = q.clone()
        if kind is None:
            k2, v2 = k.clone(), v.clone()
            k2[base:base + len(path)], v2[base:base + len(path)] = k[base + path], v[base + path]
        else:  # quantized rows move with their scales
            k2, v2 = (QuantRows(kind, x.codes.clone(), x.scale.clone()) for x in (k, v))
            for side, src in ((k2, k), (v2, v)):
                side.codes[base:base + len(path)] = src.codes[base + path]
                side.scale[base:base + len(path)] = src.scale[base + path]
        at = base + len(path) - 1
        q2[at] = q[base + node]
        step = attention(q2[at:at + 1], k2, v2, torch.tensor([at], dtype=torch.int32, device=DEV), dim ** -0.5,
                         MODE_CAUSAL, None, None)
        assert torch.equal(step, got[node:node + 1]), node


def random_prompts(low: int, high: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lengths]


def greedy(engine, prompt, n=48):
    return engine.generate(prompt, max_tokens=n, stop_token_ids=[]).token_ids


def same_bits_whatever_the_cache_chunks_faults_and_mode(target, draft, prompts, max_ctx, tokens=48):
    """The engine in the mode on the GPU in bf16 (target and draft directories, None: the embedded pair): each
    prompt's `tokens` greedy tokens cold, repeated exactly (the prefix cache's hit), extended by its first
    ten tokens, after an out-of-memory in prefill (AR), with 37-token prefill chunks, in chain and
    ddtree at two budgets, and beside the other prompt in shared ddtree steps, all the AR run's."""
    from flashtree.runtime.engine import Engine

    found = {}
    runs = [dict(mode="ar"), dict(mode="ar", prefill_ubatch=37), dict(mode="chain"),
            dict(mode="ddtree", budget=8), dict(mode="ddtree", budget=22)]
    for run in runs:
        engine = Engine.from_pretrained(target, draft, device="cuda", dtype="bfloat16", max_ctx=max_ctx,
                                        max_sequences=1, deterministic=True, **run)
        name = ",".join(f"{k}={v}" for k, v in run.items())
        for i, prompt in enumerate(prompts):
            cold = greedy(engine, prompt, tokens)
            found[(name, i, "cold")] = cold
            found[(name, i, "repeat")] = greedy(engine, prompt, tokens)  # the prefix cache's exact hit
            found[(name, i, "extended")] = greedy(engine, prompt + cold[:10], tokens - 10)
            if run == runs[0]:  # an out-of-memory in prefill: the prompt again, cold, in smaller chunks
                engine.clear_caches()
                faults.configure("prefill:oom:1")
                try:
                    found[(name, i, "oom")] = greedy(engine, prompt, tokens)
                finally:
                    faults.configure("")
        engine.close()
        del engine
        torch.cuda.empty_cache()
    # both prompts at once: their ddtree steps verify both trees in one forward
    engine = Engine.from_pretrained(target, draft, device="cuda", dtype="bfloat16", max_ctx=max_ctx,
                                    max_sequences=2, deterministic=True, mode="ddtree", budget=22)
    streams = [engine.stream(p, max_tokens=tokens, stop_token_ids=[]) for p in prompts]
    assert not side_by_side(streams)[1]
    assert min(s.result.stats.shared_steps for s in streams) >= 2
    for i, s in enumerate(streams):
        found[("shared", i, "cold")] = s.result.token_ids
    engine.close()
    for i in range(len(prompts)):
        ref = found[("mode=ar", i, "cold")]
        assert len(set(ref)) > 5  # not a degenerate repetition
        for (name, j, how), tokens in found.items():
            if j == i:
                want = ref[10:] if how == "extended" else ref
                assert tokens == want, (name, i, how)


def test_greedy_output_is_the_same_whatever_the_cache_chunks_faults_and_mode():
    """The embedded pair on random-token prompts (flat distributions: near-ties everywhere)."""
    same_bits_whatever_the_cache_chunks_faults_and_mode(None, None, random_prompts(100, 8000, (3000, 12000)), 16384)


def test_a_random_hybrid_pair_gives_the_same_bits_whatever_the_cache_chunks_faults_and_mode(tmp_path):
    """The same on a random Gated DeltaNet hybrid target (tests/tiny_models.py, 256 wide) and its
    random draft: the recurrent state's snapshots, folds and tree scans in the mode."""
    from tiny_models import make_draft, make_target

    target = make_target(tmp_path / "target", arch="qwen3_5", layers=4, hidden=256)
    draft = make_draft(tmp_path / "draft", target, block_size=16, layers=1, target_layer_ids=[1, 3])
    prompts = random_prompts(10, 390, (3000, 6000))  # the tiny vocabulary of 400, past its special tokens
    same_bits_whatever_the_cache_chunks_faults_and_mode(str(target), str(draft), prompts, 8192)


@pytest.mark.parametrize("preset", ["qwen3-1.7b", "qwen3.5-4b"])
def test_a_random_dense_and_hybrid_target_give_the_same_bits_in_every_mode_and_chunking(det_mode, preset):
    """Random-weight presets in bf16 (flat distributions: near-ties everywhere), dense and hybrid:
    the greedy tokens of AR over one prefill, AR over 37-token prefill chunks, chain and ddtree at
    two budgets are the same, with no tie allowed."""
    from flashtree.bench.models import build_pair
    from flashtree.models.deterministic import make_deterministic
    from test_gpu_decode import greedy as decoder_greedy, make

    pair = build_pair(preset, DEV, max_pos=4096, seed=0, head_std=0.05)
    assert make_deterministic(pair.target, DEV, torch.bfloat16) > 0  # as the engine's load does
    prompt = torch.randint(100, pair.target.config.vocab_size - 100, (1000,),
                           generator=torch.Generator().manual_seed(5)).tolist()

    found = {}
    for name, mode, budget, chunk in (("ar", "ar", 22, len(prompt)), ("ar, chunks of 37", "ar", 22, 37),
                                      ("chain", "chain", 22, len(prompt)), ("ddtree 8", "ddtree", 8, 512),
                                      ("ddtree 22", "ddtree", 22, len(prompt))):
        found[name] = decoder_greedy(make(pair, mode, budget=budget), prompt, 48, chunk)[0]
        torch.cuda.empty_cache()
    reference = found.pop("ar")
    assert len(set(reference)) > 5  # not a degenerate repetition
    for name, tokens in found.items():
        assert tokens == reference, name
