"""DFlash2 drafts: a random checkpoint in z-lab's format proposes what the reference package's
`DFlash2DraftModel` (PyPI `dflash`) proposes, decoding with it is exact (greedy chain and ddtree
equal AR, dense and hybrid targets, the ddtree built from the draft's top-k or from its
selector), and a config it cannot run is refused naming the key."""

import json
import shutil

import pytest
import torch
from torch import nn

from flashtree import Engine
from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.dflash2 import DFlash2Config, DFlash2Draft, draft_config
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_draft, read_configs
from flashtree.models.quant import QuantizedLinear
from flashtree.runtime.sampling import Sampler, SamplingParams
from tiny_models import make_dflash2_draft, make_target

PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61, 5, 17, 250]
N_TOKENS = 40

# (name, make_dflash2_draft's keywords): the published shape (every layer non-causal, full
# attention here), sliding layers with is_causal absent (causal in the block) and a window
# narrower than the block and the context, and the logit scaling the reference reads
CASES = [
    ("published", {}),
    ("sliding_causal", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
                        "is_causal": None}),
    ("sliding_bidirectional", {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 6}),
    ("scaled_logits", {"output_multiplier": 1.7, "final_logit_softcapping": 2.5, "input_embedding_scale": 0.8}),
]


@pytest.fixture(scope="module")
def dense_target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dflash2_dense") / "target", layers=4)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, dense_target, tmp_path_factory):
    name, kw = request.param
    return make_dflash2_draft(tmp_path_factory.mktemp(name) / "draft", dense_target, **kw)


def reference_block(target_dir, draft_dir, prompt):
    """The reference's first block: its draft's logits [bs-1, V] and its selector's greedy path,
    from the HF target's features of `prompt`, plus those features and the bonus."""
    import transformers
    from dflash.model import DFlash2DraftModel, extract_context_feature

    target = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ref = DFlash2DraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    loaded = ref.state_dict()  # every tensor from the file: nothing left at its random init
    from safetensors.torch import load_file
    for key, t in load_file(str(draft_dir / "model.safetensors")).items():
        key = key + ".weight" if key.endswith("_codebook") else key
        assert torch.equal(loaded[key], t), key
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, ref.target_layer_ids)
        bonus = int(out.logits[0, -1].argmax())
        bs = ref.block_size
        block = torch.tensor([[bonus] + [ref.mask_token_id] * (bs - 1)])
        scale = float(ref.config.dflash_config.get("input_embedding_scale", 1.0))
        noise = target.model.embed_tokens(block) * scale
        hidden = ref(target_hidden=features, noise_embedding=noise,
                     position_ids=torch.arange(len(prompt) + bs)[None])[:, 1:]
        logits = ref.compute_logits(hidden, target.lm_head)
        path = ref.propose(hidden, block[:, 0], target.lm_head, 0.0)[0]
    return features[0], bonus, logits[0], path[0], target


def test_first_block_equals_the_reference_package(dense_target, case):
    features, bonus, ref_logits, ref_path, hf = reference_block(dense_target, case, PROMPT)
    cfg = draft_config(json.loads((case / "config.json").read_text()))
    assert isinstance(cfg, DFlash2Config)
    draft = load_draft(case, cfg, torch.float32, torch.device("cpu"), 64)
    assert isinstance(draft, DFlash2Draft)
    kv = draft.new_cache(64, torch.float32, "cpu")
    length = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        draft.write_context(ForwardInput(embeds=features, cache=kv, lengths=length))
        length += len(PROMPT)
        block = torch.tensor([bonus] + [cfg.mask_token_id] * (cfg.block_size - 1))
        hidden = draft(ForwardInput(embeds=hf.model.embed_tokens(block), cache=kv, lengths=length))[1:]
        logits = draft.proposal_logits(hf.lm_head(hidden).float())
        path = draft.select_chain(hidden, logits, torch.tensor([bonus]))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert path.tolist() == ref_path.tolist()


def test_the_selectors_path_is_not_the_argmax(dense_target, tmp_path):
    """The random selector does change the chain (else the path test would prove little), and
    the engine's chain step proposes the reference's path from its own target's features."""
    draft_dir = make_dflash2_draft(tmp_path / "draft", dense_target)
    _, bonus, ref_logits, ref_path, _ = reference_block(dense_target, draft_dir, PROMPT)
    assert ref_path.tolist() != ref_logits.argmax(-1).tolist()
    eng = Engine.from_pretrained(str(dense_target), str(draft_dir), mode="chain", max_ctx=256)
    eng.decoder.prefill_chunk(PROMPT)
    with torch.inference_mode():
        assert eng.decoder._draft_chain(bonus).tolist() == ref_path.tolist()
        logp = eng.decoder._draft_logprobs(bonus)
    torch.testing.assert_close(logp, torch.log_softmax(ref_logits, -1), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dflash2_{request.param}")
    target = make_target(root / "target", arch=request.param, layers=5 if request.param == "qwen3_5" else 4)
    draft = make_dflash2_draft(root / "draft", target, layers=2, target_layer_ids=[1, 3],
                               layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                               output_multiplier=1.3, final_logit_softcapping=4.0)
    return target, draft


@pytest.fixture(scope="module")
def ar_output(pair):
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), mode="ar", max_ctx=256)
    out = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    assert len(out) == N_TOKENS
    return out


@pytest.mark.parametrize("mode,budget,block_size,tree", [
    ("chain", 22, None, "topk"), ("chain", 22, 4, "topk"), ("ddtree", 8, None, "topk"), ("ddtree", 22, None, "topk"),
    ("ddtree", 3, None, "selector"), ("ddtree", 22, None, "selector"), ("ddtree", 22, 4, "selector")])
def test_greedy_decoding_with_a_dflash2_draft_equals_ar(pair, ar_output, mode, budget, block_size, tree):
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), mode=mode, budget=budget, max_ctx=256,
                                 block_size=block_size, dflash2_tree=tree)
    assert isinstance(eng.draft, DFlash2Draft) and eng.block_size == (block_size or 8)
    res = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    assert res.token_ids == ar_output
    assert all(1 <= a <= eng.block_size for a in res.stats.accept_lengths)


@pytest.mark.parametrize("mode,tree", [("chain", "topk"), ("ddtree", "topk"), ("ddtree", "selector")])
def test_static_buffers_draft_like_direct_calls(pair, ar_output, mode, tree):
    """The runner's static buffers (what CUDA graphs capture: the device step's phases), run
    eagerly on the CPU, give the same output and build the same trees as direct calls."""
    from test_fast_path import use_static_runner
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), mode=mode, budget=6, max_ctx=256, max_sequences=1,
                                 dflash2_tree=tree)
    direct = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    use_static_runner(eng, 6)
    for _ in range(2):  # the second request reuses the live state and the dirty buffers
        static = eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
        assert static.token_ids == direct.token_ids == ar_output
        assert [t["tree_tokens"] for t in static.trace] == [t["tree_tokens"] for t in direct.trace]


def selector_ranking(draft, hidden, logits, previous):
    """One position's selector candidates, best first, scored here from the draft's parameters:
    its top_k logits' tokens by logit + <predecessor(previous) * projection(hidden), successor>."""
    sel = draft.candidate_selector
    unary, tokens = logits.topk(sel.top_k)
    weights = sel.predecessor_codebook[previous] * sel.hidden_projection(hidden)
    scores = unary + (sel.successor_codebook[tokens] @ weights).float()
    return tokens[scores.argsort(descending=True, stable=True)].tolist()


@pytest.mark.parametrize("budget", [4, 2])
def test_the_selector_trees_first_level_is_the_selectors_ranking(dense_target, tmp_path, budget):
    """Block 2 (one drafted position): a ddtree of `budget` <= selector_top_k nodes is the root's
    children alone, the selector's best `budget` candidates in its order, on the host path
    (plan_tree) and the device step's alike; the top-k tree's are the draft's most likely tokens,
    another order (else this test could not tell them apart)."""
    draft_dir = make_dflash2_draft(tmp_path / "draft", dense_target)
    trees = {}
    for tree in ("topk", "selector"):
        eng = Engine.from_pretrained(str(dense_target), str(draft_dir), mode="ddtree", budget=budget, block_size=2,
                                     max_ctx=256, dflash2_tree=tree)
        dec = eng.decoder
        bonus = int(dec.prefill_chunk(PROMPT).argmax())
        with torch.inference_mode():
            planned = dec.plan_tree(bonus, 1)
            hidden, logits = dec._draft_logits(bonus, False)
            ranked = selector_ranking(eng.draft, hidden[0], logits[0], bonus)
            likely = logits[0].topk(budget).indices.tolist()
        stepped = dec.step(bonus, Sampler(SamplingParams(), 400, "cpu", []), 2, want_trace=True).trace
        assert planned.tree.parents == stepped["tree_parents"] == [-1] + [0] * budget
        assert stepped["tree_tokens"] == planned.tree.tokens
        trees[tree] = planned.tree.tokens[1:]
    assert trees["selector"] == ranked[:budget]
    assert trees["topk"] == likely and likely != ranked[:budget]


@pytest.mark.parametrize("mode,draft", [("chain", "dflash2"), ("ddtree", "dflash"), ("ar", None)])
def test_a_selector_tree_without_a_dflash2_ddtree_is_refused(dense_target, tmp_path, mode, draft):
    from tiny_models import make_draft
    draft_dir = {"dflash2": make_dflash2_draft, "dflash": make_draft}[draft](tmp_path / "d", dense_target) if draft else None
    with pytest.raises(ConfigError, match="--dflash2-tree selector builds a DFlash2 draft's ddtree: it needs --mode ddtree"):
        Engine.from_pretrained(str(dense_target), str(draft_dir) if draft_dir else None, mode=mode, max_ctx=128,
                               dflash2_tree="selector")


@pytest.mark.parametrize("quantize_draft", [None, "int8"])
def test_the_plan_counts_what_loads_and_quantize_draft_keeps_the_small_projections_dense(
        pair, ar_output, quantize_draft):
    from test_memory_plan import held, item
    eng = Engine.from_pretrained(str(pair[0]), str(pair[1]), mode="ddtree", max_ctx=256,
                                 quantize_draft=quantize_draft)
    draft = eng.draft
    assert item(eng.memory_plan, "draft weights") == held(draft)
    assert item(eng.memory_plan, "draft KV") == eng.state.draft.pool.nbytes
    if quantize_draft is not None:
        assert isinstance(draft.fc, QuantizedLinear) and isinstance(draft.layers[0].self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(draft.layers[0].mlp.down_proj, QuantizedLinear)
        dense = {n for n, m in draft.named_modules() if isinstance(m, nn.Linear)}
        assert dense == {"candidate_selector.hidden_projection",
                         *(f"layers.{i}.{c}.kernel_projection" for i in range(2) for c in ("attention_conv", "mlp_conv"))}
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == ar_output


def edit(cfg, key, value):
    *parents, last = key.split(".")
    d = cfg
    for p in parents:
        d = d[p]
    if value is None:
        del d[last]
    else:
        d[last] = value


@pytest.mark.parametrize("key,value,named", [
    ("dflash_config.selector_top_k", None, "dflash_config.selector_top_k"),
    ("dflash_config.selector_rank", None, "dflash_config.selector_rank"),
    ("dflash_config.conv_kernel_size", None, "dflash_config.conv_kernel_size"),
    ("dflash_config.conv_group_size", None, "dflash_config.conv_group_size"),
    ("dflash_config.conv_group_size", 24, "dflash_config.conv_group_size"),   # does not divide 64
    ("dflash_config.selector_top_k", 100000, "dflash_config.selector_top_k"),  # more than the vocabulary
    ("dflash_config.selector_rank", 0, "dflash_config.selector_rank"),
    ("dflash_config.block_size", 1, "dflash_config.block_size"),
    ("dflash_config.final_logit_softcapping", -1.0, "final_logit_softcapping"),
    ("dflash_config.output_multiplier", "2", "output_multiplier"),
    ("vocab_size", None, "vocab_size"),
    ("layer_types", ["sliding_attention"], "layer_types"),                    # one type for two layers
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types"),
    ("sliding_window", None, "sliding_window"),
    ("use_sliding_window", False, "use_sliding_window"),
    ("is_causal", "no", "is_causal"),
])
def test_a_bad_dflash2_config_is_refused_naming_the_key(dense_target, tmp_path, key, value, named):
    draft_dir = make_dflash2_draft(tmp_path / "draft", dense_target, layer_types=["sliding_attention"] * 2,
                                   sliding_window=32)
    cfg = json.loads((draft_dir / "config.json").read_text())
    edit(cfg, key, value)
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"{draft_dir / 'config.json'}: {named}: "):
        read_configs(dense_target, draft_dir)


def test_a_dflash2_draft_for_another_vocabulary_is_refused(dense_target, tmp_path):
    from safetensors.torch import load_file, save_file
    draft_dir = make_dflash2_draft(tmp_path / "draft", dense_target)
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["vocab_size"] += 8
    (draft_dir / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(draft_dir / "model.safetensors"))
    for name in ("predecessor_codebook", "successor_codebook"):
        book = state[f"candidate_selector.{name}"]
        state[f"candidate_selector.{name}"] = torch.cat([book, book[:8]])
    save_file(state, str(draft_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="the draft does not fit the target .*: vocab_size 408 != target.s 400"):
        Engine.from_pretrained(str(dense_target), str(draft_dir), mode="chain", max_ctx=128)


def test_codebooks_saved_with_weight_suffixes_load_too(dense_target, tmp_path):
    from safetensors.torch import load_file, save_file
    draft_dir = make_dflash2_draft(tmp_path / "draft", dense_target)
    state = load_file(str(draft_dir / "model.safetensors"))
    renamed = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in state.items()}
    save_file(renamed, str(draft_dir / "model.safetensors"))
    cfg = draft_config(json.loads((draft_dir / "config.json").read_text()))
    draft = load_draft(draft_dir, cfg, torch.float32, torch.device("cpu"), 64)
    assert torch.equal(draft.candidate_selector.predecessor_codebook.detach(),
                       state["candidate_selector.predecessor_codebook"])
    assert set(draft.state_dict()) == set(state)  # saved back under the published names
    shutil.rmtree(draft_dir)
