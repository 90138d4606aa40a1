"""Our target and draft forwards against references: transformers for the target, the DESIGN.md
equations written out directly for the draft."""

import json

import pytest
import torch
import transformers

from flashtree.kernels.reference import apply_rope
from flashtree.models.dflash import default_target_layer_ids
from flashtree.models.dflash import DraftConfig
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_draft, load_target, read_configs
from tiny_models import make_draft, make_target

CPU = torch.device("cpu")


def target_model(path, max_pos):
    _, cfg, _ = read_configs(path, None)
    return load_target(path, cfg, torch.float32, CPU, max_pos)


def draft_model(path, max_pos):
    return load_draft(path, DraftConfig.from_hf(json.loads((path / "config.json").read_text())),
                      torch.float32, CPU, max_pos)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=[
    ("qwen3", False), ("qwen3", True), ("llama", False)], ids=["qwen3", "qwen3-tied", "llama3-rope"])
def target_dir(request, tmp_path_factory):
    arch, tie = request.param
    return make_target(tmp_path_factory.mktemp(arch), arch=arch, tie=tie)


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


def at(n):
    """A committed length as the device tensor the forwards take."""
    return torch.tensor([n], dtype=torch.int32)


def test_prompt_and_incremental_logits_match_transformers(target_dir):
    ids = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128]
    ref, _ = hf_logits(target_dir, ids)
    model = target_model(target_dir, 512)
    cache = model.new_cache(512, torch.float32, CPU)
    # prefill the first 5 tokens at once, then one token per call
    hidden, _ = model(ForwardInput.prefill(torch.tensor(ids[:5]), cache))
    ours = [model.logits(hidden)]
    for i in range(5, len(ids)):
        h, _ = model(ForwardInput.prefill(torch.tensor([ids[i]]), cache, i))
        ours.append(model.logits(h))
    ours = torch.cat(ours)
    assert rel_err(ours, ref) <= 1e-4


def test_features_are_decoder_layer_outputs(target_dir):
    ids = [9, 8, 7, 6, 5, 4]
    _, hidden_states = hf_logits(target_dir, ids)
    model = target_model(target_dir, 64)
    cache = model.new_cache(64, torch.float32, CPU)
    _, feats = model(ForwardInput(ids=torch.tensor(ids), cache=cache, lengths=at(0), feature_layers=(0, 2)))
    want = torch.cat([hidden_states[1][0], hidden_states[3][0]], dim=-1)
    assert rel_err(feats, want) <= 1e-5


def test_tree_mask_forward_equals_separate_chains(target_dir):
    """Verifying a tree in one forward gives each node the logits of its own root path."""
    model = target_model(target_dir, 128)
    prompt = [11, 12, 13, 14]
    # tree: 0 root; 1,2 children of 0; 3 child of 1
    tokens, depths = [20, 21, 22, 23], [0, 1, 1, 2]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    cache = model.new_cache(128, torch.float32, CPU)
    model(ForwardInput.prefill(torch.tensor(prompt), cache))
    h, _ = model(ForwardInput(ids=torch.tensor(tokens), positions=4 + torch.tensor(depths), cache=cache,
                              lengths=at(4), block_mask=mask))
    tree_logits = model.logits(h)
    for node, path in {2: [20, 22], 3: [20, 21, 23]}.items():
        ref, _ = hf_logits(target_dir, prompt + path)
        assert rel_err(tree_logits[node], ref[-1]) <= 1e-4


def test_default_target_layer_ids_match_reference_rule():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("window", [None, 3])
def test_draft_forward_matches_equations(tmp_path, window):
    tdir = make_target(tmp_path / "t")
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=window) if window else {}
    ddir = make_draft(tmp_path / "d", tdir, block_size=4, layers=2, **kw)
    model = target_model(tdir, 64)
    draft = draft_model(ddir, 64)
    cfg = json.loads((ddir / "config.json").read_text())
    sd = {k: v.float() for k, v in draft.state_dict().items()}
    n_ctx, bs = 6, 4
    feats = torch.randn(n_ctx, 2 * cfg["hidden_size"])
    block_ids = torch.tensor([7] + [cfg["dflash_config"]["mask_token_id"]] * (bs - 1))
    emb = model.embed(block_ids)
    # ours: context appended in two pieces (as decoding does), then the block
    cache = draft.new_cache(64, torch.float32, CPU)
    draft.write_context(ForwardInput(embeds=feats[:4], cache=cache, lengths=at(0)))
    draft.write_context(ForwardInput(embeds=feats[4:], cache=cache, lengths=at(4)))
    ours = draft(ForwardInput(embeds=emb, cache=cache, lengths=at(n_ctx)))

    # reference, straight from the equations
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    cos, sin = draft.rope(torch.arange(n_ctx + bs))
    h = emb
    for i in range(2):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        both = torch.cat([ctx, x])
        q = rms((x @ sd[p + "self_attn.q_proj.weight"].T).view(bs, nh, hd), sd[p + "self_attn.q_norm.weight"])
        k = rms((both @ sd[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), sd[p + "self_attn.k_norm.weight"])
        v = (both @ sd[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = apply_rope(q, cos[n_ctx:], sin[n_ctx:])
        k = apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        if window and i == 0:
            qpos = torch.arange(n_ctx, n_ctx + bs)[:, None]
            kpos = torch.arange(n_ctx + bs)[None, :]
            visible = ((qpos - kpos) < window) | (kpos >= n_ctx)
            scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(bs, -1)
        h = h + att @ sd[p + "self_attn.o_proj.weight"].T
        y = rms(h, sd[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)
        h = h + g @ sd[p + "mlp.down_proj.weight"].T
    ref = rms(h, sd["norm.weight"])
    assert rel_err(ours, ref) <= 1e-5


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 2.0}], ids=lambda s: s["rope_type"])
def test_rope_frequencies_equal_transformers(scaling):
    """The RoPE tables long-context checkpoints ask for (yarn: Qwen3 past 32K; llama3: LLaMA-3.1)
    equal transformers' inverse frequencies and attention scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flashtree.models.rope import RotaryTable, rope_inv_freq, rope_params

    cfg = transformers.Qwen3Config(head_dim=128, hidden_size=1024, num_attention_heads=8,
                                   max_position_embeddings=131072, rope_theta=1e6)
    if hasattr(cfg, "rope_parameters"):  # transformers 5
        cfg.rope_parameters = {**scaling, "rope_theta": 1e6}
    else:
        cfg.rope_scaling = dict(scaling)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    params = rope_params(cfg.to_dict())
    inv, scale = rope_inv_freq(128, params, 131072)
    torch.testing.assert_close(inv.float(), want_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-9)
    with torch.device("meta"):  # built where models are built: same shape, nothing computed there
        table = RotaryTable(128, params, 64)
    assert table.cos.device.type == "meta" and table.cos.shape == (64, 128)
