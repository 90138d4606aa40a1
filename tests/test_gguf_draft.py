"""GGUF drafts: a random DFlash and DFlash2 draft converted by flashtree's converter to F16, Q8_0
and Q4_K load as `--draft x.gguf` to the weights of a safetensors copy holding the file's
dequantized values, propose its first block, and decode greedily as AR does; files in llama.cpp's
and lucebox's namings, written here key by key with the `gguf` package, load to the safetensors
draft they came from; damaged headers are clear errors naming the key."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from flashtree import Engine
from flashtree.checkpoint.gguf_draft_writer import convert, gguf_name, main, quantize_q4_k
from flashtree.errors import CheckpointError
from flashtree.models.dflash2 import DFlash2Draft
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_draft, read_configs
from flashtree.models.quant import QuantizedLinear
from gguf_convert import rewrite
from test_gguf import rel_err, weights
from test_memory_plan import held, item
from tiny_models import make_dflash2_draft, make_draft, make_target

CPU = torch.device("cpu")
PROMPT = [3, 77, 120, 45, 9, 300, 18, 200, 61, 5, 17, 250]
N_TOKENS = 32
KINDS = [Q.F16, Q.Q8_0, Q.Q4_K]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Rows of 256: the drafts' linears split into Q4_K blocks."""
    return make_target(tmp_path_factory.mktemp("gguf_draft") / "target", layers=4, hidden=256)


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def draft(request, target, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "dflash":
        return make_draft(root / "draft", target, layers=2, target_layer_ids=[1, 2],
                          layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    return make_dflash2_draft(root / "draft", target, layers=2, target_layer_ids=[1, 3],
                              layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                              is_causal=None, output_multiplier=1.3, final_logit_softcapping=4.0,
                              input_embedding_scale=0.8)


def dequantized_copy(draft_dir, path, out):
    """A copy of the safetensors draft holding what the GGUF file at `path` holds, dequantized by
    the gguf package (each checkpoint tensor found under its converter name)."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    state = load_file(str(draft_dir / "model.safetensors"))
    for name, t in state.items():
        stored = tensors[gguf_name(name)]
        value = gguf.quants.dequantize(np.array(stored.data), stored.tensor_type)
        state[name] = torch.from_numpy(np.asarray(value, np.float32).reshape(t.shape).copy())
    shutil.copytree(draft_dir, out)
    save_file(state, str(out / "model.safetensors"))
    return out


def loaded(target_dir, draft_ref, quantize=None):
    _, _, cfg = read_configs(target_dir, draft_ref)
    return load_draft(draft_ref, cfg, torch.float32, CPU, 64, quantize)


def first_block(draft):
    """The draft's hidden states of a block [bonus, MASK...] over random context features."""
    g = torch.Generator().manual_seed(0)
    c = draft.config
    features = torch.randn(len(PROMPT), len(c.target_layer_ids) * c.hidden_size, generator=g)
    embeds = torch.randn(c.block_size, c.hidden_size, generator=g)
    kv = draft.new_cache(64, torch.float32, "cpu")
    length = torch.zeros(1, dtype=torch.int32)
    with torch.no_grad():
        draft.write_context(ForwardInput(embeds=features, cache=kv, lengths=length))
        length += len(PROMPT)
        return draft(ForwardInput(embeds=embeds, cache=kv, lengths=length))


@pytest.mark.parametrize("kind", KINDS, ids=lambda q: q.name)
def test_a_gguf_draft_is_its_dequantized_safetensors_copy(target, draft, kind, tmp_path):
    path = tmp_path / "draft.gguf"
    convert(draft, path, kind)
    reference_dir = dequantized_copy(draft, path, tmp_path / "reference")
    _, _, ours_cfg = read_configs(target, path)
    _, _, theirs_cfg = read_configs(target, reference_dir)
    # the one field a GGUF draft does not carry: the target's layer count (only checked against it)
    assert vars(ours_cfg) == dict(vars(theirs_cfg), num_target_layers=0)
    ours, reference = loaded(target, path), loaded(target, reference_dir)
    assert type(ours) is type(reference)
    assert isinstance(ours, DFlash2Draft) == ("DFlash2DraftModel" in (draft / "config.json").read_text())
    assert isinstance(ours.fc, QuantizedLinear) == (kind != Q.F16)  # quantized blocks stay quantized
    mine, theirs = weights(ours), weights(reference)
    assert mine.keys() == theirs.keys()
    for key in mine:  # K-quants: float16 scale products (d * sc) and minimums
        exact = kind != Q.Q4_K
        torch.testing.assert_close(mine[key], theirs[key], rtol=0 if exact else 1e-3,
                                   atol=0 if exact else 2e-3 * theirs[key].abs().max().item(), msg=key)
    hidden, expected = first_block(ours), first_block(reference)
    if kind == Q.F16:
        assert torch.equal(hidden, expected)
    elif kind == Q.Q8_0:  # its float16 scales are the file's own: the weights are the same numbers
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    else:  # the float16 products of Q4_K's two scales, through every layer (and DFlash2's convolutions)
        assert rel_err(hidden, expected) < 1e-2
    head = torch.randn(500, hidden.shape[1], generator=torch.Generator().manual_seed(1))
    assert (hidden @ head.T).argmax(-1).tolist() == (expected @ head.T).argmax(-1).tolist()


@pytest.fixture(scope="module")
def ar_output(target, draft):
    eng = Engine.from_pretrained(str(target), str(draft), mode="ar", max_ctx=256)
    return eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids


@pytest.mark.parametrize("kind,quantize_draft", [(Q.Q4_K, None), (Q.Q8_0, "int4"), (Q.F16, "int8")],
                         ids=["Q4_K", "Q8_0-int4", "F16-int8"])
def test_greedy_ddtree_with_a_gguf_draft_equals_ar_and_the_plan_counts_what_loads(
        target, draft, ar_output, kind, quantize_draft, tmp_path):
    path = tmp_path / "draft.gguf"
    convert(draft, path, kind)
    eng = Engine.from_pretrained(str(target), str(path), mode="ddtree", budget=12, max_ctx=256,
                                 quantize_draft=quantize_draft)
    assert item(eng.memory_plan, "draft weights") == held(eng.draft)
    if quantize_draft is not None:  # --quantize-draft: as for a target, nothing kept above its bits
        bits = {"int4": 4, "int8": 8}[quantize_draft]
        assert {m.bits for m in eng.draft.modules() if isinstance(m, QuantizedLinear)} == {bits}
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == ar_output


def write_by_hand(draft_dir, path, arch, names, keys):
    """The draft's tensors (F32) under `names(checkpoint name)` and its config as `keys`: a file
    as another converter writes it, spelled out here independently of flashtree's writer."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    for key, value in keys.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in load_file(str(draft_dir / "model.safetensors")).items():
        w.add_tensor(names(name), t.float().numpy())
    w.add_tensor("token_embd.weight", np.zeros((8, cfg["hidden_size"]), np.float32))  # the target's: not read
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_name(name):
    fixed = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight",
             "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
             "candidate_selector.successor_codebook": "selector_successor.weight",
             "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
    if name in fixed:
        return fixed[name]
    _, i, rest = name.split(".", 2)
    for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                     ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                     ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
                     ("self_attn.k_norm", "attn_k_norm"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                     ("mlp.down_proj", "ffn_down"), ("attention_conv.kernel_projection", "attn_conv_proj"),
                     ("mlp_conv.kernel_projection", "ffn_conv_proj"), ("attention_conv.base_kernel", "attn_conv_base"),
                     ("mlp_conv.base_kernel", "ffn_conv_base")):
        if rest.startswith(hf):
            return f"blk.{i}.{ours}{rest[len(hf):]}"
    raise AssertionError(name)


def lucebox_name(name):
    return {"fc.weight": "dflash.fc.weight", "hidden_norm.weight": "dflash.hidden_norm.weight"}.get(
        name, llama_cpp_name(name).replace("ffn_norm", "post_attention_norm"))


def test_llama_cpp_and_lucebox_files_load_to_the_safetensors_draft(target, draft, tmp_path):
    cfg = json.loads((draft / "config.json").read_text())
    dcfg = cfg["dflash_config"]
    window = {"attention.sliding_window": 6, "attention.sliding_window_pattern": [True, False]}
    llama_keys = {**{f"dflash.{k}": v for k, v in window.items()}, "dflash.target_layers": [i + 1 for i in
                  dcfg["target_layer_ids"]], "tokenizer.ggml.mask_token_id": dcfg["mask_token_id"]}
    files = {}
    if "DFlash2DraftModel" in cfg["architectures"]:
        llama_keys.update({f"dflash.{k}": dcfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                             "selector_top_k", "block_size")})
        llama_keys.update({"dflash.logit_scale": 1.3, "dflash.final_logit_softcapping": 4.0,
                           "dflash.input_embedding_scale": 0.8})
    else:
        llama_keys.update({"dflash.block_size": cfg["block_size"], "dflash.attention.causal": False})
        arch = "qwen35-dflash-draft"
        lucebox_keys = {f"{arch}.dflash.block_size": cfg["block_size"], f"{arch}.dflash.target_layer_ids": [1, 2],
                        f"{arch}.dflash.n_target_layers": 2, f"{arch}.dflash.mask_token_id": dcfg["mask_token_id"],
                        **{f"{arch}.{k}": v for k, v in window.items()}}
        files["lucebox"] = write_by_hand(draft, tmp_path / "b.gguf", arch, lucebox_name, lucebox_keys)
    files["llama.cpp"] = write_by_hand(draft, tmp_path / "a.gguf", "dflash", llama_cpp_name, llama_keys)
    reference = loaded(target, draft)
    for who, path in files.items():
        ours = loaded(target, path)
        assert vars(ours.config) == dict(vars(reference.config), num_target_layers=0), who
        mine, theirs = weights(ours), weights(reference)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), who
        assert torch.equal(first_block(ours), first_block(reference)), who


def test_the_converter_command_and_q4_k_blocks(draft, tmp_path, capsys):
    assert main([str(draft), str(tmp_path / "d.gguf"), "--type", "q8_0"]) == 0
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), str(tmp_path / "e.gguf")])
    w = np.random.default_rng(0).normal(size=(3, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(w), Q.Q4_K).reshape(w.shape)
    # per 32 values: half a step of their range / 15, plus the 6-bit rounding of the scales
    assert np.abs(back - w).max() < 0.05 * np.abs(w).max()
    zeros = np.zeros((1, 256), np.float32)
    assert np.array_equal(gguf.quants.dequantize(quantize_q4_k(zeros), Q.Q4_K), zeros)


@pytest.mark.parametrize("key,value,named", [
    ("dflash.target_layers", None, "dflash.target_layers: missing"),
    ("dflash.target_layers", [0, 2], "each at least 1"),
    ("tokenizer.ggml.mask_token_id", None, "mask_token_id: missing"),
    ("dflash.block_size", 1, "must be at least 2"),
    ("dflash.attention.sliding_window_pattern", [True], "1 entries for 2 layers"),
    ("dflash.attention.sliding_window_pattern", None, "a sliding window without"),
    ("dflash.embedding_length", 0, "must be at least 1"),
    ("dflash.conv_group_size", None, "dflash.conv_group_size: missing"),
    ("dflash.logit_scale", -1.0, "must be a positive finite number"),
])
def test_a_damaged_draft_header_is_a_clear_error(target, draft, key, value, named, tmp_path):
    convert(draft, tmp_path / "good.gguf", Q.F16)
    dflash2 = "DFlash2DraftModel" in (draft / "config.json").read_text()
    if key in ("dflash.conv_group_size", "dflash.logit_scale") and not dflash2:
        pytest.skip("a DFlash2 key")
    path = rewrite(tmp_path / "good.gguf", tmp_path / "bad.gguf", {key: value})
    with pytest.raises(CheckpointError, match=named):
        read_configs(target, path)


def test_a_gguf_of_the_wrong_kind_is_refused_on_either_side(target, draft, tmp_path):
    from gguf_convert import convert as convert_target
    convert(draft, tmp_path / "draft.gguf", Q.F16)
    with pytest.raises(CheckpointError, match="is a draft's architecture: give this file as --draft"):
        read_configs(tmp_path / "draft.gguf", None)
    convert_target(target, tmp_path / "target.gguf", Q.F16)
    with pytest.raises(CheckpointError, match="'qwen3' is not a DFlash draft's architecture"):
        read_configs(target, tmp_path / "target.gguf")
    tensors = rewrite(tmp_path / "draft.gguf", tmp_path / "shape.gguf",
                      tensors=lambda n, d: d[:, :-32] if n == "fc.weight" else d)
    with pytest.raises(CheckpointError, match="fc.weight: holds fc.weight in shape"):
        loaded(target, tensors)
