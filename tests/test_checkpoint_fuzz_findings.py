"""Hostile checkpoints a fuzzer found served as garbage, or refused for the wrong reason: each is
now refused at load (or as the config is read, so by `flashtree plan` too) in one line naming
the file, the key or token, and what is wrong; what serves correctly still loads.

- an added token whose id is another token's (checkpoint/tokenizer.py, check_added_token_ids);
- a normalizer that lowercases (models/checks.py, _text_lost: it was blamed on the decoder);
- partial_rotary_factor with linear / llama3 / yarn RoPE in a whole-head-RoPE model
  (models/common.py, check_whole_head_rope: transformers cannot run it, flashtree ignored it);
- a DFlash draft reading no target layers (models/dflash.py, draft_fields).
"""

import json
import math
import re
import shutil

import pytest
import torch
import transformers

from flashtree.checkpoint import load_tokenizer
from flashtree.errors import CheckpointError
from flashtree.models.checks import check_tokenizer
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import read_configs
from flashtree.runtime.engine import Engine
from test_hostile_model_configs import ASSETS, HYBRID, copy_of, refused, tokenizer_refused
from test_models import hf_logits, rel_err, target_model
from tiny_models import make_target, make_tokenizer

VOCAB = json.loads((ASSETS / "target" / "tokenizer.json").read_text())["model"]["vocab"]
AT = {i: t for t, i in VOCAB.items()}


def added(token_id: int, content: str) -> dict:
    return dict(id=token_id, content=content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                special=True)


def tokenizer_dir(tmp_path, edit):
    """The embedded target's tokenizer files alone, tokenizer.json edited by `edit`."""
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "target" / name, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    edit(tok)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


# ---- 1. an added token whose id another token has ---------------------------------------------

def test_an_added_token_colliding_with_a_vocabulary_token_is_refused_at_load(tmp_path):
    """It became id 8192, and was refused as past the rows, which said nothing of the cause."""
    tokenizer_refused(tmp_path, lambda tok: tok["added_tokens"].append(added(600, "<|tool|>")),
                      f"added_tokens: '<|tool|>' has id 600, which the vocabulary's token {AT[600]!r} has; "
                      "tokenizers gives '<|tool|>' id 8192 instead")


def test_a_collision_is_refused_where_the_model_has_rows_past_the_vocabulary(tmp_path):
    """A padded embedding (more rows than tokens, as Qwen's) took the moved token's id: the model
    loaded and read "<|tool|>" as an untrained row, and wrote it as the vocabulary's token."""
    target = make_target(tmp_path / "t", vocab_size=512, layers=1, hidden=32)
    assert make_tokenizer(target) == 400
    tok = json.loads((target / "tokenizer.json").read_text())
    holder = next(t for t, i in tok["model"]["vocab"].items() if i == 300)
    tok["added_tokens"].append(added(300, "<|tool|>"))
    (target / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{target / 'tokenizer.json'}: added_tokens: '<|tool|>' has id 300, which the vocabulary's token "
            f"{holder!r} has; tokenizers gives '<|tool|>' id 400 instead, so the model would read and write it "
            "as another token")):
        Engine.from_pretrained(str(target), None, mode="ar", device="cpu", max_ctx=64)


@pytest.mark.parametrize("entries,says", [
    ([added(8192, "<|a|>"), added(8192, "<|b|>")], "'<|b|>' has id 8192, which the added token '<|a|>' has too; "
                                                   "tokenizers gives '<|b|>' id 8193"),
    ([added(8200, "<|gap|>")], "'<|gap|>' has id 8200, which is not the next id after the vocabulary's and the "
                               "added tokens' before it; tokenizers gives '<|gap|>' id 8192"),
    ([added(8192, AT[600])], f"{AT[600]!r} has id 8192, but the vocabulary holds it as id 600; tokenizers gives "
                             f"{AT[600]!r} id 600"),
], ids=["same id twice", "id past a gap", "a vocabulary token under another id"])
def test_an_added_token_that_tokenizers_gives_another_id_is_refused(tmp_path, entries, says):
    t = tokenizer_dir(tmp_path, lambda tok: tok["added_tokens"].extend(entries))
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{t / 'tokenizer.json'}: added_tokens: {says}")):
        load_tokenizer(t)


def test_an_added_token_that_is_the_vocabularys_own_at_its_id_loads(tmp_path):
    """The usual case (Qwen lists its specials in the vocabulary and in added_tokens)."""
    t = tokenizer_dir(tmp_path, lambda tok: tok["added_tokens"].append(added(600, AT[600])))
    tokenizer = load_tokenizer(t)
    assert tokenizer.token_to_id(AT[600]) == 600 and tokenizer.id_to_token(600) == AT[600]


# ---- 2. a normalizer that lowercases ----------------------------------------------------------

@pytest.mark.parametrize("normalizer", [
    {"type": "Lowercase"},
    {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]},
], ids=["Lowercase", "Sequence"])
def test_a_lowercasing_normalizer_is_refused_as_such(tmp_path, normalizer):
    """tokenizers lowercases the text before it is tokenized: the text does not come back, and
    the error blamed the decoder ("no decoder, or a broken one?"), which was sound."""
    def lower(tok):
        tok["normalizer"] = normalizer
    tokenizer_refused(tmp_path, lower, "normalizer: lowercases every text before it is tokenized ('Hello, world! "
                                       "The answer is 42.\\nIt costs $3.50 (or so).' decodes as 'hello, world! the "
                                       "answer is 42.\\nit costs $3.50 (or so).'): each prompt would reach the model "
                                       "changed, its code, names and tool-call arguments without their case, and 2040 "
                                       "of its tokens hold capitals that no text could then make")


def test_a_normalizer_that_keeps_the_text_passes(tmp_path):
    def nfc(tok):
        tok["normalizer"] = {"type": "NFC"}
    t = tokenizer_dir(tmp_path, nfc)
    check_tokenizer(load_tokenizer(t), 8192, t)


# ---- 3. partial_rotary_factor in a whole-head-RoPE model --------------------------------------

SCALINGS = {"yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
            "linear": {"rope_type": "linear", "factor": 2.0},
            "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 2048}}


@pytest.mark.parametrize("kind", SCALINGS)
@pytest.mark.parametrize("where", ["top", "rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("side", ["target", "draft"])
def test_partial_rotary_with_rope_scaling_is_refused_as_the_config_is_read(tmp_path, kind, where, side):
    """It was ignored: RoPE turned the whole head, where the config asks for half of it."""
    rope = dict(SCALINGS[kind], rope_theta=1e6)
    if where == "top":
        edit = {"rope_scaling": rope, "partial_rotary_factor": 0.5}
    else:
        edit = {"rope_parameters" if where == "rope_parameters" else "rope_scaling": dict(rope, partial_rotary_factor=0.5)}
    key = "partial_rotary_factor" if where == "top" else f"{where}.partial_rotary_factor"
    says = refused(tmp_path, f"config.json: {key}: 0.5 with {kind} RoPE scaling is not supported: this model's RoPE "
                             f"turns all 64 dimensions of a head, and transformers sizes a {kind} table for 32 of "
                             "them, which it then cannot apply; remove the key", **{side: edit})
    assert "malformed" not in says


@pytest.mark.parametrize("edit", [
    {"rope_scaling": dict(SCALINGS["yarn"], partial_rotary_factor=1.0)},
    {"partial_rotary_factor": 0.5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
], ids=["yarn, factor 1", "default, top", "default, rope_parameters"])
def test_partial_rotary_that_transformers_runs_still_loads(tmp_path, edit):
    t = copy_of("target", tmp_path / "t", edit, weights_too=False)
    assert read_configs(t, None)[1].rotary_dim == 64


@pytest.mark.parametrize("value,says", [("0.5", "must be a number, found '0.5'"),
                                         (math.inf, "must be a finite number, found inf"),
                                         (math.nan, "must be a finite number, found nan")])
def test_partial_rotary_factor_must_be_a_finite_number(tmp_path, value, says):
    refused(tmp_path, f"rope_scaling.partial_rotary_factor: {says}",
            target={"rope_scaling": dict(SCALINGS["yarn"], partial_rotary_factor=value)})


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_hybrids_partial_rotary_factor_must_be_finite(tmp_path, value):
    """Infinity made int() raise OverflowError, which the config reader let through: a traceback."""
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text(json.dumps(dict(HYBRID, rope_parameters=dict(
        HYBRID["rope_parameters"], partial_rotary_factor=value))))
    with pytest.raises(CheckpointError, match=re.escape(f"config.json: malformed config: partial_rotary_factor: "
                                                        f"must be a finite number, found {value}")):
        read_configs(tmp_path / "h", None)


@pytest.mark.parametrize("kind", SCALINGS)
def test_transformers_cannot_run_partial_rotary_with_rope_scaling(kind):
    """Why it is refused, not applied: the reference sizes the table for the factor's share of
    the head and then fails to apply it. (If this starts to pass, transformers defines the
    combination: apply it in rope.py, with a parity test, instead of refusing it.)"""
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=8192,
                                   rope_parameters=dict(SCALINGS[kind], rope_theta=1e4, partial_rotary_factor=0.5))
    model = transformers.Qwen3ForCausalLM(cfg)
    assert model.model.rotary_emb.inv_freq.shape == (4,)  # half of the head's 8 frequencies
    with pytest.raises(RuntimeError, match="must match the size"):
        model(torch.tensor([[1, 2, 3]]))


def test_partial_rotary_with_default_rope_matches_transformers(tmp_path):
    """transformers ignores the factor with default RoPE (the table spans the head), and so does
    flashtree: the logits agree."""
    target = make_target(tmp_path / "t", arch="qwen3", layers=1)
    cfg = json.loads((target / "config.json").read_text())
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
    (target / "config.json").write_text(json.dumps(cfg))
    ids = [5, 17, 99, 3, 250, 42, 7, 300]
    ref, _ = hf_logits(target, ids)
    model = target_model(target, 64)
    hidden, _ = model(ForwardInput.prefill(torch.tensor(ids), model.new_cache(64, torch.float32, "cpu")))
    assert rel_err(model.logits(hidden), ref) <= 1e-4


# ---- 4. a DFlash draft that reads no target layer ---------------------------------------------

@pytest.mark.parametrize("edit,key", [
    ({"dflash_config": {"target_layer_ids": [], "mask_token_id": 9}}, "dflash_config.target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 9}, "target_layer_ids": []}, "target_layer_ids"),
], ids=["dflash_config", "top level"])
def test_a_draft_with_no_target_layers_is_refused_as_the_config_is_read(tmp_path, edit, key):
    """It passed `flashtree plan`, and the load refused only its fc weight's shape, naming no key."""
    refused(tmp_path, f"config.json: {key}: must be a list of at least one layer id, found []", draft=edit)


@pytest.mark.parametrize("ids,says", [
    ([1, -1], "dflash_config.target_layer_ids: must be at least 0, found -1"),
    ([1, 6], "the draft does not fit the target"),
    ([1, "3"], "dflash_config.target_layer_ids: must be an integer, found '3'"),
])
def test_target_layer_ids_outside_the_target_are_refused(tmp_path, ids, says):
    refused(tmp_path, says, draft={"num_target_layers": None,
                                   "dflash_config": {"target_layer_ids": ids, "mask_token_id": 9}})


def test_top_level_target_layer_ids_are_read(tmp_path):
    """As every DFlash key (and as the GGUF draft writer reads them): they were ignored, and the
    draft read the default layers of num_target_layers."""
    t = copy_of("target", tmp_path / "t", weights_too=False)
    d = copy_of("draft", tmp_path / "d", {"dflash_config": {"mask_token_id": 9}, "target_layer_ids": [0, 5]},
                weights_too=False)
    assert read_configs(t, d)[2].target_layer_ids == [0, 5]
