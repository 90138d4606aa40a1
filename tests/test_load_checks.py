"""A model that cannot serve is refused at load, GGUF or safetensors: no
layers, a NaN weight (dense or in a quantized block's scale), a NaN norm epsilon, a RoPE base at
or below zero, key/value heads that do not divide the query heads, a tensor in another shape than
the config implies. Before, each loaded, and then every request failed or was answered with ""
and finish_reason stop. The error names the file, the key or tensor, and what is wrong; the CLI
prints it as one line and exits 2."""

import json
import math
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from flashtree.errors import CheckpointError
from flashtree.models.loader import load_draft, load_target, read_configs
from gguf_convert import convert, rewrite
from test_cli_usage import assert_one_line_error, run
from test_gguf_header import file_refused, refused
from tiny_models import add_mtp, make_dflash2_draft, make_draft, make_target

CPU = torch.device("cpu")


def load(path, quantize=None):
    _, cfg, _ = read_configs(path, None)
    return load_target(path, cfg, torch.float32, CPU, 64, quantize)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("checks") / "hf", arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def files(hf):
    """The checkpoint as GGUF files: all F32, and Q8_0 (its linear weights stay quantized)."""
    convert(hf, hf.parent / "f32.gguf", Q.F32)
    convert(hf, hf.parent / "q8.gguf", Q.Q8_0)
    return hf.parent / "f32.gguf", hf.parent / "q8.gguf"


# ---- GGUF -------------------------------------------------------------------------------------

METADATA = {  # what the file says -> (the keys changed, where, what is wrong)
    "no layers": ({"qwen3.block_count": 0}, "qwen3.block_count", "must be at least 1, found 0"),
    "NaN norm epsilon": ({"qwen3.attention.layer_norm_rms_epsilon": math.nan},
                         "qwen3.attention.layer_norm_rms_epsilon", "must be a positive finite number, found nan"),
    "negative RoPE base": ({"qwen3.rope.freq_base": -10000.0}, "qwen3.rope.freq_base",
                           "must be a positive finite number, found -10000.0"),
    "3 kv heads for 4": ({"qwen3.attention.head_count_kv": 3}, "num_key_value_heads",
                         "3 does not divide num_attention_heads 4"),
    "head size not given, heads not dividing": (
        {"qwen3.attention.key_length": None, "qwen3.attention.value_length": None, "qwen3.attention.head_count": 3},
        "qwen3.attention.head_count",
        "3 heads do not divide embedding_length 64, and no key_length gives the head size"),
}


@pytest.mark.parametrize("case", METADATA)
def test_gguf_metadata_that_cannot_serve_is_refused(files, case, tmp_path):
    changes, where, problem = METADATA[case]
    bad = rewrite(files[0], tmp_path / "bad.gguf", changes)
    file_refused(bad, where, re.escape(problem))


def with_nan(target):
    """A tensors hook for rewrite: one value of `target` becomes NaN."""
    def change(name, data):
        if name == target:
            data = data.copy()
            data.reshape(-1)[5] = np.nan
        return data
    return change


def infinite_scale(target):
    """Q8_0 blocks of `target` whose first block's float16 scale is +inf (bytes 00 7c)."""
    def change(name, blocks):
        if name == target:
            blocks = blocks.copy()
            blocks[0, :2] = (0x00, 0x7C)
        return blocks
    return change


@pytest.mark.parametrize("tensor,named,its", [
    ("blk.1.ffn_down.weight", "blk.1.ffn_down.weight", "its 8192"),
    ("blk.0.ffn_up.weight", "blk.0.ffn_gate/ffn_up.weight", "their 16384"),  # packed as gate_up_proj
])
def test_a_nan_gguf_weight_is_refused_under_the_files_name(files, tmp_path, tensor, named, its):
    bad = rewrite(files[0], tmp_path / "nan.gguf", tensors=with_nan(tensor))
    refused(lambda: load(bad), bad, named, rf"1 of {its} values are not finite \(NaN or infinity\)")


@pytest.mark.parametrize("tensor,named", [
    ("blk.0.attn_q.weight", r"blk.0.attn_q/attn_k/attn_v.weight (their quantized blocks' scale)"),  # qkv_proj.scale
    ("token_embd.weight", "token_embd.weight (its quantized blocks' scale)"),  # model.embed_tokens.scale
])
def test_an_infinite_quantized_scale_is_refused_under_the_files_name(files, tmp_path, tensor, named):
    bad = rewrite(files[1], tmp_path / "inf.gguf", tensors=infinite_scale(tensor))
    refused(lambda: load(bad), bad, named, r"\d+ of (its|their) \d+ values are not finite \(NaN or infinity\)")


def test_a_quantized_tensor_in_another_shape_than_the_config_is_refused(files, tmp_path):
    """The quantized slots are built from the file's own shapes, so this loaded before and failed
    in the first forward."""
    bad = rewrite(files[1], tmp_path / "ffn.gguf", {"qwen3.feed_forward_length": 96})
    refused(lambda: load(bad), bad.resolve(), "blk.0.ffn_down.weight",
            re.escape("holds model.layers.0.mlp.down_proj.weight in shape (64, 128); the config implies (64, 96)"))


def test_a_misaligned_tensor_is_refused(files, tmp_path):
    """The data offset of the first tensor moved by 4 bytes: before, it loaded shifted weights."""
    reader = gguf.GGUFReader(str(files[0]))
    field = reader.tensors[0].field  # its parts end with the data offset
    blob = bytearray(files[0].read_bytes())
    offset = field.offset + sum(part.nbytes for part in field.parts[:-1])
    blob[offset:offset + 8] = (int(field.parts[-1][0]) + 4).to_bytes(8, "little")
    (tmp_path / "shifted.gguf").write_bytes(bytes(blob))
    refused(lambda: load(tmp_path / "shifted.gguf"), (tmp_path / "shifted.gguf").resolve(), reader.tensors[0].name,
            "data offset 4 is not a multiple of the file's alignment 32")


# ---- safetensors ------------------------------------------------------------------------------

def edited(hf, out, config=None, weights=None):
    """A copy of the checkpoint `hf` with config.json keys set to `config` and weights changed by
    `weights(state)`."""
    shutil.copytree(hf, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **config}))
    if weights:
        state = load_file(str(out / "model.safetensors"))
        weights(state)
        save_file(state, str(out / "model.safetensors"))
    return out


CONFIGS = {  # config.json key -> (value, what the error says after the file)
    "num_hidden_layers": (0, "num_hidden_layers: must be at least 1, found 0"),
    "rms_norm_eps": (math.nan, "rms_norm_eps: must be a positive number of at most 0.01, found nan"),
    "rope_parameters": ({"rope_type": "default", "rope_theta": -1.0},
                        "rope_theta: must be a positive finite number, found -1.0"),
    "num_key_value_heads": (3, "num_key_value_heads: 3 does not divide num_attention_heads 4"),
    "intermediate_size": ("wide", "malformed config: intermediate_size: must be an integer, found 'wide'"),
}


@pytest.mark.parametrize("key", CONFIGS)
def test_a_config_that_cannot_serve_is_refused(hf, key, tmp_path):
    value, says = CONFIGS[key]
    bad = edited(hf, tmp_path / "bad", config={key: value})
    with pytest.raises(CheckpointError) as info:
        read_configs(bad, None)
    assert str(info.value) == f"{bad / 'config.json'}: {says}"


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_nan_safetensors_weight_is_refused(hf, quantize, tmp_path):
    def poison(state):
        state["model.layers.0.self_attn.o_proj.weight"][3, 7] = math.inf
        state["model.layers.0.self_attn.o_proj.weight"][4, 0] = math.nan
    bad = edited(hf, tmp_path / "bad", weights=poison)
    refused(lambda: load(bad, quantize), bad, "model.layers.0.self_attn.o_proj.weight",
            r"2 of its 4096 values are not finite \(NaN or infinity\)")


def nan_at(name):
    def edit(state):
        state[name][0, 0] = math.nan
    return edit


def zeroed(*names):
    def edit(state):
        for name in names:
            state[name].zero_()
    return edit


@pytest.mark.parametrize("edit,named,says", [
    (nan_at("model.layers.1.self_attn.k_proj.weight"), "model.layers.1.self_attn.q_proj/k_proj/v_proj.weight",
     r"1 of their 8192 values are not finite \(NaN or infinity\)"),
    (zeroed("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"),
     "model.layers.1.mlp.gate_proj/up_proj.weight",
     r"every value is 0 \(a download cut short and zero-filled\?\): no trained weight matrix is"),
])
def test_a_packed_weight_is_refused_under_the_files_names(hf, tmp_path, edit, named, says):
    """The model packs q/k/v and gate/up into one matrix at load (qkv_proj, gate_up_proj), whose
    name the error gave: one no file holds."""
    bad = edited(hf, tmp_path / "bad", weights=edit)
    refused(lambda: load(bad), bad, named, says)


def test_a_nan_draft_weight_is_refused(hf, tmp_path):
    draft = make_draft(tmp_path / "draft", hf)
    state = load_file(str(draft / "model.safetensors"))
    state["fc.weight"][0, 0] = math.nan
    save_file(state, str(draft / "model.safetensors"))
    _, _, cfg = read_configs(hf, draft)
    refused(lambda: load_draft(draft, cfg, torch.float32, CPU, 64), draft, "fc.weight",
            r"1 of its \d+ values are not finite \(NaN or infinity\)")


# ---- drafts whose finite weights overflow in a forward -----------------------------------------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5 target with the MTP layer its published checkpoints ship (`--draft mtp`)."""
    return add_mtp(make_target(tmp_path_factory.mktemp("mtp") / "hybrid", arch="qwen3_5", layers=4, hidden=64))


def overflowing_draft(kind, hf, hybrid, out, tensor, value):
    """(the draft's directory, its config) of a draft of `kind` whose `tensor` holds `value`
    everywhere: a DFlash or DFlash2 draft for `hf`, or the MTP layer of a copy of `hybrid`."""
    if kind == "mtp":
        draft = shutil.copytree(hybrid, out)
    else:
        draft = (make_dflash2_draft if kind == "dflash2" else make_draft)(out, hf)
    state = load_file(str(draft / "model.safetensors"))
    state[tensor] = torch.full_like(state[tensor], value)
    save_file(state, str(draft / "model.safetensors"))
    _, _, cfg = read_configs(draft, None, mtp=True) if kind == "mtp" else read_configs(hf, draft)
    return draft, cfg


@pytest.mark.parametrize("kind,tensor,value,found,quantize", [
    ("dflash", "layers.0.mlp.down_proj.weight", 3.4e38, "NaN or infinity", None),
    ("dflash", "layers.0.mlp.down_proj.weight", 3.4e38, "NaN or infinity", "int8"),
    ("dflash", "hidden_norm.weight", 3.4e38, "NaN or infinity", None),  # the context rows' norm
    # a stream beyond ~1e19: its norm's float32 mean square overflows, and the final norm gives 0
    ("dflash", "layers.0.self_attn.o_proj.weight", 1e20, "rows of 0", None),
    ("dflash2", "candidate_selector.successor_codebook", 3.4e38, "NaN or infinity", None),
    ("dflash2", "layers.1.mlp_conv.base_kernel", 3.4e38, "NaN or infinity", None),
    ("mtp", "mtp.pre_fc_norm_hidden.weight", 3.4e38, "NaN or infinity", None),
    ("mtp", "mtp.fc.weight", 1e20, "rows of 0", None),
])
def test_a_draft_whose_finite_weights_overflow_is_refused_at_load(hf, hybrid, tmp_path, kind, tensor, value,
                                                                 found, quantize):
    """check_finite passes such weights; the draft loaded without a word, and then proposed garbage
    that verification never accepted: exact output at the speed of no draft, with no reason given."""
    draft, cfg = overflowing_draft(kind, hf, hybrid, tmp_path / "draft", tensor, value)
    with pytest.raises(CheckpointError) as info:
        load_draft(draft, cfg, torch.float32, CPU, 64, quantize)
    assert str(info.value).startswith(f"{draft}: the draft's outputs are not finite on a test input ({found}"), \
        str(info.value)


@pytest.mark.parametrize("dtype,quantize", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")])
def test_the_embedded_draft_passes_the_check(dtype, quantize):
    assets = Path(__file__).resolve().parents[1] / "flashtree" / "assets"
    _, _, cfg = read_configs(assets / "target", assets / "draft")
    load_draft(assets / "draft", cfg, dtype, CPU, 64, quantize)


# ---- the CLI, run as a user runs it: one line, exit 2 -----------------------------------------

def test_the_cli_refuses_a_model_without_layers_in_one_line(files, tmp_path):
    bad = rewrite(files[0], tmp_path / "layers.gguf", {"qwen3.block_count": 0})
    assert_one_line_error(run("plan", "--target", str(bad), "--mode", "ar", "--gpu-memory", "24G"),
                          "qwen3.block_count: must be at least 1, found 0")


def test_the_cli_refuses_nan_weights_in_one_line(files, tmp_path):
    bad = rewrite(files[0], tmp_path / "nan.gguf", tensors=with_nan("output_norm.weight"))
    assert_one_line_error(run("generate", "--target", str(bad), "--device", "cpu", "--mode", "ar", "--max-tokens", "2",
                              "--prompt", "hi"), "output_norm.weight: 1 of its 64 values are not finite")


def test_a_parse_error_that_names_the_file_only_inside_its_text_still_gets_the_file_first(tmp_path):
    """The loader prefixes a config error with its file unless the error already starts with it;
    a message that mentions the path further in (a key whose value is that path) is prefixed."""
    from flashtree.models.loader import _checked
    source = tmp_path / "config.json"

    def parse(raw):
        raise CheckpointError(f"tokenizer_file: {source} is not a tokenizer")

    with pytest.raises(CheckpointError) as refused_error:
        _checked(parse, {}, source)
    assert str(refused_error.value) == f"{source}: tokenizer_file: {source} is not a tokenizer"

    def parse_named(raw):
        raise CheckpointError(f"{source}: num_hidden_layers: must be at least 1")

    with pytest.raises(CheckpointError) as named_error:
        _checked(parse_named, {}, source)
    assert str(named_error.value) == f"{source}: num_hidden_layers: must be at least 1"
