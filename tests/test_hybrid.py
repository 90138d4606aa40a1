"""Hybrid (Gated DeltaNet + gated attention) targets: equality with transformers on random
checkpoints of the text and the vision-language format, across prefill chunks; the tree scan
against separate chains; and greedy chain / ddtree decoding equal to AR."""

import json

import pytest
import torch

from flashtree import Engine
from flashtree.errors import EngineOutOfMemory
from flashtree.runtime import faults
from flashtree.runtime.decoding import warm_up_lengths
from flashtree.kernels.gated_delta import TreeIndex
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_target, read_configs
from flashtree.models.qwen35 import HybridConfig
from test_decoding import install_oracle
from tiny_models import make_draft, make_target

CPU = torch.device("cpu")
IDS = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9, 31, 200, 11, 4, 150, 77, 8]
PROMPT = IDS + [3, 19, 240, 61]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl"])
def hybrid_dir(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, layers=4)


def hf_logits(path, ids):
    import transformers
    cfg = json.loads((path / "config.json").read_text())
    cls = {"qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
           "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
           "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
           "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM}[cfg["model_type"]]
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def ours(path, max_pos=128):
    raw, cfg, _ = read_configs(path, None)
    assert isinstance(cfg, HybridConfig)
    return load_target(path, cfg, torch.float32, CPU, max_pos)


def prefill(model, ids, chunk):
    """Logits of every position, the prompt fed `chunk` tokens at a time through the state."""
    st = model.new_cache(128, torch.float32, CPU)
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        h, _ = model(ForwardInput.prefill(torch.tensor(part), st, start))
        st.keep_rows(start, None)
        out.append(model.logits(h))
    return torch.cat(out), st


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [20, 7, 1])
def test_logits_match_transformers_across_chunks(hybrid_dir, chunk):
    ref = hf_logits(hybrid_dir, IDS)
    got, _ = prefill(ours(hybrid_dir), IDS, chunk)
    assert rel_err(got, ref) < 1e-4


@torch.inference_mode()
def test_tree_nodes_get_their_own_paths_state(hybrid_dir):
    """One forward over a tree gives every node the logits of its own root path, and keeps the
    node's recurrent state: the state of an accepted node equals a prefill of its path."""
    model = ours(hybrid_dir)
    prompt = IDS[:9]
    # tree: 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 3
    tokens, parents, depths = [20, 21, 22, 23, 24], [-1, 0, 0, 1, 3], [0, 1, 1, 2, 3]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for node, p in enumerate(parents):
        mask[node] = mask[p] if p >= 0 else mask[node]
        mask[node, node] = True
    _, st = prefill(model, prompt, 4)
    h, _ = model(ForwardInput(ids=torch.tensor(tokens), positions=9 + torch.tensor(depths), cache=st,
                              lengths=torch.tensor([9], dtype=torch.int32), block_mask=mask,
                              tree=TreeIndex.build(parents, model.config.conv_kernel, CPU)))
    tree_logits = model.logits(h)
    for node, path in {2: [20, 22], 4: [20, 21, 23, 24]}.items():
        ref, st_ref = prefill(model, prompt + path, 4)
        assert rel_err(tree_logits[node], ref[-1]) < 1e-5
    st.keep_rows(9, torch.tensor([0, 1, 3, 4]))  # accept the path to node 4
    assert torch.allclose(st.ssm, st_ref.ssm, atol=1e-6)
    assert torch.allclose(st.conv, st_ref.conv, atol=1e-6)


def replay_steps(steps: list[int]) -> dict[int, list[int]]:
    """Run a TreeIndex's step codes as the scan does, keeping the rows applied since the last
    restart: the path each emitting step's state stands for."""
    path: list[int] = []
    emitted: dict[int, list[int]] = {}
    for code in steps:
        row = code >> 2
        if code & 1:
            path = []
        path.append(row)
        if code & 2:
            assert row not in emitted, "a row emitted twice"
            emitted[row] = list(path)
    return emitted


def test_the_scans_steps_give_every_node_its_own_path():
    """Over random trees (and in a captured graph's static buffers, padding rows after the tree),
    the scan's steps emit each row once, from the state of exactly its root path; a tree of T rows
    takes at most T(T+1)/2 steps, what the static buffers hold; its segments (what the Triton scan
    runs side by side) begin exactly at the restarts and end at the last step; the buffers then
    hold what the tree with its padding rows as roots of their own would."""
    gen = torch.Generator().manual_seed(0)
    static = TreeIndex.static(12, 4, CPU)
    for _ in range(200):
        t = int(torch.randint(1, 13, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        chains = []
        for node, p in enumerate(parents):
            chains.append((chains[p] if p >= 0 else []) + [node])
        index = TreeIndex.build(parents, 4, CPU)
        steps = index.steps.tolist()
        assert index.n_host == len(steps) <= t * (t + 1) // 2
        assert replay_steps(steps) == dict(enumerate(chains))
        restarts = [i for i, code in enumerate(steps) if code & 1]
        assert index.bounds.tolist() == restarts + [len(steps)] and int(index.n_segments) == len(restarts)
        static.fill_(index)
        n, b = static.n_host, int(static.n_segments)
        padded = replay_steps(static.steps[:n].tolist())
        assert padded == dict(enumerate(chains + [[row] for row in range(t, 12)]))
        forest = TreeIndex.build(parents + [-1] * (12 - t), 4, CPU)  # the padding rows as roots
        assert torch.equal(static.conv_rows, forest.conv_rows)
        assert static.steps[:n].tolist() == forest.steps.tolist()
        assert static.bounds[:b + 1].tolist() == forest.bounds.tolist() and b == static.segments_host


# ---- decoding -------------------------------------------------------------------------------

N_TOKENS = 40


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_pair")
    target = make_target(root / "target", arch="qwen3_5", layers=5)
    return target, make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 3])


def engine(pair, **kw):
    kw.setdefault("max_ctx", 512)
    kw.setdefault("max_sequences", 1)  # one live sequence: the snapshot tests evict it
    return Engine.from_pretrained(str(pair[0]), str(pair[1]), device="cpu", **kw)


@pytest.fixture(scope="module")
def reference(hybrid_pair):
    return engine(hybrid_pair, mode="ar", prefill_ubatch=7).generate(
        PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids


@pytest.mark.parametrize("mode,budget", [("chain", 22), ("ddtree", 4), ("ddtree", 22)])
@pytest.mark.parametrize("wrong_depths", [(), (3,)])
def test_greedy_spec_equals_ar_with_oracle_draft(hybrid_pair, reference, mode, budget, wrong_depths):
    """Long accepted paths and side branches: the tree scan's node states are exact."""
    eng = engine(hybrid_pair, mode=mode, budget=budget, prefill_ubatch=7)
    install_oracle(eng, PROMPT + reference, set(wrong_depths), eng.target.config.vocab_size)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
    assert res.token_ids == reference
    assert res.stats.mean_accept_length > 2  # the oracle's paths were taken


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_greedy_spec_equals_ar_with_random_draft(hybrid_pair, reference, mode):
    res = engine(hybrid_pair, mode=mode, prefill_ubatch=7).generate(PROMPT, max_tokens=N_TOKENS,
                                                                     stop_token_ids=[])
    assert res.token_ids == reference


@pytest.mark.parametrize("mode,budget", [("chain", 22), ("ddtree", 22)])
def test_moe_greedy_spec_equals_ar_with_oracle_draft(tmp_path_factory, mode, budget):
    """Qwen3.5-MoE: the tree's rows route to different experts within one forward, and the
    output still equals AR token for token."""
    root = tmp_path_factory.mktemp("moe_pair")
    target = make_target(root / "target", arch="qwen3_5_moe", layers=4)
    pair = (target, make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 2]))
    reference = engine(pair, mode="ar", prefill_ubatch=7).generate(
        PROMPT, max_tokens=24, stop_token_ids=[]).token_ids
    eng = engine(pair, mode=mode, budget=budget, prefill_ubatch=7)
    assert not eng.target.capturable
    install_oracle(eng, PROMPT + reference, {3}, eng.target.config.vocab_size)
    res = eng.generate(PROMPT, max_tokens=24, stop_token_ids=[])
    assert res.token_ids == reference
    assert res.stats.mean_accept_length > 2


def test_ar_loads_no_draft_and_no_graphs_on_cpu(hybrid_pair):
    eng = engine(hybrid_pair, mode="ar")
    assert eng.draft is None and eng.state.recurrent and not eng.runner.verify


# ---- prefix cache ---------------------------------------------------------------------------

MAIN = [5 + (i * 7) % 300 for i in range(90)]
SUB = [6 + (i * 11) % 300 for i in range(70)]



def fresh_answer(pair, prompt, n=12):
    eng = engine(pair, mode="ddtree", budget=6)
    return eng.generate(prompt, max_tokens=n, stop_token_ids=[]).token_ids


def test_agent_loop_keeps_its_reuse(hybrid_pair):
    """A turn that extends the previous one, a sub-agent interleaved with the main conversation,
    and a prompt repeated after another conversation: each reuses the state kept at the last
    prompt's end (or a snapshot's), and every answer equals a cache-less engine's."""
    eng = engine(hybrid_pair, mode="ddtree", budget=6, prefill_ubatch=32, state_checkpoint_interval=40,
                 host_cache_bytes=0)
    first = eng.generate(MAIN, max_tokens=12, stop_token_ids=[])
    assert first.stats.cached_tokens == 0
    # the next turn: the previous prompt, a re-rendered reply (its last tokens differ), a new message
    turn2 = MAIN + first.token_ids[:8] + [9, 9, 30, 31]
    res = eng.generate(turn2, max_tokens=12, stop_token_ids=[])
    assert res.token_ids == fresh_answer(hybrid_pair, turn2)
    assert res.stats.cached_tokens >= len(MAIN) - 1
    # a sub-agent comes in between, then the main conversation's turn is repeated
    sub = eng.generate(SUB, max_tokens=12, stop_token_ids=[])
    assert sub.token_ids == fresh_answer(hybrid_pair, SUB) and sub.stats.cached_tokens == 0
    again = eng.generate(turn2, max_tokens=12, stop_token_ids=[])
    assert again.token_ids == res.token_ids
    assert again.stats.cached_tokens == len(turn2) - 1  # a snapshot of the main conversation
    # and the sub-agent's next turn finds its own snapshot
    sub2 = SUB + sub.token_ids[:5] + [4, 4]
    res = eng.generate(sub2, max_tokens=12, stop_token_ids=[])
    assert res.token_ids == fresh_answer(hybrid_pair, sub2)
    assert res.stats.cached_tokens >= len(SUB) - 1


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_the_start_up_warm_up_leaves_nothing_behind(hybrid_pair, mode):
    """What a CUDA engine runs at start-up (to compile its prefill and decode kernels there):
    afterwards the state is empty, no checkpoint is kept, and the first answer is a fresh
    engine's, exactly."""
    eng = engine(hybrid_pair, mode=mode, prefill_ubatch=64)
    lengths = warm_up_lengths(64)  # 64, 63, ..., 1: more rows in all than the state holds
    assert lengths == list(range(64, 0, -1)) and sum(lengths) > eng.state.capacity
    eng.decoder.warm_up_prefill(lengths)
    committed = []  # host commits and the host's reads of device commits, in order
    for name in ("commit", "settle"):
        setattr(eng.state, name, lambda tokens, real=getattr(eng.state, name): committed.append(len(tokens))
                or real(tokens))
    eng.decoder.warm_up_decode()
    del eng.state.commit, eng.state.settle
    # the prompt, then three steps: one token, then (ddtree) two whose trees may accept several
    assert committed[0] == 16 and committed[1] == 1 and len(committed) == 4
    assert eng.state.length == 0 and not eng.state.checkpoints
    assert all(not t.any() for t in eng.state.target.states().values())
    res = eng.generate(PROMPT, max_tokens=12, stop_token_ids=[])
    assert res.token_ids == engine(hybrid_pair, mode=mode, prefill_ubatch=64).generate(
        PROMPT, max_tokens=12, stop_token_ids=[]).token_ids
    eng.generate(MAIN, max_tokens=2, stop_token_ids=[])
    with pytest.raises(RuntimeError, match="empty state"):
        eng.decoder.warm_up_prefill([4])
    with pytest.raises(RuntimeError, match="empty state"):
        eng.decoder.warm_up_decode()


def test_one_compiled_scan_serves_every_row_count():
    """The start-up's decode steps fold a path of one row; a request's may fold up to a block's
    rows. Triton compiles a kernel apart for an integer argument equal to 1 or divisible by 16
    unless told not to, so the scan's row count is a plain argument: a fold of 16 accepted rows
    must not compile mid-request what the warm-up's fold of 1 did not. So are a tree's programs
    a slice, which follow its rows (one for a single-row tree)."""
    pytest.importorskip("triton")
    from flashtree.kernels.triton_gated_delta import _scan_kernel

    assert [p.name for p in _scan_kernel.params if p.do_not_specialize] == ["T", "SEGMENT_PROGRAMS"]


def test_the_warm_up_covers_every_short_chunk_and_fits_the_state(hybrid_pair):
    """A CUDA engine's start-up chunks: a full one, one row less, and every length up to the
    small-M GEMM's 64 rows, each once; a chunk longer than the state is refused up front."""
    lengths = warm_up_lengths(512)
    assert lengths[:2] == [512, 511] and sorted(lengths[2:]) == list(range(1, 65))
    assert warm_up_lengths(40) == list(range(40, 0, -1)) and warm_up_lengths(1) == [1]
    eng = engine(hybrid_pair, mode="ar")
    with pytest.raises(ValueError, match="warm-up chunks"):
        eng.decoder.warm_up_prefill([4, eng.state.capacity + 1])
    assert eng.state.length == 0


def test_long_prefill_keeps_interval_checkpoints(hybrid_pair):
    eng = engine(hybrid_pair, mode="ar", prefill_ubatch=64, state_checkpoint_interval=30)
    first = eng.generate(MAIN, max_tokens=4, stop_token_ids=[])
    assert {30, 60, len(MAIN) - 1} <= set(eng.state.checkpoints)
    # chunks end every 30 tokens and at the prompt's last token, which is a forward of its own
    assert first.stats.prefill_chunks == len(range(0, len(MAIN) - 1, 30)) + 1
    diverged = MAIN[:75] + [1, 2, 3]  # shares 75 tokens: resumes at the checkpoint at 60
    res = eng.generate(diverged, max_tokens=6, stop_token_ids=[])
    assert res.stats.cached_tokens == 60 and res.stats.prefill_chunks == 2  # 60..77, then 77
    assert res.token_ids == engine(hybrid_pair, mode="ar").generate(diverged, max_tokens=6,
                                                                   stop_token_ids=[]).token_ids


@pytest.mark.parametrize("site", ["prefill", "draft", "verify", "sample", "snapshot_save", "snapshot_restore"])
def test_oom_at_every_site_leaves_the_hybrid_state_consistent(hybrid_pair, site):
    eng = engine(hybrid_pair, mode="ddtree", budget=6, prefill_ubatch=32, host_cache_bytes=0)
    eng.generate(MAIN, max_tokens=12, stop_token_ids=[])
    eng.generate(SUB, max_tokens=12, stop_token_ids=[])  # MAIN is a snapshot now
    faults.configure(f"{site}:oom:{1 if site.startswith('snapshot') else 2}")
    try:
        eng.generate(MAIN, max_tokens=12, stop_token_ids=[])
    except EngineOutOfMemory as e:
        assert e.site == site
    faults.configure("")
    for prompt in (MAIN, SUB):
        res = eng.generate(prompt, max_tokens=12, stop_token_ids=[])
        assert res.token_ids == fresh_answer(hybrid_pair, prompt)


def test_snapshot_of_a_hybrid_survives_the_disk(hybrid_pair, tmp_path):
    kw = dict(mode="ddtree", budget=6, prefill_ubatch=32, prefix_cache_slots=0, host_cache_bytes=0,
              cache_dir=str(tmp_path))
    eng = engine(hybrid_pair, **kw)
    eng.generate(MAIN, max_tokens=12, stop_token_ids=[])
    eng.generate(SUB, max_tokens=12, stop_token_ids=[])  # MAIN goes to disk
    restarted = engine(hybrid_pair, **kw)
    res = restarted.generate(MAIN, max_tokens=12, stop_token_ids=[])
    assert res.stats.cached_tokens == len(MAIN) - 1
    assert res.token_ids == fresh_answer(hybrid_pair, MAIN)


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_static_buffers_decode_like_direct_calls(hybrid_pair, reference, mode):
    """The CUDA path's static buffers (padded trees, reset tree indexes), run eagerly."""
    from test_fast_path import use_static_runner
    eng = engine(hybrid_pair, mode=mode, budget=6, prefill_ubatch=7)
    use_static_runner(eng, 6)
    assert all(g.tree is not None for g in eng.runner.verify.values())
    for _ in range(2):  # the second request reuses the live state and the dirty buffers
        res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[])
        assert res.token_ids == reference
