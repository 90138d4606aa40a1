"""`--draft mtp` with a GGUF target: a tiny random Qwen3.5 checkpoint with an MTP layer
(tiny_models.add_mtp) written as llama.cpp's converter writes it (gguf_convert.convert with
`mtp`: one more block, nextn_predict_layers 1, `blk.N.nextn.*` and the layer's tensors, norms
stored 1 + w) in F32, F16 and Q8_0:

- the target reads exactly its own layers: the same weights and tokens as the file without the block;
- the MTP draft from the file holds the weights of a safetensors copy holding the file's values
  (its quantized linears stay quantized), proposes that copy's drafts step by step, and greedy
  chain and ddtree output equal AR token for token;
- the memory plan counts the draft's weights as loaded (--quantize-draft int4 too), and the
  target's without the block;
- a nextn block without one of its tensors is a CheckpointError naming it, a file without the
  block the ConfigError that says so."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from flashtree import Engine
from flashtree.config import EngineConfig
from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.loader import load_draft, read_configs
from flashtree.models.mtp import MTPConfig, MTPDraft
from flashtree.models.quant import QuantizedLinear
from flashtree.runtime.byte_counts import gguf_weight_bytes
from gguf_convert import convert, rewrite, save_reference
from test_gguf import load, weights
from test_memory_plan import item
from tiny_models import add_mtp, make_target

CPU = torch.device("cpu")
LAYERS = 3  # its last layer full attention (the GGUF pattern: every third)
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9, 31, 200, 11]
N_TOKENS = 24
TYPES = [Q.F32, Q.F16, Q.Q8_0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return add_mtp(make_target(tmp_path_factory.mktemp("mtp_gguf") / "hf", arch="qwen3_5", layers=LAYERS,
                                   hidden=256))  # value heads of 32: Q8_0 groups stay whole (out_proj)


@pytest.fixture(scope="module", params=TYPES, ids=lambda q: q.name)
def files(request, checkpoint, tmp_path_factory):
    """(the file with the MTP block, the same without it, a safetensors copy of what the first holds)."""
    root = tmp_path_factory.mktemp(request.param.name)
    held = convert(checkpoint, root / "mtp.gguf", request.param, mtp=True)
    convert(checkpoint, root / "plain.gguf", request.param)
    assert {"mtp.fc.weight", "mtp.norm.weight"} <= held.keys()
    return root / "mtp.gguf", root / "plain.gguf", save_reference(checkpoint, held, root / "copy")


def engine(target, mode, **kw):
    return Engine.from_pretrained(str(target), None if mode == "ar" else "mtp", device="cpu", mode=mode,
                                  max_ctx=256, max_sequences=1, prefill_ubatch=7, **kw)


def mtp_draft(target):
    _, _, cfg = read_configs(target, target, mtp=True)
    assert isinstance(cfg, MTPConfig) and cfg.target_layer_ids == [LAYERS - 1]
    return load_draft(target, cfg, torch.float32, CPU, 64)


def test_the_target_reads_its_own_layers_alone(files):
    with_mtp, plain, _ = files
    raw, cfg, _ = read_configs(with_mtp, None)
    assert cfg.num_layers == LAYERS and raw["mtp_num_hidden_layers"] == 1
    ours, theirs = weights(load(with_mtp)), weights(load(plain))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert gguf_weight_bytes(with_mtp, torch.float32, LAYERS) == gguf_weight_bytes(plain, torch.float32, LAYERS)
    want = engine(plain, "ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    assert engine(with_mtp, "ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == want


def test_the_draft_holds_the_weights_of_a_safetensors_copy(files):
    with_mtp, _, copy = files
    draft, reference = mtp_draft(with_mtp), mtp_draft(copy)
    assert isinstance(draft, MTPDraft)
    quantized = [m for m in draft.modules() if isinstance(m, QuantizedLinear)]
    assert bool(quantized) == (Q.Q8_0.name in with_mtp.parent.name)  # Q8_0 linears stay quantized, fc too
    ours, theirs = weights(draft), weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:  # float32 rounding of the converter's 1 + w norms
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_greedy_equals_ar_and_each_draft_is_the_copys(files, mode):
    with_mtp, _, copy = files
    want = engine(with_mtp, "ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    res = engine(with_mtp, mode).generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    assert res.token_ids == want
    ref = engine(copy, mode).generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
    drafts = [step["draft_tokens"] for step in res.trace]
    assert drafts == [step["draft_tokens"] for step in ref.trace] and any(drafts)


@pytest.mark.parametrize("quantize_draft", [None, "int4"])
def test_the_plan_counts_the_draft_as_loaded(files, quantize_draft, capsys):
    """With --quantize-draft int4 too (the file's wider slots rounded to it, dense ones
    quantized), whose draft still leaves the output AR's."""
    from flashtree.cli import main

    with_mtp, _, _ = files
    eng = engine(with_mtp, "ddtree", quantize_draft=quantize_draft)
    assert item(eng.memory_plan, "draft weights") == sum(t.numel() * t.element_size()
                                                         for t in eng.draft.state_dict().values())
    if quantize_draft:
        assert {m.bits for m in eng.draft.modules() if isinstance(m, QuantizedLinear)} == {4}
        want = engine(with_mtp, "ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
        assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == want
    flags = ["--quantize-draft", quantize_draft] if quantize_draft else []
    assert main(["plan", "--target", str(with_mtp), "--draft", "mtp", "--device", "cpu", *flags]) == 0
    assert "draft weights" in capsys.readouterr().out


def test_a_missing_nextn_tensor_is_named(files, tmp_path):
    with_mtp, _, _ = files
    name = f"blk.{LAYERS}.nextn.hnorm.weight"
    broken = rewrite(with_mtp, tmp_path / "broken.gguf", left_out=(name,))
    assert read_configs(broken, None)[1].num_layers == LAYERS  # the target alone does not read the block
    with pytest.raises(CheckpointError, match=rf"{name}: missing"):
        Engine(EngineConfig(target=str(broken), draft="mtp", device="cpu"))


def test_a_file_without_the_block_is_refused(files):
    _, plain, _ = files
    with pytest.raises(ConfigError, match="has no MTP layer"):
        Engine(EngineConfig(target=str(plain), draft="mtp", device="cpu"))
