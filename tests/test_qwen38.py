"""Qwen3.8 checkpoints. Qwen/Qwen3.8-27B publishes Qwen3.5's architecture under Qwen3.5's names
(`Qwen3_5ForConditionalGeneration`, model_type `qwen3_5`, text_config `qwen3_5_text`, the text
weights under `model.language_model.*`), its text_config adding `output_gate_type: "swish"` (the
DeltaNet output gate's activation: SiLU, as Qwen3.5 computes) and `mtp_use_dedicated_embeddings:
false`. A random checkpoint in that format, written by transformers, equals transformers' logits,
decodes greedily with a DFlash draft and with its own MTP layer as it does alone, and loads from
a GGUF file as llama.cpp's converter writes it (`qwen35`). Qwen3.8-Flash-Next (Qwen4Exp) is
another architecture and is refused naming it (tests/test_registry.py)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree import Engine
from flashtree.checkpoint.gguf_file import open_gguf
from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.loader import read_configs
from flashtree.models.mtp import MTPConfig
from flashtree.models.qwen35 import HybridConfig, text_weights
from flashtree.models.registry import by_model_type
from gguf_convert import Q, convert
from test_hybrid import IDS, PROMPT, hf_logits, ours, prefill, rel_err
from tiny_models import add_mtp, make_draft, make_target

# Qwen/Qwen3.8-27B's text_config keys beyond those tiny_models writes for Qwen3.5, at their
# published values (mrope_section scaled to the tiny head: its sum is the rotary half-width)
QWEN38_TEXT = {"output_gate_type": "swish", "attn_output_gate": True, "mamba_ssm_dtype": "float32",
               "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "full_attention_interval": 3,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_interleaved": True, "mrope_section": [1, 1, 0]}}
LAYERS = 6  # two groups of (2 DeltaNet layers, 1 full attention): full_attention_interval 3
N_TOKENS = 24


@pytest.fixture(scope="module")
def qwen38(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("qwen38"), arch="qwen3_5_vl", layers=LAYERS,
                       text_extra=QWEN38_TEXT)


def test_the_checkpoint_is_in_the_published_format(qwen38):
    cfg = json.loads((qwen38 / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_text" and by_model_type(cfg["model_type"]).name == "qwen3.5"
    assert {k: text[k] for k in QWEN38_TEXT} == QWEN38_TEXT
    names = load_file(str(qwen38 / "model.safetensors"))
    assert any(k.startswith("model.language_model.layers.0.linear_attn.") for k in names)


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [20, 7])
def test_logits_match_transformers(qwen38, chunk):
    got, _ = prefill(ours(qwen38), IDS, chunk)
    assert rel_err(got, hf_logits(qwen38, IDS)) < 1e-4


def engine(target, draft, **kw):
    return Engine.from_pretrained(str(target), draft and str(draft), device="cpu", max_ctx=256,
                                  max_sequences=1, prefill_ubatch=7, **kw)


def greedy(eng):
    return eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids


@pytest.fixture(scope="module")
def reference(qwen38):
    return greedy(engine(qwen38, None, mode="ar"))


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_greedy_spec_with_a_dflash_draft_equals_ar(qwen38, reference, mode, tmp_path):
    draft = make_draft(tmp_path / "draft", qwen38, block_size=8, layers=1, target_layer_ids=[1, 4])
    assert greedy(engine(qwen38, draft, mode=mode)) == reference


def test_greedy_ddtree_with_its_mtp_layer_equals_ar(qwen38, reference, tmp_path):
    target = add_mtp(shutil.copytree(qwen38, tmp_path / "with_mtp"))
    assert greedy(engine(target, "mtp", mode="ddtree", block_size=4)) == reference


def test_a_gguf_of_it_loads_as_qwen35(qwen38, reference, tmp_path):
    """llama.cpp's converter writes the text model of a Qwen3_5ForConditionalGeneration checkpoint
    as `qwen35`, its text_config flattened and `model.language_model.` stripped: done here by
    hand, then through the test converter. The file's greedy tokens are the checkpoint's."""
    flat = shutil.copytree(qwen38, tmp_path / "flat")
    cfg = json.loads((flat / "config.json").read_text())
    (flat / "config.json").write_text(json.dumps(dict(cfg["text_config"],
                                                      tie_word_embeddings=cfg["tie_word_embeddings"])))
    save_file(text_weights(load_file(str(flat / "model.safetensors"))), str(flat / "model.safetensors"))
    convert(flat, tmp_path / "qwen38.gguf", Q.F32)
    assert open_gguf(tmp_path / "qwen38.gguf").arch == "qwen35"
    assert greedy(engine(tmp_path / "qwen38.gguf", None, mode="ar")) == reference


@pytest.mark.parametrize("gate", ["swish", "silu", None])
def test_a_silu_output_gate_loads(gate):
    text = {k: v for k, v in json_text().items() if gate is not None or k != "output_gate_type"}
    if gate:
        text["output_gate_type"] = gate
    assert HybridConfig.from_hf({"model_type": "qwen3_5", "text_config": text}).num_layers == LAYERS


def test_another_output_gate_is_refused_naming_the_key():
    text = dict(json_text(), output_gate_type="sigmoid")
    with pytest.raises(CheckpointError, match="output_gate_type: 'sigmoid' is not supported"):
        HybridConfig.from_hf({"model_type": "qwen3_5", "text_config": text})


def test_an_mtp_layer_with_its_own_embeddings_is_refused(qwen38, tmp_path):
    """The layer reads the target's embedding table; one that ships its own is not run."""
    target = add_mtp(shutil.copytree(qwen38, tmp_path / "with_mtp"))
    raw, cfg, _ = read_configs(target, None)
    raw["text_config"]["mtp_use_dedicated_embeddings"] = True
    with pytest.raises(ConfigError, match="mtp_use_dedicated_embeddings is true"):
        MTPConfig.of_target(raw, cfg, target)


def json_text():
    """A Qwen3.8-format text_config (no weights needed)."""
    common = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, model_type="qwen3_5_text")
    return dict(common, **QWEN38_TEXT)
