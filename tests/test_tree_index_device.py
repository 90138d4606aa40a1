"""A hybrid target's tree scan index made on the device (kernels/tree_index.py, the Triton kernel in
kernels/triton_tree_index.py, TreeIndex.from_parents) against the host's: the tables equal
TreeIndex.build + fill_ element for element (the definition on the CPU, the kernel under the
interpreter here and compiled for sm_90, and on CUDA in the `gpu` tests), static buffers take
a device index as they take a host one, the scan gives the same outputs from either, and a
hybrid decode with device indexes emits greedy AR's tokens. On CUDA (`gpu`) the index also
reads nothing back, a graph captures it, and a hybrid step synchronises as a plain one does.
The cases are in tree_index_cases.py."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch
from interpreted import run_interpreted
from test_decoding import install_oracle
from test_hybrid import N_TOKENS, PROMPT, engine, hybrid_pair, reference  # noqa: F401
from tree_index_cases import ALL, expected, host_parents, mismatches, random_tree

from flashtree.kernels.gated_delta import TreeIndex, gated_delta_rule
from flashtree.kernels.tree_index import empty_tables, reference_tree_indexes, tree_indexes


@pytest.mark.parametrize("name", list(ALL))
def test_the_definition_equals_build_and_fill(name):
    case = ALL[name]()
    assert mismatches(reference_tree_indexes, case) == []
    parents, n_nodes, rows, conv = case
    together = reference_tree_indexes(parents, n_nodes, conv, rows)
    for row in range(parents.shape[0]):  # a tree's tables do not depend on the trees beside it
        alone = reference_tree_indexes(parents[row:row + 1], n_nodes[row:row + 1], conv, rows)
        assert torch.equal(alone.steps[0], together.steps[row])
        assert torch.equal(alone.bounds[0], together.bounds[row])


INTERPRETED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import torch
    from flashtree.kernels import use_triton
    from flashtree.kernels.gated_delta import TreeIndex, gated_delta_rule
    from flashtree.kernels.tree_index import tree_indexes
    from tree_index_cases import CASES, SLOW_CASES, best_first, host_parents, mismatches
    assert use_triton(torch.zeros(1))  # the kernels, not the definitions
    if sys.argv[1] != "scan":
        cases = SLOW_CASES if sys.argv[1] == "slow" else CASES
        print(json.dumps({name: mismatches(tree_indexes, make()) for name, make in cases.items()}))
        sys.exit(0)
    # the Triton scan from the device index and from the host's: the same outputs, bit for bit
    parents, n_nodes, rows, _ = best_first("random best-first, caps")
    g = torch.Generator().manual_seed(0)
    out = {}
    for row in range(parents.shape[0]):
        t = parents.shape[1]
        q, k = (torch.nn.functional.normalize(torch.randn(t, 2, 16, generator=g), dim=-1) for _ in range(2))
        v = torch.randn(t, 2, 16, generator=g)
        gate, beta = -torch.rand(t, 2, generator=g), torch.rand(t, 2, generator=g)
        s0 = torch.randn(2, 16, 16, generator=g)
        host = TreeIndex.build(host_parents(parents[row], int(n_nodes[row])), 4, "cpu")
        device = TreeIndex.from_parents(parents[row], n_nodes[row:row + 1], 4)
        want = gated_delta_rule(q, k, v, gate, beta, s0, host)[0]
        out[f"tree {row} direct"] = torch.equal(gated_delta_rule(q, k, v, gate, beta, s0, device)[0], want)
        for extra in (0, 3):  # static buffers of the tree's size (a copy), larger (made again in them)
            pad = lambda x: torch.cat([x, x[:extra]])
            got = {}
            for name, index in (("host", host), ("device", device)):
                static = TreeIndex.static(t + extra, 4, "cpu")
                static.fill_(index)
                got[name] = gated_delta_rule(pad(q), pad(k), pad(v), pad(gate), pad(beta), s0, static)[0]
            out[f"tree {row} static +{extra}"] = torch.equal(got["host"], got["device"])
            out[f"tree {row} static +{extra} rows"] = torch.equal(got["device"][:t], want)
    print(json.dumps(out))
""")


@pytest.mark.slow  # the index kernel under the interpreter
@pytest.mark.parametrize("which", ["fast", "slow"])
def test_the_kernel_under_the_interpreter_equals_build_and_fill(which):
    pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")
    found = run_interpreted(INTERPRETED, which, threads=1)
    assert found and all(v == [] for v in found.values()), found


@pytest.mark.slow  # the DeltaNet tree scan under the interpreter
def test_the_interpreted_scan_gives_the_same_outputs_from_either_index():
    pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")
    found = run_interpreted(INTERPRETED, "scan", threads=1)
    assert found and all(found.values()), found


def test_the_kernel_compiles_for_sm90():
    """Triton's compiler is stricter than its interpreter (the types of loop-carried values): the
    kernel compiles for the H100/H200 (ptxas included) at a 23-row and a 129-row size, and its
    register vectors stay in registers (no local memory)."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashtree.kernels.triton_tree_index import _tree_index_kernel

    types = ["*i64", "*i32", "*i32", "*i32", "*i32", "*i64", "i32", "i32", "i32"]
    for np2 in (32, 256):
        constants = {"K": 4, "KB": 4, "NP": np2}
        runtime = [n for n in _tree_index_kernel.arg_names if n not in constants]
        signature = dict(zip(runtime, types, strict=True)) | {n: "constexpr" for n in constants}
        compiled = triton.compile(ASTSource(fn=_tree_index_kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"]


def check_static(static: TreeIndex, parents: torch.Tensor, n_nodes: int) -> None:
    want = expected(parents, n_nodes, static.parents.shape[0], static.conv_rows.shape[1])
    n, s = want.n_host, want.segments_host
    assert int(static.n_segments) == s and static.bounds[:s + 1].tolist() == want.bounds[:s + 1].tolist()
    assert static.steps[:n].tolist() == want.steps[:n].tolist()
    assert torch.equal(static.conv_rows.cpu(), want.conv_rows)
    assert static.parents.tolist() == want.parents.tolist()


def test_static_buffers_take_device_and_host_indexes_alike():
    """One set of static buffers, filled in turn from host indexes, from device indexes and
    straight from device parents (fill_parents_), of trees smaller than or as large as the
    buffers (dirty from the fill before): each fill leaves what build + fill_ leaves, parents
    included (the reference scan's). A device index leaves the host counts unknown; its own
    tables are build's, over its own rows."""
    static = TreeIndex.static(16, 4, "cpu")
    for seed in range(40):
        t = 16 if seed % 4 == 0 else 1 + seed % 16
        n_nodes = max(1, t - seed % 5)
        parents = torch.tensor(random_tree(t, seed))
        host = TreeIndex.build(host_parents(parents, n_nodes), 4, "cpu")
        device = TreeIndex.from_parents(parents, torch.tensor([n_nodes], dtype=torch.int32), 4)
        assert device.parents.tolist() == host.parents.tolist() and torch.equal(device.conv_rows, host.conv_rows)
        assert device.steps[:host.n_host].tolist() == host.steps.tolist()
        assert device.bounds[:host.segments_host + 1].tolist() == host.bounds.tolist()
        assert device.n_host is None and int(device.n_segments) == host.segments_host
        if seed % 3 == 2:
            static.fill_parents_(parents, torch.tensor([n_nodes], dtype=torch.int32))
        else:
            static.fill_(host if seed % 3 == 0 else device)
        assert (static.n_host is None) == (seed % 3 != 0)
        check_static(static, parents, n_nodes)


def test_tables_given_to_write_into_must_fit():
    parents, n_nodes = torch.tensor([random_tree(5, 0)]), torch.tensor([5], dtype=torch.int32)
    good = empty_tables(1, 6, 4, "cpu")
    tree_indexes(parents, n_nodes, 4, 6, good)
    for name, bad in (("steps", good.steps[:, :-1]), ("bounds", good.bounds.long()),
                      ("conv_rows", good.conv_rows.transpose(1, 2).contiguous().transpose(1, 2)),
                      ("n_segments", good.n_segments.to("meta"))):
        with pytest.raises(ValueError, match=name):
            tree_indexes(parents, n_nodes, 4, 6, type(good)(**{**vars(good), name: bad}))
    with pytest.raises(ValueError, match="rows"):
        tree_indexes(parents, n_nodes, 4, 4)


class DeviceBuilt(TreeIndex):
    """The runtime's TreeIndex with every index made on the device from the parents: the host
    builds of chain and AR trees (and of the hybrid ddtree branch until it calls from_parents)
    go through from_parents too, from an upload of the parents the decoder holds."""
    made = 0

    @classmethod
    def build(cls, parents, conv_kernel, device):
        tensor = torch.tensor(list(parents), dtype=torch.long, device=device)
        return cls.from_parents(tensor, torch.full((1,), len(tensor), dtype=torch.int32, device=device), conv_kernel)

    @classmethod
    def from_parents(cls, parents, n_nodes, conv_kernel):
        DeviceBuilt.made += 1
        return TreeIndex.from_parents(parents, n_nodes, conv_kernel)

    @classmethod
    def static(cls, rows, conv_kernel, device):  # a graph's buffers, as ever
        return TreeIndex.static(rows, conv_kernel, device)


def use_device_indexes(monkeypatch) -> None:
    """DeviceBuilt as the TreeIndex of every runtime module that builds one (the decoder's and
    wherever its steps live)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("flashtree.runtime.") and getattr(module, "TreeIndex", None) is TreeIndex:
            monkeypatch.setattr(module, "TreeIndex", DeviceBuilt)


@pytest.mark.parametrize("mode,budget,oracle,static", [("ddtree", 22, True, False), ("ddtree", 4, False, False),
                                                       ("chain", 22, True, False), ("ddtree", 6, False, True)])
def test_greedy_spec_with_device_indexes_equals_ar(hybrid_pair, reference, monkeypatch, mode, budget, oracle, static):
    """The tree scan's node states are exact from device indexes: long accepted paths and side
    branches (the oracle, wrong at depth 3), the random draft, and the CUDA path's static
    buffers run eagerly (device indexes copied into them)."""
    use_device_indexes(monkeypatch)
    made = DeviceBuilt.made
    eng = engine(hybrid_pair, mode=mode, budget=budget, prefill_ubatch=7)
    if static:
        from test_fast_path import use_static_runner
        use_static_runner(eng, budget)
    if oracle:
        install_oracle(eng, PROMPT + reference, {3}, eng.target.config.vocab_size)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    assert res.token_ids == reference
    assert DeviceBuilt.made > made
    if oracle:
        assert res.stats.mean_accept_length > 2
    if static:
        assert any(g.tree is not None and g.tree.n_host is None for g in eng.runner.verify.values())


# ---- CUDA ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ALL))
def test_cuda_kernel_equals_build_and_fill(name):
    assert mismatches(tree_indexes, ALL[name](), "cuda") == []


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [23, 129])
def test_cuda_index_reads_nothing_back(rows):
    """from_parents, both fill_ paths and fill_parents_ with CUDA's sync check set to raise: no
    read of the device (and no copy from the host's pageable memory, which would wait too)."""
    parents = torch.tensor(random_tree(rows, 1), device="cuda")
    n_nodes = torch.tensor([rows - 3], dtype=torch.int32, device="cuda")
    same, larger = TreeIndex.static(rows, 4, "cuda"), TreeIndex.static(rows + 8, 4, "cuda")
    straight = TreeIndex.static(rows + 8, 4, "cuda")  # made, with its uploads, before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        index = TreeIndex.from_parents(parents, n_nodes, 4)
        same.fill_(index)
        larger.fill_(index)
        straight.fill_parents_(parents, n_nodes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for static in (same, larger, straight):
        check_static(static, parents.cpu(), rows - 3)


@pytest.mark.gpu
def test_cuda_graph_captures_fill_parents():
    """fill_parents_ captured once over static parents and n_nodes, replayed for other trees:
    what a captured draft phase would run to leave the verify's index ready."""
    rows, dev = 23, torch.device("cuda")
    static = TreeIndex.static(rows, 4, dev)
    parents = torch.full((rows,), -1, dtype=torch.long, device=dev)
    n_nodes = torch.ones(1, dtype=torch.int32, device=dev)
    static.fill_parents_(parents, n_nodes)  # compiles the kernel: not inside a capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.fill_parents_(parents, n_nodes)
    for seed in range(6):
        tree = torch.tensor(random_tree(rows, seed))
        parents.copy_(tree)
        n_nodes.fill_(rows - 3 * seed)
        graph.replay()
        torch.cuda.synchronize()
        check_static(static, tree, rows - 3 * seed)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [23, 129])
def test_cuda_scan_gives_the_same_outputs_from_either_index(rows):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    parents = torch.tensor(random_tree(rows, rows))
    n_nodes = rows - 2
    t, h, dk, dv = rows, 16, 128, 128
    q, k = (torch.nn.functional.normalize(torch.randn(t, h, dk, device=dev, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(t, h, dv, device=dev, generator=g)
    gate, beta = -torch.rand(t, h, device=dev, generator=g), torch.rand(t, h, device=dev, generator=g)
    s0 = torch.randn(h, dk, dv, device=dev, generator=g) * 0.1
    host = TreeIndex.build(host_parents(parents, n_nodes), 4, dev)
    device = TreeIndex.from_parents(parents.to(dev), torch.tensor([n_nodes], dtype=torch.int32, device=dev), 4)
    want = gated_delta_rule(q, k, v, gate, beta, s0, host)[0]
    assert torch.equal(gated_delta_rule(q, k, v, gate, beta, s0, device)[0], want)
    static = TreeIndex.static(t + 5, 4, dev)
    static.fill_(device)
    pad = lambda x: torch.cat([x, x[:5]])  # noqa: E731
    assert torch.equal(gated_delta_rule(pad(q), pad(k), pad(v), pad(gate), pad(beta), s0, static)[0][:t], want)


@pytest.fixture(scope="module")
def gpu_pair():
    from flashtree.bench.models import build_pair
    return build_pair("qwen3.5-4b", torch.device("cuda"), max_pos=4096, seed=0, head_std=0.05)


@torch.inference_mode()
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, None])
def test_cuda_hybrid_decode_with_device_indexes_equals_host_indexes(gpu_pair, monkeypatch, graphs):
    """The same tokens and accepted lengths, step for step, through CUDA graphs (device indexes
    copied into or made again in the static buffers) and through direct calls."""
    from test_gpu_decode import greedy, make
    prompt = torch.randint(0, gpu_pair.target.config.vocab_size - 1, (40,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    host = greedy(make(gpu_pair, "ddtree", graphs=graphs), prompt, 96)
    use_device_indexes(monkeypatch)
    made = DeviceBuilt.made
    device = greedy(make(gpu_pair, "ddtree", graphs=graphs), prompt, 96)
    assert DeviceBuilt.made > made
    assert device == host


def syncs_in_a_step(dec, builds: list) -> list[str]:
    """Where a greedy ddtree step (after two that set up what is lazy: captures, compiles)
    synchronises with the device; `builds` collects host builds of a tree index meanwhile."""
    from flashtree.runtime.sampling import Sampler, SamplingParams
    prompt = list(range(3, 43))
    sampler = Sampler(SamplingParams(), dec.target.config.vocab_size, torch.device("cuda"), prompt)
    bonus = int(dec.prefill_chunk(prompt).argmax())
    for _ in range(2):
        bonus = dec.step(bonus, sampler, 16).tokens[-1]
    torch.cuda.synchronize()
    builds.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            dec.step(bonus, sampler, 16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


@torch.inference_mode()
@pytest.mark.gpu
def test_cuda_hybrid_ddtree_step_reads_the_device_as_often_as_a_plain_one(gpu_pair, monkeypatch):
    """With the decoder's hybrid branch on from_parents, a hybrid target's ddtree step
    synchronises with the device as often as a plain (attention only) target's: its index adds
    no read and no upload. Skipped while the branch still builds the index on the host (a
    TreeIndex.build inside the step: budget 22 over a depth cap of 15 is no chain, whose index
    the host knows)."""
    from flashtree.bench.models import build_pair
    from test_gpu_decode import make
    builds: list = []
    build = TreeIndex.build.__func__
    monkeypatch.setattr(TreeIndex, "build", classmethod(lambda cls, *a: builds.append(a) or build(cls, *a)))
    hybrid = syncs_in_a_step(make(gpu_pair, "ddtree"), builds)
    if builds:
        pytest.skip("the hybrid ddtree step still builds its tree index on the host (see TreeIndex.from_parents)")
    plain = syncs_in_a_step(make(build_pair("qwen3-1.7b", torch.device("cuda"), max_pos=4096, seed=0,
                                            head_std=0.05), "ddtree"), builds)
    assert len(hybrid) == len(plain), (hybrid, plain)
