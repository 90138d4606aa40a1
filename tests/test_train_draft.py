"""DFlash draft training on a tiny random target (CPU, float32)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flashtree.errors import CheckpointError
from flashtree.models.inputs import ForwardInput
from flashtree.train.corpus import write_jsonl
from flashtree.train.draft_model import block_forward
from flashtree.train.draft_train import (DraftTrainConfig, DraftTrainer, FrozenTarget, block_inputs,
                                         leading_matches, pick_anchors, train_draft)
from flashtree.train.datasets import load_draft_examples
from flashtree.train.loop import LoopConfig
from flashtree.train.target_train import save_target, target_config
from flashtree.train.tokenizer_train import save_tokenizer, train_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok_dir = tmp_path_factory.mktemp("tok")
    texts = [f"def f{i}(x):\n    return x + {i}\n" * 3 for i in range(50)]
    tok = train_tokenizer(texts, vocab_size=320)
    save_tokenizer(tok, tok_dir)
    cfg = target_config("test", tok)
    torch.manual_seed(0)
    hf = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    model = Qwen3ForCausalLM(hf)
    model.model.embed_tokens.weight.data.normal_(0.0, 0.15)  # a trained model's logit scale, not init's
    out = tmp_path_factory.mktemp("target")
    save_target(model, cfg, tok_dir, out)
    return out


@pytest.fixture(scope="module")
def target(target_dir: Path) -> FrozenTarget:
    return FrozenTarget(str(target_dir), CPU)


def _cycles(n: int, seed: int = 0) -> list[dict]:
    """Completions that cycle through four tokens from a random phase: easy for a draft to learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phase = rng.randrange(4)
        out.append({"prompt_ids": [rng.randint(20, 250) for _ in range(rng.randint(3, 12))],
                    "completion_ids": [40 + (phase + i) % 4 for i in range(rng.randint(20, 40))]})
    return out


def test_block_inputs_mask_and_labels() -> None:
    ids = torch.arange(100, 110)[None]  # one sequence of 10 tokens
    loss = torch.tensor([[False] * 4 + [True] * 6])
    lengths = torch.tensor([10])
    anchors, valid = pick_anchors(loss, lengths, None, None)
    assert anchors.tolist() == [[4, 5, 6, 7, 8]]  # loss positions that have a successor
    blk = block_inputs(ids, loss, lengths, anchors, valid, bs=4, mask_id=7)
    assert blk["tokens"][0, 0].tolist() == [104, 7, 7, 7]
    assert blk["labels"][0, 0].tolist() == [-100, 105, 106, 107]
    assert blk["labels"][0, 4].tolist() == [-100, 109, -100, -100]  # past the end: no label
    mask = blk["mask"][0]  # [A*bs, T + A*bs]
    assert mask.shape == (20, 30)
    row = mask[5]  # block 1 (anchor 5), position 1
    assert row[:10].tolist() == [True] * 5 + [False] * 5  # context strictly before the anchor
    assert row[10:].tolist() == [False] * 4 + [True] * 4 + [False] * 12  # its own block, both ways


def test_leading_matches() -> None:
    correct = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert leading_matches(correct).tolist() == [2, 0, 4]


def _draft(target: FrozenTarget, layers: int = 2) -> DraftTrainer:
    cfg = DraftTrainConfig(block_size=8, num_layers=layers, layer_ids=[0, 1], max_len=256)
    return DraftTrainer(target, [], cfg, CPU)


def test_training_forward_equals_inference_draft(target: FrozenTarget) -> None:
    """The batched, masked training pass must compute what flashtree's cached inference computes."""
    trainer = _draft(target)
    draft = trainer.draft.eval()
    for p in draft.parameters():  # make the norms non-trivial too
        p.data.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(10, 250, (1, 30))
    feats = target.features(ids, trainer.layer_ids)
    anchor, bs = 17, trainer.cfg.block_size
    tokens = torch.tensor([int(ids[0, anchor])] + [trainer.mask_id] * (bs - 1))
    emb = target.embed(tokens)
    positions = torch.arange(anchor, anchor + bs)
    cache = draft.new_cache(64, torch.float32, CPU)
    draft.write_context(ForwardInput(embeds=feats[0, :anchor], cache=cache,
                                     lengths=torch.zeros(1, dtype=torch.int32)))
    expected = draft(ForwardInput(embeds=emb, cache=cache, lengths=torch.tensor([anchor], dtype=torch.int32)))
    mask = torch.cat([torch.arange(30) < anchor, torch.ones(bs, dtype=torch.bool)])[None].expand(bs, -1)
    got = block_forward(draft, feats, torch.arange(30)[None], emb[None], positions[None], mask[None])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_block_never_sees_its_anchor_or_later_features(target: FrozenTarget) -> None:
    trainer = _draft(target, layers=1)
    ids = torch.randint(10, 250, (1, 24))
    loss = torch.zeros(1, 24, dtype=torch.bool)
    loss[0, 10:] = True
    anchors, valid = pick_anchors(loss, torch.tensor([24]), None, None)
    blk = block_inputs(ids, loss, torch.tensor([24]), anchors, valid, 8, trainer.mask_id)
    feats = target.features(ids, trainer.layer_ids)
    emb = target.embed(blk["tokens"]).view(1, -1, feats.shape[-1] // 2)
    run = lambda f: block_forward(trainer.draft, f, torch.arange(24)[None], emb, blk["pos"].view(1, -1),  # noqa: E731
                                  blk["mask"]).view(1, anchors.shape[1], 8, -1)
    base = run(feats)
    a = int((anchors[0] == 15).nonzero())
    later = feats.clone()
    later[0, 15:] += 1.0  # the anchor's own feature and everything after it
    assert torch.equal(run(later)[0, a], base[0, a])
    earlier = feats.clone()
    earlier[0, 14] += 1.0
    assert not torch.allclose(run(earlier)[0, a], base[0, a])


def test_training_learns_and_saves_zlab_format(target_dir: Path, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data.jsonl", _cycles(48))
    cfg = DraftTrainConfig(block_size=8, num_layers=1, intermediate_size=96, layer_ids=[0, 1], batch_size=8,
                           max_anchors=16, max_len=128,
                           loop=LoopConfig(steps=40, lr=1e-2, warmup=4, log_every=1, checkpoint_every=20))
    summary = train_draft(str(target_dir), str(tmp_path / "data.jsonl"), tmp_path / "draft", cfg, CPU,
                          eval_path=str(tmp_path / "data.jsonl"))
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-5:]) / 5 < 0.3 * sum(losses[:5]) / 5
    assert summary["chain_acceptance"]["overall"] > 2.0

    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]
    assert config["dflash_config"]["mask_token_id"] == 9  # the tokenizer's <|MASK|>
    assert config["num_target_layers"] == 2 and config["hidden_size"] == 64
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (64, 128) and f.get_tensor("fc.weight").dtype == torch.bfloat16
    layer = {f"layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {f"layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    layer |= {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}
    assert keys == layer | {"fc.weight", "hidden_norm.weight", "norm.weight"}

    # --init continues from the saved draft: its shape wins over the (different) shape flags, and
    # the first loss is the trained draft's, not a fresh initialisation's.
    more = DraftTrainConfig(block_size=16, num_layers=2, intermediate_size=32, batch_size=8, max_anchors=16,
                            max_len=128, init_dir=str(tmp_path / "draft"),
                            loop=LoopConfig(steps=3, lr=1e-3, warmup=1, log_every=1))
    cont = train_draft(str(target_dir), str(tmp_path / "data.jsonl"), tmp_path / "draft2", more, CPU)
    assert cont["history"][0]["loss"] < 0.5 * losses[0]
    assert json.loads((tmp_path / "draft2" / "config.json").read_text()) == config
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    (wrong / "model.safetensors").write_bytes((tmp_path / "draft" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="hidden_size=128"):
        train_draft(str(target_dir), str(tmp_path / "data.jsonl"), tmp_path / "draft3",
                    DraftTrainConfig(init_dir=str(wrong), loop=LoopConfig(steps=1)), CPU)



def test_offline_chain_acceptance_matches_the_engine(target_dir: Path, target: FrozenTarget, tmp_path: Path) -> None:
    """On the target's own greedy outputs, the trainer's chain AL is the engine's chain AL."""
    from flashtree import Engine, SamplingParams

    ar = Engine.from_pretrained(str(target_dir), None, mode="ar", max_ctx=256, device="cpu", dtype="float32")
    rng = random.Random(5)
    prompts = [[rng.randint(10, 250) for _ in range(rng.randint(4, 16))] for _ in range(6)]
    records = [{"prompt_ids": p, "completion_ids": ar.generate(p, SamplingParams(temperature=0.0), max_tokens=40,
                                                               stop_token_ids=[]).token_ids} for p in prompts]
    write_jsonl(tmp_path / "greedy.jsonl", records)
    cfg = DraftTrainConfig(block_size=8, num_layers=1, layer_ids=[0, 1], batch_size=6, max_anchors=64, max_len=128,
                           loop=LoopConfig(steps=30, lr=1e-2, warmup=3))
    train_draft(str(target_dir), str(tmp_path / "greedy.jsonl"), tmp_path / "draft", cfg, CPU)
    trainer = DraftTrainer(target, [], cfg, CPU)
    saved = load_file(str(tmp_path / "draft" / "model.safetensors"))  # the bf16 weights the engine reads
    trainer.draft.load_state_dict({k: v.float() for k, v in saved.items()})
    offline = trainer.chain_acceptance(load_draft_examples(tmp_path / "greedy.jsonl", target.tokenizer, 128))

    chain = Engine.from_pretrained(str(target_dir), str(tmp_path / "draft"), mode="chain", max_ctx=256,
                                   device="cpu", dtype="float32")
    lengths = []
    for rec in records:
        res = chain.generate(rec["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=40, stop_token_ids=[])
        assert res.token_ids == rec["completion_ids"]
        lengths += res.stats.accept_lengths[:-1]  # the last step may run past max_tokens
    assert offline > 1.5
    assert abs(offline - sum(lengths) / len(lengths)) < 0.1 * offline


def test_eval_acceptance_reports_al_equality_with_ar_and_ended_answers(tiny_pair, tmp_path: Path) -> None:
    from flashtree.train.eval_acceptance import evaluate

    target, draft = tiny_pair
    write_jsonl(tmp_path / "prompts.jsonl", [
        {"kind": "code", "text": "def add(a, b):\n    return a + b\n"},
        {"kind": "chat", "messages": [{"role": "user", "content": "Hi!"}], "tools": []},
        {"kind": "chat", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "tools": []}])
    report = evaluate(str(target), str(draft), str(tmp_path / "prompts.jsonl"), [("chain", 0), ("ddtree", 4)],
                      max_tokens=10, max_ctx=256, device="cpu")
    assert report["prompts"] == 3 and set(report["ended_by_kind"]) == {"chat", "code"}
    assert all(0.0 <= v <= 1.0 for v in report["ended_by_kind"].values())
    for mode in ("chain", "ddtree:4"):
        got = report["modes"][mode]
        assert got["mismatches_vs_ar"] == 0  # greedy speculative decoding is lossless
        assert 1.0 <= got["al"] <= 16 and set(got["al_by_kind"]) == {"chat", "code"}


def test_eval_acceptance_refuses_a_target_without_its_draft(tiny_pair, tmp_path: Path) -> None:
    """A target given alone decodes AR in every mode: an AL of 1.0 that would read as a measurement."""
    from flashtree.train.eval_acceptance import evaluate

    target, _ = tiny_pair
    write_jsonl(tmp_path / "prompts.jsonl", [{"kind": "code", "text": "def add(a, b):\n"}])
    with pytest.raises(ValueError, match="needs a draft"):
        evaluate(str(target), None, str(tmp_path / "prompts.jsonl"), [("chain", 0)], max_tokens=4, max_ctx=256,
                 device="cpu")
