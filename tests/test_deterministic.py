"""The deterministic mode (--deterministic): its kernels, run by Triton's CPU interpreter on float32
tensors, give a row the same bits whatever rows come with it; and the mode refuses what it cannot
promise. tests/test_gpu_deterministic.py checks the same on the GPU, compiled, and the engine's
greedy outputs across the prefix cache, chunk sizes and decode modes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import ROW_INVARIANT_DOT, run_interpreted

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from flashtree.kernels import set_deterministic
    from flashtree.kernels.attention import reference_attention
    from flashtree.kernels.quant import quant_linear
    from flashtree.kernels.reference import quant_linear as reference_quant_linear
    from flashtree.kernels.attention_launch import deterministic_plan
    from flashtree.kernels.triton_attention import MODE_CAUSAL, MODE_MASK, attention
    from flashtree.kernels.triton_invariant import invariant_linear
    from flashtree.models.quant import QuantizedLinear
    from flashtree.runtime.ddtree import build_tree

    set_deterministic(True)
    torch.manual_seed(0)
    out = {}

    def same_rows(fn, x):  # each row's bits whatever rows come with it: all at once, alone, 23 at a time
        whole = fn(x)
        alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
        tree = torch.cat([fn(x[i:i + 23]) for i in range(0, x.shape[0], 23)])
        return bool(torch.equal(whole, alone) and torch.equal(whole, tree)), whole

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    x = torch.randn(70, 2048)
    w = torch.randn(96, 2048) / 45
    bias = torch.randn(96)
    out["dense rows"], y = same_rows(lambda r: invariant_linear(r, w, bias), x)
    out["dense error"] = rel(y, x @ w.T + bias)
    for bits in (4, 8):
        layer = QuantizedLinear.from_float(w, bits, 128)
        args = (layer.codes, layer.scale, layer.minimum, None, bits, 128)
        out[f"int{bits} rows"], y = same_rows(lambda r: quant_linear(r, *args), x)
        out[f"int{bits} error"] = rel(y, reference_quant_linear(x, *args))

    # attention: 2 KV heads of 4 query heads, 64 dims, a cache of 2300 rows (splits of 1024 keys)
    heads, kvh, dim, cap = 8, 2, 64, 2300
    k = torch.randn(cap, kvh, dim)
    v = torch.randn_like(k)
    q = torch.randn(cap, heads, dim)
    scale = dim ** -0.5
    assert deterministic_plan(66, dim, cap)["seq"] == 1 and deterministic_plan(23, dim, cap)["seq"] == 0

    def attend(start, t, mask=None):  # tokens [start, start + t) over the rows before them
        length = torch.tensor([start], dtype=torch.int32)
        m = mask.view(torch.uint8) if mask is not None else None
        return attention(q[start:start + t], k, v, length, scale, MODE_MASK if mask is not None else MODE_CAUSAL, m,
                         None)

    base = 2150
    chunk = attend(base, 66)  # a prefill chunk: one program walks every split (SEQ)
    out["attention error"] = rel(chunk, reference_attention(q[base:base + 66], k, v, base, scale, None, True, None))
    pieces = torch.cat([attend(base, 30), attend(base + 30, 36)])  # two chunks of a decode step's size
    steps = torch.cat([attend(base + i, 1) for i in range(60, 66)])  # AR steps: split + merge
    out["attention chunks"] = bool(torch.equal(chunk, pieces))
    out["attention steps"] = bool(torch.equal(chunk[60:], steps))
    # a chain of 5 tokens verified as a tree (its mask the chain's) gives the causal rows' bits
    logp = torch.log_softmax(torch.randn(4, 50), -1).sort(-1, descending=True)
    chain = build_tree(1, logp.values, logp.indices, 4, True, 4).ancestor_mask()
    out["chain tree is causal"] = bool(chain.tril().equal(chain) and chain.all(0).tolist() == [True] + [False] * 4
                                       and chain.sum().item() == 15)
    out["attention tree"] = bool(torch.equal(attend(base + 61, 5, chain), chunk[61:66]))
    # branching trees (one row block; two, a path's nodes in both): each node's row equals an AR
    # step's over its ancestors laid out in order
    same = []
    for budget in (12, 19):
        logp = torch.log_softmax(torch.randn(6, 50) / 0.3, -1).sort(-1, descending=True)
        tree = build_tree(1, logp.values, logp.indices, budget, False, 6)
        mask = tree.ancestor_mask()
        nodes = budget + 1
        out[f"tree {nodes} branches"] = bool((mask.sum(1) < torch.arange(1, nodes + 1)).any())
        # a node of the first row block (16 tokens of 4 rows) whose children all lie in the next:
        # its path ends in the first block's passes and goes on in the second's
        out[f"tree {nodes} path crosses blocks"] = any(kids and all(c >= 16 for c in kids.values())
                                                       for node, kids in enumerate(tree.children()) if node < 16)
        got = attend(base, nodes, mask)
        out[f"tree {nodes} error"] = rel(got, reference_attention(q[base:base + nodes], k, v, base, scale, mask, False,
                                                                  None))
        for node in range(nodes):
            path = mask[node].nonzero().flatten()  # ancestors-and-self in node order: by depth
            k2, v2, q2 = k.clone(), v.clone(), q.clone()
            k2[base:base + len(path)], v2[base:base + len(path)] = k[base + path], v[base + path]
            q2[base + len(path) - 1] = q[base + node]
            step = attention(q2[base + len(path) - 1:base + len(path)], k2, v2,
                             torch.tensor([base + len(path) - 1], dtype=torch.int32), scale, MODE_CAUSAL, None, None)
            same.append(bool(torch.equal(step, got[node:node + 1])))
    out["tree rows are AR rows"] = same
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def found() -> dict:
    return run_interpreted(ROW_INVARIANT_DOT + SCRIPT, threads=2)


@pytest.mark.slow  # the interpreted script: about a minute
def test_dense_and_quantized_rows_do_not_follow_the_rows_beside_them(found: dict) -> None:
    assert found["dense rows"] is True and found["int4 rows"] is True and found["int8 rows"] is True
    assert found["dense error"] < 1e-5, found
    assert found["int4 error"] < 1e-5 and found["int8 error"] < 1e-5, found


@pytest.mark.slow  # the interpreted script: about a minute
def test_attention_rows_are_the_same_in_a_chunk_a_step_and_a_tree(found: dict) -> None:
    assert found["attention error"] < 1e-5, found
    assert found["chain tree is causal"] is True
    assert found["attention chunks"] is True
    assert found["attention steps"] is True
    assert found["attention tree"] is True
    for nodes in (13, 20):  # 20 tokens of 4 rows: two row blocks
        assert found[f"tree {nodes} branches"] is True and found[f"tree {nodes} error"] < 1e-5, found
    assert found["tree 20 path crosses blocks"] is True
    assert all(found["tree rows are AR rows"]), found["tree rows are AR rows"]


def test_the_mode_refuses_the_cpu_path_by_name() -> None:
    from flashtree.errors import ConfigError
    from flashtree.kernels import deterministic
    from flashtree.runtime.engine import Engine

    with pytest.raises(ConfigError, match="--deterministic runs the Triton kernels: it needs a CUDA device"):
        Engine.from_pretrained(mode="ar", max_ctx=256, deterministic=True)
    assert deterministic() is False


ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import torch
    sys.path.insert(0, "tests")
    from test_sequences import side_by_side
    from tiny_models import make_draft, make_target
    from flashtree import Engine
    from flashtree.runtime import faults
    from flashtree.runtime.sampling import SamplingParams

    root = Path(tempfile.mkdtemp())
    arch, paths = sys.argv[1], sys.argv[2]
    target = make_target(root / "target", arch=arch, layers=4)
    draft = make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 3])
    prompt = torch.randint(5, 300, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}

    def engine(**kw):
        return Engine.from_pretrained(str(target), str(draft), device="cpu", dtype="float32", max_ctx=256,
                                      deterministic=True, **{"max_sequences": 1, **kw})

    def run(eng, prompt, n=8):  # greedy tokens and each one's logprob, to the bit
        res = eng.generate(prompt, SamplingParams(logprobs=0), max_tokens=n, stop_token_ids=[])
        return res.token_ids, [lp[0] for lp in res.logprobs]

    ar = engine(mode="ar")
    runs["ar"] = tokens, logprobs = run(ar, prompt)
    shared = None
    if paths == "prefill":
        runs["ar, repeated"] = run(ar, prompt)  # the live sequence's rows, reused
        ar.clear_caches()
        faults.configure("prefill:oom:1")  # the prompt again, in halved chunks after an out-of-memory
        runs["ar, out of memory"] = run(ar, prompt)
        faults.configure("")
        chunked = engine(mode="ar", prefill_ubatch=16)
        runs["ar ubatch 16"] = run(chunked, prompt)
        runs["ar ubatch 16, repeated"] = run(chunked, prompt)
    elif paths == "ddtree":
        tree = engine(mode="ddtree", budget=6)
        runs["ddtree 6"] = run(tree, prompt)
        runs["ddtree 6, repeated"] = run(tree, prompt)
        extended = run(tree, prompt + tokens[:4], 4)
        runs["ddtree 6, extended"] = (tokens[:4] + extended[0], logprobs[:4] + extended[1])
    else:  # beside another request: each ddtree step verifies both sequences' trees in one forward
        both = engine(mode="ddtree", budget=6, max_sequences=2)
        other = prompt[::-1][:50]
        streams = [both.stream(p, SamplingParams(logprobs=0), max_tokens=8, stop_token_ids=[])
                   for p in (prompt, other)]
        assert not side_by_side(streams)[1]
        res = streams[0].result
        runs["ddtree 6, beside another request"] = (res.token_ids, [lp[0] for lp in res.logprobs])
        shared = res.stats.shared_steps
    print(json.dumps({"runs": runs, "shared_steps": shared}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("paths", ["prefill", "ddtree", "beside"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_tokens_and_logprobs_are_the_same_bits_in_every_path(arch: str, paths: str) -> None:
    """The engine in the mode, its kernels under the interpreter: a tiny pair's greedy tokens and
    their logprobs, to the bit, against AR's whatever the decode mode, the prefill chunks (a chunk
    of 64 rows or more walks its attention splits in one program; smaller ones split and merge), a
    reused prefix, an extended prompt, an out-of-memory retry, or another request sharing its
    steps. The paths run in three scripts, each under run_interpreted's time limit."""
    found = run_interpreted(ROW_INVARIANT_DOT + ENGINE_SCRIPT, arch, paths, threads=2)
    runs = found["runs"]
    if paths == "beside":
        assert found["shared_steps"] >= 2, "the request beside another shared its verify forwards"
    reference = runs.pop("ar")
    assert len(reference[0]) == 8 and len(set(reference[0])) > 1
    assert len(runs) >= 1
    for name, got in runs.items():
        assert got == reference, name


def test_the_memory_plan_counts_the_modes_partials() -> None:
    """The fixed launches' split-K partials are a plan item: the largest linear's (a 27B's down
    projection, 17,408 inputs in 17 runs of 1,024, 5,120 outputs) for 128 rows in float32."""
    from flashtree.checkpoint.presets import draft_config, target_config
    from flashtree.config import EngineConfig
    from flashtree.models.dflash import DraftConfig
    from flashtree.models.loader import target_config as parse_target
    from flashtree.runtime.memory_plan import planner

    lm = parse_target(target_config("qwen3.5-27b"))
    draft = DraftConfig.from_hf(draft_config("qwen3.5-27b"))
    plan_for = planner(lm, draft, torch.bfloat16, "cuda", "int4", None)
    base = EngineConfig(max_ctx=8192, max_sequences=1, quantize="int4")
    off, on = plan_for(base), plan_for(EngineConfig(**{**vars(base), "deterministic": True}))
    partials = dict(on.items)["deterministic kernels' partials"]
    assert partials == 128 * 5120 * 17 * 4
    assert on.total - off.total == partials and "deterministic kernels' partials" not in dict(off.items)


def test_cuda_launches_in_the_mode_compile_without_fused_multiply_adds(monkeypatch):
    """What fusion Triton applies follows the code around `a * b + c`, so the same row rounded
    differently in attention's masked and unmasked key blocks on the H200: every CUDA launch in
    the mode asks for plain multiplies and adds, PDL or not; the default mode keeps fusion."""
    from flashtree.kernels import set_deterministic, triton_pdl

    monkeypatch.setattr(triton_pdl, "_pdl_on", lambda index: True)
    cuda = torch.device("cuda", 0)
    try:
        set_deterministic(True)
        assert triton_pdl.launch_options(cuda) == dict(PDL=True, launch_pdl=True, enable_fp_fusion=False)
        with triton_pdl.pdl_off():
            assert triton_pdl.launch_options(cuda) == dict(PDL=False, enable_fp_fusion=False)
        assert triton_pdl.launch_options(torch.device("cpu")) == dict(PDL=False)  # the interpreter adds in order
    finally:
        set_deterministic(False)
    assert "enable_fp_fusion" not in triton_pdl.launch_options(cuda)
