"""Hostile model files refused at load in one line naming the file and key, instead of a traceback,
a hang, or a model that answers every request with "" (models/checks.py, common.read_int,
rope.rope_params, dflash.DraftKeys, qwen35.full_every)."""

import json
import logging
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree.checkpoint import load_tokenizer
from flashtree.checkpoint.weights import config_dtype
from flashtree.errors import CheckpointError
from flashtree.models.checks import check_logits, positions_past_training
from flashtree.models.loader import load_target, read_configs
from flashtree.models.qwen35 import HybridCausalLM, HybridConfig
from flashtree.runtime.engine import Engine
from gguf_convert import convert, rewrite
from tiny_models import make_target

ASSETS = Path(__file__).resolve().parents[1] / "flashtree" / "assets"
CPU = torch.device("cpu")


def copy_of(name: str, out: Path, config: dict | None = None, weights_too: bool = True) -> Path:
    """A copy of the embedded target or draft, its config.json keys set to `config` (None: drop)."""
    if weights_too:
        shutil.copytree(ASSETS / name, out)
    else:
        out.mkdir(parents=True)
        shutil.copy(ASSETS / name / "config.json", out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def refused(tmp_path, says, target=None, draft=None):
    """read_configs of the embedded pair with these target and draft config.json edits."""
    t = copy_of("target", tmp_path / "t", target, weights_too=False)
    d = copy_of("draft", tmp_path / "d", draft, weights_too=False) if draft is not None else None
    with pytest.raises(CheckpointError) as info:
        read_configs(t, d)
    assert says in str(info.value), str(info.value)
    assert str(d or t) in str(info.value)  # names the file
    return str(info.value)


# ---- counts: integers, and not implausibly large (findings 4 and 17) --------------------------

@pytest.mark.parametrize("value,says", [
    (10 ** 9, "num_hidden_layers: 1000000000 is implausibly large"),
    (6.5, "num_hidden_layers: must be an integer, found 6.5"),
    (True, "num_hidden_layers: must be an integer, found True"),
    ("6", "num_hidden_layers: must be an integer, found '6'"),
])
@pytest.mark.parametrize("side", ["target", "draft"])
def test_a_layer_count_that_is_no_integer_or_huge_is_refused_at_once(tmp_path, side, value, says):
    start = time.monotonic()
    refused(tmp_path, says, **{side: {"num_hidden_layers": value}})
    assert time.monotonic() - start < 2  # 10**9 layers hung plan and generate for minutes


# ---- flags, constants and the activation: their JSON types, not what Python makes of them -------

@pytest.mark.parametrize("edit,says", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings: must be true or false, found 'false'"),
    ({"attention_bias": 0}, "attention_bias: must be true or false, found 0"),
    ({"rms_norm_eps": True}, "rms_norm_eps: must be a number, found True"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps: must be a number, found '1e-6'"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
    ({"rms_norm_eps": 1e30}, "rms_norm_eps: must be a positive number of at most 0.01, found 1e+30"),
    ({"dtype": None, "torch_dtype": "float7"}, "torch_dtype: must name a floating-point torch dtype such as bfloat16, found 'float7'"),
    ({"dtype": None, "torch_dtype": 5}, "torch_dtype: must name a floating-point torch dtype such as bfloat16, found 5"),
    ({"dtype": "int8"}, "dtype: must name a floating-point torch dtype such as bfloat16, found 'int8'"),
])
@pytest.mark.parametrize("side", ["target", "draft"])
def test_a_flag_constant_or_activation_of_the_wrong_kind_is_refused(tmp_path, side, edit, says):
    if side == "draft" and "tie_word_embeddings" in edit:
        pytest.skip("a DFlash draft has no lm_head of its own to tie")
    refused(tmp_path, says, **{side: edit})


@pytest.mark.parametrize("value,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                         ("float8_e4m3fn", None), ("auto", None), (None, None)])
def test_a_config_dtype_that_names_a_float_type_is_read(value, dtype):
    assert config_dtype({"torch_dtype": value}) == dtype
    assert config_dtype({"dtype": value, "torch_dtype": "float32"}) == (dtype if value else torch.float32)


# ---- DFlash v1 drafts get DFlash2's rules (findings 7 and 17) ---------------------------------

@pytest.mark.parametrize("edit,says", [
    ({"dflash_config": [1]}, "dflash_config: must be an object, found [1]"),
    ({"dflash_config": "x"}, "dflash_config: must be an object, found 'x'"),
    ({"block_size": 0}, "block_size: must be at least 2, found 0"),
    ({"block_size": 1}, "block_size: must be at least 2, found 1"),
    ({"block_size": -5}, "block_size: must be at least 2, found -5"),
    ({"block_size": 8000}, "block_size: must be at most 64, found 8000"),
    ({"layer_types": ["full_attention"]}, "layer_types: must list num_hidden_layers (2)"),
    ({"layer_types": ["full_attention", "weird"]}, "layer_types: ['weird'] not among"),
    ({"layer_types": "full_attention"}, "layer_types: must list num_hidden_layers (2)"),
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_window: missing"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": -4},
     "sliding_window: must be at least 1, found -4"),
])
def test_a_bad_dflash_draft_config_is_refused_naming_the_key(tmp_path, edit, says):
    t = copy_of("target", tmp_path / "t", weights_too=False)
    d = copy_of("draft", tmp_path / "d", edit, weights_too=False)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{d / 'config.json'}: {says}")):
        read_configs(t, d)


def test_a_dflash_draft_with_sliding_layers_still_loads(tmp_path):
    t = copy_of("target", tmp_path / "t", weights_too=False)
    d = copy_of("draft", tmp_path / "d", {"layer_types": ["sliding_attention", "full_attention"],
                                          "sliding_window": 64, "block_size": 2}, weights_too=False)
    _, _, draft = read_configs(t, d)
    assert draft.sliding_windows == [64, None] and draft.block_size == 2


# ---- RoPE settings (finding 8) ----------------------------------------------------------------

@pytest.mark.parametrize("edit,says", [
    ({"rope_scaling": [1, 2]}, "rope_scaling: must be an object, found [1, 2]"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}},
     "rope_parameters.factor: missing (yarn rope needs it)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}},
     "rope_parameters.low_freq_factor: missing (llama3 rope needs it)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
     "rope high_freq_factor 1.0 must be above low_freq_factor 1.0"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": "2"}},
     "rope_scaling.factor: must be a positive finite number, found '2'"),
])
def test_malformed_rope_settings_are_refused_naming_the_key(tmp_path, edit, says):
    refused(tmp_path, says, target=edit)


@pytest.mark.parametrize("edit,says", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}},
     "rope_theta: 1e-300 makes RoPE angles past float32"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 1e-300}},
     "rope (linear): rope_theta 1000000.0, factor 1e-300 make RoPE angles or scales past float32"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e300}},
     "rope (yarn): rope_theta 1000000.0, factor 4.0, attention_factor 1e+300 make RoPE angles or scales past"),
])
@pytest.mark.parametrize("side", ["target", "draft"])
def test_rope_settings_whose_table_overflows_are_refused_as_the_config_is_read(tmp_path, side, edit, says):
    """Each number positive and finite, and still a RoPE table of NaN: refused only once the
    weights were loaded, as the buffer `rope.cos` (no key of the file), and `plan` passed it."""
    refused(tmp_path, says, **{side: edit})


def test_a_small_rope_base_that_stays_finite_still_loads(tmp_path):
    t = copy_of("target", tmp_path / "t", {"rope_parameters": {"rope_type": "default", "rope_theta": 0.5}},
                weights_too=False)
    assert read_configs(t, None)[1].rope["rope_theta"] == 0.5


def test_rope_scaling_beside_rope_parameters_is_applied_and_checked(tmp_path):
    """YaRN turned on as a model card says (rope_scaling added to a config that has
    rope_parameters): its keys win, as in transformers, and are checked like the others."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    t = copy_of("target", tmp_path / "t", {"rope_scaling": yarn}, weights_too=False)
    _, cfg, _ = read_configs(t, None)
    assert cfg.rope["rope_type"] == "yarn" and cfg.rope["factor"] == 4.0
    assert cfg.rope["rope_theta"] == json.loads((ASSETS / "target" / "config.json").read_text())[
        "rope_parameters"]["rope_theta"], "the model's own base stays"
    refused(tmp_path / "bad", "rope_scaling.factor: must be a positive finite number, found 0",
            target={"rope_scaling": {**yarn, "factor": 0}})


@pytest.mark.parametrize("edit,says", [
    ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window: true: sliding-window attention in a "
                                                        "target is not supported"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types: ['sliding_attention', 'sliding_attention', "),
])
def test_a_dense_target_with_sliding_window_layers_is_refused(tmp_path, edit, says):
    """Run as full attention, such a model would answer otherwise than it does past its window."""
    refused(tmp_path, says, target=edit)


@pytest.mark.parametrize("count", [3, 7])
def test_a_dense_target_whose_layer_types_miss_layers_is_refused(tmp_path, count):
    """transformers refuses the config; served, it would run num_hidden_layers as if both agreed."""
    refused(tmp_path, f"layer_types: lists {count} layers, but num_hidden_layers is 6",
            target={"layer_types": ["full_attention"] * count})


# ---- missing keys, unknown kinds, a draft for no layers: the file is named ---------------------

@pytest.mark.parametrize("side,edit,says", [
    ("target", {"model_type": None}, "unsupported model_type None; supported: qwen3"),
    ("target", {"model_type": ["qwen3"]}, "unsupported model_type ['qwen3']; supported: qwen3"),
    ("target", {"model_type": {"a": 1}}, "unsupported model_type {'a': 1}; supported: qwen3"),
    ("target", {"vocab_size": None}, "vocab_size: missing (the model needs it)"),
    ("target", {"rope_parameters": {"rope_type": "weird", "rope_theta": 1e6}},
     "rope_parameters.rope_type: unsupported rope type 'weird'; supported: default"),
    ("draft", {"hidden_size": None}, "hidden_size: missing (a draft needs it)"),
    ("draft", {"num_target_layers": 0}, "num_target_layers: must be at least 1, found 0"),
])
def test_a_missing_key_or_unknown_kind_is_refused_naming_the_file(tmp_path, side, edit, says):
    refused(tmp_path, says, **{side: edit})


def test_a_draft_that_does_not_fit_the_target_is_refused_with_its_config(tmp_path):
    """As the configs are read, so `flashtree plan` refuses the pair too, naming the draft's file."""
    says = refused(tmp_path, "the draft does not fit the target", draft={
        "num_target_layers": None, "dflash_config": {"target_layer_ids": [1, 3, 40], "mask_token_id": 9}})
    assert "target_layer_ids [40] outside the target's 6 layers" in says


# ---- a hybrid without layer_types (finding 9) -------------------------------------------------

HYBRID = dict(model_type="qwen3_5_text", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.25})


def test_a_hybrid_full_attention_interval_of_0_is_refused(tmp_path):
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text(json.dumps({**HYBRID, "full_attention_interval": 0}))
    with pytest.raises(CheckpointError, match="config.json: malformed config: full_attention_interval: must be at "
                                              "least 1, found 0"):
        read_configs(tmp_path / "h", None)


# ---- finite weights that overflow (finding 1a) ------------------------------------------------

@pytest.mark.parametrize("tensor,value,quantize", [
    ("model.layers.0.input_layernorm.weight", 1e30, None),
    ("model.layers.0.input_layernorm.weight", 1e30, "int8"),
    ("model.embed_tokens.weight", 3e38, None),
    # NaN queries that a lone token's attention turned into a finite output: several rows do not
    ("model.layers.2.self_attn.q_norm.weight", torch.finfo(torch.bfloat16).max, None),
])
def test_finite_weights_that_overflow_are_refused_at_load(tmp_path, tensor, value, quantize):
    t = copy_of("target", tmp_path / "t")
    shard = next(f for f in sorted(t.glob("*.safetensors")) if tensor in load_file(str(f)))
    state = load_file(str(shard))
    state[tensor] = torch.full_like(state[tensor], value)
    save_file(state, str(shard), metadata={"format": "pt"})
    _, cfg, _ = read_configs(t, None)
    with pytest.raises(CheckpointError, match=re.escape(f"{t}: gives non-finite logits on a test input (or a hidden "
                                                        "state whose norm overflows float32): weights out of range?")):
        load_target(t, cfg, torch.float32, CPU, 64, quantize)


@pytest.mark.parametrize("tensor,says", [
    ("model.norm.weight", "gives the same logit for every token"),
    ("model.embed_tokens.weight", "model.embed_tokens.weight: every value is 0"),
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight: every value is 0"),
])
def test_zeroed_weights_are_refused_at_load(tmp_path, tensor, says):
    """A shard whose tail a cut download left zero-filled: a final norm of zeros makes every
    logit 0, so every answer was the argmax token 0 (an end-of-sequence id), an empty string;
    a weight matrix of zeros makes a layer that loads, runs, and gives garbage."""
    t = copy_of("target", tmp_path / "t")
    shard = next(f for f in sorted(t.glob("*.safetensors")) if tensor in load_file(str(f)))
    state = load_file(str(shard))
    state[tensor] = torch.zeros_like(state[tensor])
    save_file(state, str(shard), metadata={"format": "pt"})
    _, cfg, _ = read_configs(t, None)
    with pytest.raises(CheckpointError, match=re.escape(f"{t}: {says}")):
        load_target(t, cfg, torch.float32, CPU, 64, None)


@pytest.mark.parametrize("moe", [False, True], ids=["hybrid", "moe"])
def test_the_logits_check_runs_hybrid_and_moe_targets(moe):
    raw = dict(HYBRID, layer_types=["linear_attention", "full_attention"] * 2)
    if moe:
        raw.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    model = HybridCausalLM(HybridConfig.from_hf(raw), 16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    check_logits(model, "hybrid")  # a sound model passes
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight.fill_(1e30)
    with pytest.raises(CheckpointError, match="hybrid: gives non-finite logits"):
        check_logits(model, "hybrid")


def test_a_stacked_expert_weight_is_refused_under_the_files_names(tmp_path):
    """A vision-language checkpoint's text weights are under `model.language_model.` (renamed at
    load), and each layer's experts are stacked into one tensor (`mlp.experts.gate_up`): the
    error named that stack, which no file holds, instead of the file's tensors."""
    raw = dict(HYBRID, model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"] * 2,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    model = HybridCausalLM(HybridConfig.from_hf(raw), 16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    state = {k.replace("model.", "model.language_model.", 1): v.clone() for k, v in model.state_dict().items()}
    state["model.language_model.layers.2.mlp.experts.1.up_proj.weight"][0, 0] = math.nan
    (tmp_path / "m").mkdir()
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    _, cfg, _ = read_configs(tmp_path / "m", None)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path / 'm'}: model.language_model.layers.2.mlp.experts.0.gate_proj/0.up_proj/.../3.up_proj.weight: "
            "1 of their 4096 values are not finite (NaN or infinity)")):
        load_target(tmp_path / "m", cfg, torch.float32, CPU, 16)


# ---- tokenizer ids beyond the vocabulary (finding 15) -----------------------------------------

def tokenizer_refused(tmp_path, edit, says: str) -> None:
    """The embedded target with its tokenizer.json edited by `edit` is refused at load with the
    file's path and `says`."""
    t = copy_of("target", tmp_path / "t")
    tok = json.loads((t / "tokenizer.json").read_text())
    edit(tok)
    (t / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=re.escape(f"{t / 'tokenizer.json'}: {says}")):
        Engine.from_pretrained(str(t), None, mode="ar", device="cpu", max_ctx=64)


@pytest.mark.parametrize("token,edit,says", [
    ("<|extra|>", lambda tok: tok["model"]["vocab"].update({"<|extra|>": 8500}), 8500),
    ("<|new|>", lambda tok: tok["added_tokens"].append(dict(  # the next id (another: test_checkpoint_fuzz_findings)
        id=8192, content="<|new|>", single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)),
     8192),
], ids=["vocab", "added_token"])
def test_tokenizer_ids_beyond_the_config_vocabulary_are_refused_at_load(tmp_path, token, edit, says):
    tokenizer_refused(tmp_path, edit, f"token {token!r} id {says} >= config vocab_size 8192")


def test_a_tokenizer_with_an_empty_vocabulary_is_refused_at_load(tmp_path):
    def empty(tok):  # the added (special) tokens stay
        tok["model"]["vocab"], tok["model"]["merges"] = {}, []
    tokenizer_refused(tmp_path, empty, "the vocabulary is empty")


def test_a_tokenizer_of_fewer_tokens_than_half_the_rows_is_refused_at_load(tmp_path):
    def cut(tok):  # the first 1000 tokens, and the merges that make only them
        vocab = tok["model"]["vocab"] = {k: v for k, v in tok["model"]["vocab"].items() if v < 1000}
        tok["model"]["merges"] = [m for m in tok["model"]["merges"] if {*m, "".join(m)} <= vocab.keys()]
    tokenizer_refused(tmp_path, cut, "1000 tokens for the model's 8192 rows")


def test_a_tokenizer_whose_text_does_not_come_back_is_refused_at_load(tmp_path):
    def no_decoder(tok):  # byte-level pieces would reach the client: "The Ġcapital"
        tok["decoder"] = None
    tokenizer_refused(tmp_path, no_decoder, "text does not come back from its tokens")


def test_eos_ids_beyond_the_vocabulary_are_refused_at_load(tmp_path):
    """(The tokenizer's reader refuses them first, naming the file; check_tokenizer holds the
    same bound for a GGUF file's ids.)"""
    t = copy_of("target", tmp_path / "t")
    (t / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9000]}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id: expected an int or a list "
                                              "of ints inside the"):
        Engine.from_pretrained(str(t), None, mode="ar", device="cpu", max_ctx=64)


# ---- special-token ids outside the vocabulary ---------------------------------------------------

@pytest.mark.parametrize("value", [8192, -1, [2, 9000], [2.0], "2"])
def test_a_config_eos_id_outside_the_vocabulary_is_refused_as_the_config_is_read(tmp_path, value):
    """It decides where generation stops; before, read_configs (and so `flashtree plan`) took it,
    and only the tokenizer refused it, against its own size, once the engine loaded it."""
    says = refused(tmp_path, "config.json: eos_token_id: expected an int or a list of ints inside the vocabulary "
                             "(0 to 8191: config vocab_size 8192), got ", target={"eos_token_id": value})
    assert says.endswith(repr(value)), says


def test_bos_and_pad_ids_outside_the_vocabulary_are_ignored(tmp_path):
    """The engine reads neither (load_tokenizer's docstring says why), and working checkpoints
    carry such ids (`pad_token_id: -1`), so they load as before."""
    t = copy_of("target", tmp_path / "t", {"bos_token_id": 9000, "pad_token_id": -1})
    (t / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": -7,
                                                          "pad_token_id": 10 ** 6}))
    engine = Engine.from_pretrained(str(t), None, mode="ar", device="cpu", max_ctx=64)
    assert engine.tokenizer.eos_token_ids == [2, 0]


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    """A GGUF file whose header names bos (a LLaMA config's bos_token_id) and eos ids."""
    root = tmp_path_factory.mktemp("ids")
    convert(make_target(root / "hf", arch="llama", layers=1, hidden=64), root / "model.gguf")
    return root / "model.gguf"


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.bos_token_id", 400), ("tokenizer.ggml.eos_token_id", 9000)])
def test_a_gguf_special_id_outside_the_vocabulary_is_refused_as_the_header_is_read(gguf_target, tmp_path, key,
                                                                                  value):
    """Both are read (bos: the chat template's bos_token, prepended where add_bos_token says so;
    eos ends generation): before, `flashtree plan` took them, and only the tokenizer refused them
    once the engine loaded."""
    bad = rewrite(gguf_target, tmp_path / "ids.gguf", {key: value})
    with pytest.raises(CheckpointError) as info:
        read_configs(bad, None)
    assert str(info.value) == f"{bad.resolve()}: {key}: {value} is not a token id (the vocabulary has 400 tokens)"


def test_a_gguf_padding_id_outside_the_vocabulary_is_ignored(gguf_target, tmp_path):
    """Read nowhere, as an HF config's pad_token_id."""
    bad = rewrite(gguf_target, tmp_path / "pad.gguf", {"tokenizer.ggml.padding_token_id": 9000})
    read_configs(bad, None)
    assert load_tokenizer(bad).eos_token_ids == load_tokenizer(gguf_target).eos_token_ids


@pytest.mark.parametrize("quantization", [None, {}])
def test_a_quantization_config_of_null_or_nothing_says_none(tmp_path, quantization):
    t = copy_of("target", tmp_path / "t", weights_too=False)
    config = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    read_configs(t, None)


@pytest.mark.parametrize("quantization", [{"quant_method": "fp8", "weight_block_size": [128, 128]},
                                          {"quant_method": "awq", "bits": 4}, "fp8"])
def test_a_checkpoint_another_tool_quantized_is_refused_naming_it(tmp_path, quantization):
    t = copy_of("target", tmp_path / "t")
    config = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    method = quantization["quant_method"] if isinstance(quantization, dict) else "unnamed"
    with pytest.raises(CheckpointError, match=re.escape(f"quantization_config: a checkpoint quantized by another "
                                                        f"tool ({method!r}) is not read")):
        read_configs(t, None)


# ---- a context past the trained positions: said, not refused ------------------------------------

def test_a_context_past_the_trained_positions_is_logged_unless_rope_scaling_is_set(tmp_path, caplog):
    t = copy_of("target", tmp_path / "t", {"max_position_embeddings": 32})
    with caplog.at_level(logging.WARNING, logger="flashtree.engine"):
        Engine.from_pretrained(str(t), None, mode="ar", device="cpu", max_ctx=64)
    assert any("--max-ctx 64 is past the 32 positions" in r.getMessage() for r in caplog.records)
    _, within, _ = read_configs(t, None)
    assert positions_past_training(within, 32) is None
    scaled = copy_of("target", tmp_path / "s", {"max_position_embeddings": 32, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, weights_too=False)
    _, yarn, _ = read_configs(scaled, None)
    assert positions_past_training(yarn, 64) is None
