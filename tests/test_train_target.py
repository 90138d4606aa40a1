"""Optimisation loop, target training and regeneration on CPU (tiny model, seconds)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from flashtree.train.corpus import dialogue, read_jsonl, write_jsonl
from flashtree.train.loop import LoopConfig, lr_at, train_loop
from flashtree.train.regen import regenerate
from flashtree.train.target_train import TargetTrainConfig, save_target, train_target
from flashtree.train.tokenizer_train import save_tokenizer, train_tokenizer

CPU = torch.device("cpu")


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = LoopConfig(lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1) and lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55)
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    values = [lr_at(s, 100, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


class _Crash(Exception):
    pass


def _toy_run(ckpt: Path, steps: int, crash_at: int | None = None, budget: float | None = None) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.randn(64, 4)
    target = data @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    def loss_at(step: int):
        if step == crash_at:
            raise _Crash
        idx = torch.arange(8) + (step * 8) % 64
        return ((model(data[idx]).squeeze(-1) - target[idx]) ** 2).mean(), {"step_seen": float(step)}

    cfg = LoopConfig(steps=steps, lr=0.3, warmup=2, checkpoint_every=5, log_every=1, time_budget=budget)
    summary = train_loop(list(model.parameters()), loss_at, cfg, ckpt, {"m": model}, CPU)
    return summary, model.weight.detach().clone()


def test_interrupted_run_resumes_to_the_same_result(tmp_path: Path) -> None:
    full, w_full = _toy_run(tmp_path / "a.pt", 30)
    with pytest.raises(_Crash):
        _toy_run(tmp_path / "b.pt", 30, crash_at=17)
    resumed, w_resumed = _toy_run(tmp_path / "b.pt", 30)  # picks up at step 15, the last checkpoint
    assert resumed["steps"] == 30 and resumed["history"] == full["history"]
    assert torch.equal(w_full, w_resumed)
    assert full["history"][-1]["loss"] < 0.1 * full["history"][0]["loss"]


def test_time_budget_fixes_the_step_count(tmp_path: Path) -> None:
    tight, _ = _toy_run(tmp_path / "t.pt", 1000, budget=1e-9)
    assert tight["steps"] == 10  # stops as soon as the timed steps are done
    loose, _ = _toy_run(tmp_path / "l.pt", 25, budget=1e9)
    assert loose["steps"] == 25
    state = torch.load(tmp_path / "t.pt", weights_only=False)
    assert state["total"] == 10 and state["step"] == 10


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("target")
    rng = random.Random(0)
    records = [dialogue("chat" if i % 2 else "tool", rng) for i in range(120)]
    records.append({"kind": "code", "text": "def add(a, b):\n    return a + b\n" * 20})
    write_jsonl(root / "corpus.jsonl.gz", records)
    from flashtree.train.corpus import training_text
    save_tokenizer(train_tokenizer((training_text(r) for r in records), vocab_size=400), root / "tok")
    cfg = TargetTrainConfig(size="test", seq_len=64, batch_size=8,
                            loop=LoopConfig(steps=40, lr=1e-2, warmup=4, log_every=1))
    summary = train_target(root / "corpus.jsonl.gz", root / "tok", root / "out", cfg, CPU)
    return root, summary


def test_target_learns_and_saves_a_transformers_checkpoint(trained: tuple[Path, dict]) -> None:
    from transformers import AutoModelForCausalLM

    root, summary = trained
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert math.log(400) - 0.5 < losses[0] < math.log(400) + 1.5  # starts near uniform over the vocab
    out = root / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["max_position_embeddings"] == 65536
    assert config["tie_word_embeddings"] and config["eos_token_id"] == 2
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (out / name).is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.rope_parameters["rope_theta"] == 1e6
    ids = torch.tensor([[1, 50, 60, 70, 2]])
    sharded = root / "sharded"
    save_target(model, config, root / "tok", sharded, shard="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_fine_tune_starts_from_the_checkpoint_and_mixes_the_corpora(trained: tuple[Path, dict],
                                                                      tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from flashtree.train.synth_agent import agent_dialogue

    root, _ = trained
    paragraphs = [f"The {w} function returns the {w} of its argument and raises an error otherwise."
                  for w in ("length", "value", "name", "size", "type")]
    rng = random.Random(1)
    write_jsonl(tmp_path / "agent.jsonl.gz", [agent_dialogue(rng, paragraphs, max_tokens=300) for _ in range(6)])
    cfg = TargetTrainConfig(seq_len=256, batch_size=2, loop=LoopConfig(steps=6, lr=1e-3, warmup=1, log_every=1))
    summary = train_target([root / "corpus.jsonl.gz", tmp_path / "agent.jsonl.gz"], root / "out",
                           tmp_path / "long", cfg, CPU, init_dir=root / "out")
    assert summary["history"][0]["loss"] < math.log(400) - 1.0  # trained weights, not a fresh init
    assert json.loads((tmp_path / "long" / "config.json").read_text()) == \
        json.loads((root / "out" / "config.json").read_text())
    before, after = load_file(root / "out" / "model.safetensors"), load_file(tmp_path / "long" / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


def test_flashtree_engine_runs_the_trained_target(trained: tuple[Path, dict]) -> None:
    from flashtree import Engine, SamplingParams

    engine = Engine.from_pretrained(str(trained[0] / "out"), None, mode="ar", max_ctx=256, device="cpu")
    result = engine.generate(engine.tokenizer.encode("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"),
                             SamplingParams(temperature=0.0), max_tokens=8)
    assert 1 <= len(result.token_ids) <= 8


def test_regen_batches_match_one_by_one_greedy(trained: tuple[Path, dict], tmp_path: Path) -> None:
    from flashtree import Engine, SamplingParams

    root = trained[0]
    rng = random.Random(1)
    prompts = [dialogue("chat", rng) for _ in range(3)] + [{"kind": "code", "text": "def add(a, b):\n"}]
    prompts = [{**p, "messages": p["messages"][:-1]} if p["kind"] != "code" else p for p in prompts]
    stats = regenerate(str(root / "out"), prompts, tmp_path / "regen.jsonl", CPU, max_new_tokens=12, batch_size=4)
    records = list(read_jsonl(tmp_path / "regen.jsonl"))
    assert stats["records"] == len(records) == 4
    engine = Engine.from_pretrained(str(root / "out"), None, mode="ar", max_ctx=512, device="cpu", dtype="float32")
    stops = {0, 2}
    for rec in records:
        assert 1 <= len(rec["completion_ids"]) <= 12
        assert not stops & set(rec["completion_ids"][:-1])  # a stop token can only end a completion
        alone = engine.generate(rec["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=12)
        assert [t for t in rec["completion_ids"] if t not in stops] == alone.token_ids


def test_regen_records_anchor_a_fine_tune_on_the_targets_own_completions(trained: tuple[Path, dict],
                                                                         tmp_path: Path) -> None:
    """The agent stage's anchor: a regen record is a document of the target's own tokens whose
    prompt is context and whose completion (its greedy answer) is predicted; read from a corpus
    file like any other record, and packed beside text documents."""
    from tokenizers import Tokenizer

    from flashtree.train.datasets import pack_documents
    from flashtree.train.target_train import _documents, anchor_document

    root = trained[0]
    tok = Tokenizer.from_file(str(root / "out" / "tokenizer.json"))
    prompts = [{"kind": "code", "text": "def add(a, b):\n"}, {**dialogue("chat", random.Random(2))}]
    prompts[1]["messages"] = prompts[1]["messages"][:-1]
    regenerate(str(root / "out"), prompts, tmp_path / "regen.jsonl", CPU, max_new_tokens=8, batch_size=2)
    records = list(read_jsonl(tmp_path / "regen.jsonl"))
    assert len(records) == 2
    eot = tok.token_to_id("<|endoftext|>")
    for rec in records:
        doc = anchor_document(rec, tok)
        assert doc == (rec["prompt_ids"] + rec["completion_ids"] + [eot], len(rec["prompt_ids"]))
        ids, mask = pack_documents([doc, ("<|im_start|>user\nHi<|im_end|>\n<|endoftext|>", 0)], tok,
                                   seq_len=len(doc[0]))
        n = len(rec["prompt_ids"])
        assert ids[0].tolist() == doc[0]  # the tokens the target chose, not tokenized again
        assert not mask[0, :n].any() and mask[0, n:].all()
    docs = _documents([root / "corpus.jsonl.gz", tmp_path / "regen.jsonl"], 0, tok, (tmp_path / "regen.jsonl",))
    corpus_records = sum(1 for _ in read_jsonl(root / "corpus.jsonl.gz"))
    assert len(docs) == corpus_records + 2 and all(anchor_document(r, tok) in docs for r in records)


def test_regen_batches_take_the_kinds_in_turn() -> None:
    from flashtree.train.regen import _batches

    items = [(kind, [0] * n) for kind in ("code", "chat", "tool") for n in range(1, 9)]
    batches = list(_batches(items, batch_size=3, seed=0))
    assert all(len({k for k, _ in b}) == 1 for b in batches)
    assert [b[0][0] for b in batches[:3]] == ["chat", "code", "tool"]
    assert sorted(len(ids) for b in batches for _, ids in b) == sorted(len(ids) for _, ids in items)


def test_a_hybrid_target_trains_and_flashtree_decodes_it_like_transformers(trained: tuple[Path, dict],
                                                                          tmp_path: Path) -> None:
    """`--size test-hybrid`: a Qwen3.5-style Gated DeltaNet target, trained from scratch and saved
    as a transformers checkpoint, that flashtree's engine decodes greedily as transformers does."""
    from transformers import AutoModelForCausalLM

    from flashtree import Engine, SamplingParams

    root = trained[0]
    cfg = TargetTrainConfig(size="test-hybrid", seq_len=64, batch_size=8,
                            loop=LoopConfig(steps=30, lr=1e-2, warmup=4, log_every=1))
    summary = train_target(root / "corpus.jsonl.gz", root / "tok", tmp_path / "hybrid", cfg, CPU)
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    config = json.loads((tmp_path / "hybrid" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "linear_attention" in config["layer_types"]
    prompt = [5, 9, 40, 41, 12, 7, 100, 3]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid", dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    engine = Engine.from_pretrained(str(tmp_path / "hybrid"), None, mode="ar", max_ctx=256, device="cpu")
    got = engine.generate(prompt, SamplingParams(temperature=0.0), max_tokens=10, stop_token_ids=[])
    assert got.token_ids == want


def test_answers_only_records_are_predicted_from_their_first_assistant_turn(trained: tuple[Path, dict]) -> None:
    """The agent stage's loss mask: a client frame is context, the tool call and what follows it
    are predicted; ordinary documents are predicted everywhere."""
    from tokenizers import Tokenizer

    from flashtree.train.corpus import training_document, training_text
    from flashtree.train.datasets import pack_documents
    from flashtree.train.synth_client_agent import client_agent_record, load_frames
    from flashtree.train.synth_tasks import Pools

    root, _ = trained
    tok = Tokenizer.from_file(str(root / "out" / "tokenizer.json"))
    rec = client_agent_record(random.Random(3), load_frames(("hermes",)), Pools.split(heldout=False))
    text, start = training_document(rec, answers_only=True)
    assert text == training_text(rec) and training_document(rec) == (text, 0)
    assert text[start:].lstrip().startswith(("<think>", "<tool_call>"))  # right after the generation prompt
    assert "<|im_start|>assistant\n" in text[start - 30:start]
    plain = "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"
    n_rec, n_plain = (len(tok.encode(t, add_special_tokens=False).ids) for t in (text, plain))
    ids, mask = pack_documents([(text, start), (plain, 0)], tok, seq_len=n_rec + n_plain)
    expected = tok.encode(text[:start], add_special_tokens=False).ids
    assert ids[0, :len(expected)].tolist() == expected
    assert not mask[0, :len(expected)].any() and mask[0, len(expected):].all()
    assert training_document({"kind": "chat", "messages": [{"role": "user", "content": "Hi"}]}, True)[1] == 0


def test_an_answers_only_corpus_trains_on_fewer_tokens(trained: tuple[Path, dict], tmp_path: Path) -> None:
    from flashtree.train.synth_client_agent import client_agent_record, load_frames
    from flashtree.train.synth_tasks import Pools

    root, _ = trained
    rng, frames, pools = random.Random(4), load_frames(("claude",)), Pools.split(heldout=False)
    write_jsonl(tmp_path / "client.jsonl.gz", [client_agent_record(rng, frames, pools) for _ in range(3)])
    cfg = TargetTrainConfig(seq_len=1024, batch_size=2, loop=LoopConfig(steps=2, lr=1e-4, warmup=1, log_every=1))
    masked = train_target(root / "corpus.jsonl.gz", root / "out", tmp_path / "m", cfg, CPU, init_dir=root / "out",
                          answers_only=[tmp_path / "client.jsonl.gz"])
    full = train_target([root / "corpus.jsonl.gz", tmp_path / "client.jsonl.gz"], root / "out", tmp_path / "f",
                        cfg, CPU, init_dir=root / "out")
    assert masked["rows"] == full["rows"] and masked["predicted_share"] < 0.8 * full["predicted_share"]
    assert full["predicted_share"] == 1.0 and masked["answers_only"] == [str(tmp_path / "client.jsonl.gz")]
