"""The hybrid (Gated DeltaNet) path on the GPU, on a random bf16 model of the `qwen3.5-4b` shape:
the Triton delta-rule kernels against their float32 definitions, CUDA graphs against direct
calls, and greedy ddtree / chain against greedy AR for 128 tokens (or a first divergence where
the float32 model itself sees a bf16 tie, or the gap is within the bf16 model's own error)."""

import pytest
import torch

from flashtree.bench.models import build_pair
from flashtree.kernels import gated_delta
from flashtree.kernels.gated_delta import TreeIndex, gated_delta_fold, gated_delta_rule
from flashtree.kernels.reference import gated_delta_fold as ref_fold
from flashtree.kernels.reference import gated_delta_rule as ref_rule
from test_gpu_decode import greedy, make, same_or_tie

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
N = 128


@pytest.fixture(scope="module")
def pair():
    """The random pair this module's `ref32` and `prompt` fixtures (conftest.py) are built from."""
    return build_pair("qwen3.5-4b", DEV, max_pos=4096, seed=0, head_std=0.05)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.inference_mode()
@pytest.mark.parametrize("tree", [None, [-1, 0, 1, 1, 0, 4, 5, 2, 7, 8, 8, 3]])
def test_delta_rule_kernel_matches_definition(tree, monkeypatch):
    """Our scan (fla-core's chunked prefill kernel is left out here: test_gpu_hybrid_kernels.py)."""
    monkeypatch.setattr(gated_delta, "CHUNKED_MIN_ROWS", 10 ** 9)
    g = torch.Generator(device=DEV).manual_seed(1)
    t, h, dk, dv = (len(tree) if tree else 300), 48, 128, 128
    q, k = (torch.nn.functional.normalize(torch.randn(t, h, dk, device=DEV, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(t, h, dv, device=DEV, generator=g)
    gate, beta = -torch.rand(t, h, device=DEV, generator=g), torch.rand(t, h, device=DEV, generator=g)
    s0 = torch.randn(h, dk, dv, device=DEV, generator=g) * 0.1
    index = TreeIndex.build(tree, 4, DEV) if tree else None
    out, final = gated_delta_rule(q, k, v, gate, beta, s0, index)
    ref_out, ref_final = ref_rule(q, k, v, gate, beta, s0, index.parents if index else None)
    assert rel(out, ref_out) < 1e-5
    if tree is None:
        assert rel(final, ref_final) < 1e-5
    path = torch.tensor([0, 1, 2, 7, 8, 10], device=DEV) if tree else torch.arange(t, device=DEV)
    folded = gated_delta_fold(s0, k[path], v[path], gate[path], beta[path])
    assert rel(folded, ref_fold(s0, k[path], v[path], gate[path], beta[path])) < 1e-5


@torch.inference_mode()
def test_graphs_match_direct_calls(pair, prompt, ref32):
    graphs, direct = make(pair, "ddtree", graphs=True), make(pair, "ddtree", graphs=None)
    a, acc_a = greedy(graphs, prompt, 48)
    b, acc_b = greedy(direct, prompt, 48)
    assert same_or_tie(ref32, prompt, a, b)


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_equals_ar(pair, prompt, ref32, mode):
    ar, _ = greedy(make(pair, "ar"), prompt, N)
    spec, _ = greedy(make(pair, mode), prompt, N)
    assert len(spec) == N
    assert same_or_tie(ref32, prompt, ar, spec, model=pair.target)


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_greedy_spec_equals_ar_with_a_quantized_cache(pair, prompt, ref32, kv):
    """The gated attention layers store a quantized cache in their fused kernel: a tree verify
    and an AR step store and read the rows alike, so greedy ddtree / chain equal greedy AR on the
    same KV type (or part at a bf16 tie)."""
    ar, _ = greedy(make(pair, "ar", kv=kv), prompt, N)
    for mode in ("ddtree", "chain"):
        spec, _ = greedy(make(pair, mode, kv=kv), prompt, N)
        assert len(spec) == N
        assert same_or_tie(ref32, prompt, ar, spec, kv, model=pair.target), mode


@torch.inference_mode()
def test_a_batch_of_trees_scans_in_one_launch_with_the_bits_of_one_each(pair, monkeypatch):
    """Three sequences' trees through one forward (as a shared verify phase runs them): with the
    DeltaNet layers and attention one launch for all (models/inputs.py AT_ONCE) the hidden states
    and per-node inputs are the bits of a launch a sequence, eagerly and as graphs captured each
    way and replayed after the trees' static buffers were refilled with other shapes."""
    from flashtree.models import inputs
    from flashtree.models.inputs import ForwardInput

    target = pair.target
    conv = target.config.conv_kernel
    shapes = [[[-1, 0, 0, 1, 3, 3, 0], [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 2, 3]],
              [[-1, 0, 1, 1, 0, 4, 5], [-1, 0, 0, 0, 0, 0, 0], [-1, 0, 1, 2, 2, 1, 0]]]
    g = torch.Generator(device=DEV).manual_seed(5)
    vocab = target.config.vocab_size

    def parts():
        pool, out = 3 * 1024, []
        for n in (300, 41, 777):
            cache = target.new_cache(1024, torch.bfloat16, DEV, 8, pool=pool)
            pool = cache.kv.pool
            cache.kv.ensure(n + 7)
            target(ForwardInput.prefill(torch.randint(0, vocab, (n,), device=DEV, generator=g), cache))
            cache.keep_rows(0, None)
            out.append(ForwardInput(ids=torch.zeros(7, dtype=torch.long, device=DEV), cache=cache,
                                    lengths=torch.tensor([n], dtype=torch.int32, device=DEV),
                                    positions=torch.zeros(7, dtype=torch.long, device=DEV),
                                    block_mask=torch.zeros(7, 7, dtype=torch.uint8, device=DEV),
                                    tree=TreeIndex.static(7, conv, DEV)))
        return out

    def fill(ps, trees):  # each tree into its part's static buffers
        for p, parents in zip(ps, trees):
            p.ids.copy_(torch.randint(0, vocab, (7,), device=DEV, generator=g))
            depth, mask = [], torch.zeros(7, 7, dtype=torch.uint8)
            for i, parent in enumerate(parents):
                depth.append(depth[parent] + 1 if parent >= 0 else 0)
                if parent >= 0:
                    mask[i] = mask[parent]
                mask[i, i] = 1
            p.positions.copy_(p.lengths.long() + torch.tensor(depth, device=DEV))
            p.block_mask.copy_(mask)
            p.tree.fill_(TreeIndex.build(parents, conv, DEV))

    def scratch(ps):
        return [torch.cat([getattr(p.cache, n)[:7].flatten().float()
                           for n in ("node_k", "node_v", "node_g", "node_beta", "node_conv")]) for p in ps]

    ps = parts()
    batch = ForwardInput.batch(ps)
    assert batch.scans_at_once() is not None

    def run(at_once):  # the forward's hidden states and the parts' per-node inputs
        monkeypatch.setattr(inputs, "AT_ONCE", at_once)
        hidden, _ = target(batch)
        return hidden.clone(), scratch(ps)

    def same(a, b):  # (hidden states equal, every part's per-node inputs equal)
        return torch.equal(a[0], b[0]), all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    fill(ps, shapes[0])
    assert same(run(True), run(False)) == (True, True), "eager: one launch for all against a launch each"
    graphs = {}
    for at_once in (True, False):  # each captured as a shared verify phase is, over the same buffers
        monkeypatch.setattr(inputs, "AT_ONCE", at_once)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            target(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden, _ = target(batch)
        graphs[at_once] = (graph, hidden)
    for trees in shapes:
        fill(ps, trees)
        got = {}
        for at_once, (graph, hidden) in graphs.items():
            graph.replay()
            got[at_once] = (hidden.clone(), scratch(ps))
        assert same(got[True], got[False]) == (True, True), "replays after the trees changed"
