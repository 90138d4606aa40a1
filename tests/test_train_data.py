"""Corpus builder, tokenizer and chat template of the training recipe (CPU, seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flashtree.train.corpus import (build_corpus, cut_prompt, dialogue, is_heldout_path, prompt_text,
                                    read_jsonl, stdlib_files, training_text)
from flashtree.train.regen import sample_prompts
from flashtree.train.synth_agent import docstring_paragraphs
from flashtree.train.synth_tools import TOOLS
from flashtree.train.tokenizer_train import (CONTROL_TOKENS, MARKUP_TOKENS, SPECIAL_TOKENS, save_tokenizer,
                                             train_tokenizer)


def _fake_stdlib(root: Path, n: int = 40) -> Path:
    for i in range(n):
        pkg = root / ("test" if i % 10 == 0 else "pkg")  # test dirs must be skipped
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / f"mod{i:02d}.py").write_text(
            f'"""Module {i}."""\n\n\ndef f{i}(x):\n    """Scale the value by {i} and shift it by the remainder '
            f'of {i} divided by seven."""\n    return x * {i} + {i % 7}\n' * 3)
    return root


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    root = _fake_stdlib(tmp_path_factory.mktemp("stdlib"))
    build_corpus(out, seed=3, n_chat=300, n_tool=300, n_heldout=50, stdlib_root=str(root))
    return out


@pytest.fixture(scope="module")
def tok_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer((training_text(r) for r in read_jsonl(corpus_dir / "train.jsonl.gz")), 600), out)
    return out


def test_corpus_is_deterministic_and_split(corpus_dir: Path, tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "stdlib")
    build_corpus(tmp_path / "again", seed=3, n_chat=300, n_tool=300, n_heldout=50, stdlib_root=str(root))
    for name in ("train.jsonl.gz", "heldout.jsonl"):
        assert list(read_jsonl(corpus_dir / name)) == list(read_jsonl(tmp_path / "again" / name))
    train = list(read_jsonl(corpus_dir / "train.jsonl.gz"))
    kinds = [r["kind"] for r in train]
    assert kinds.count("chat") == 300 and kinds.count("tool") == 300
    files = stdlib_files(str(root))
    assert files and not any(p.startswith("test/") for p, _ in files)
    held_texts = {t for p, t in files if is_heldout_path(p)}
    assert not held_texts & {r["text"] for r in train if r["kind"] == "code"}


def test_regen_code_prompts_come_from_code_the_target_never_saw(corpus_dir: Path) -> None:
    train_code = {r["text"] for r in read_jsonl(corpus_dir / "train.jsonl.gz") if r["kind"] == "code"}
    unseen = [r["text"] for r in read_jsonl(corpus_dir / "unseen_code.jsonl.gz")]
    assert len(unseen) == 4 and not set(unseen) & train_code  # the fake stdlib's test/ files
    prompts = sample_prompts(corpus_dir / "train.jsonl.gz", 30, seed=1,
                             code_corpus=corpus_dir / "unseen_code.jsonl.gz")
    code = [p["text"] for p in prompts if p["kind"] == "code"]
    assert len(code) == 30 and all(any(c in u for u in unseen) for c in code)
    assert not any(any(c in t for t in train_code) for c in code)
    mixed = sample_prompts(corpus_dir / "train.jsonl.gz", 30, seed=1)
    assert all(any(p["text"] in t for t in train_code) for p in mixed if p["kind"] == "code")


def test_agent_records_frame_the_tasks_and_leave_the_rest_of_the_corpus_alone(tmp_path: Path,
                                                                               corpus_dir: Path) -> None:
    root = _fake_stdlib(tmp_path / "stdlib")
    counts = build_corpus(tmp_path / "with_agent", seed=3, n_chat=300, n_tool=300, n_heldout=50,
                          stdlib_root=str(root), n_agent=20)
    assert counts["train_agent"] == 20 and counts["heldout_agent"] == 50
    for name in ("train.jsonl.gz", "heldout.jsonl"):  # the agent records draw on their own stream
        assert list(read_jsonl(corpus_dir / name)) == list(read_jsonl(tmp_path / "with_agent" / name))
    for rec in read_jsonl(tmp_path / "with_agent" / "agent.jsonl.gz"):
        system = rec["messages"][0]
        assert rec["kind"] == "agent" and system["role"] == "system" and "Scale the value by" in system["content"]
        assert rec["messages"][-1]["role"] == "assistant"
        called = {c["function"]["name"] for m in rec["messages"] for c in m.get("tool_calls", [])}
        assert called <= {t["function"]["name"] for t in rec["tools"]}
        assert training_text(rec).endswith("<|im_end|>\n<|endoftext|>")
    held = list(read_jsonl(tmp_path / "with_agent" / "agent_heldout.jsonl"))
    assert all(prompt_text(r).endswith("<|im_start|>assistant\n") for r in held)
    reminders = [m for r in held for m in r["messages"] if m["content"].startswith("<system-reminder>")]
    assert reminders  # some requests come with the reminders agents add


def test_docstring_paragraphs_keep_prose_and_drop_code() -> None:
    source = ('''def f():\n    """Return the answer to the question that the caller asked for.\n\n'''
              '''    >>> f() and other doctest lines are code\n\n    Too short.\n    """\n''')
    assert docstring_paragraphs([("m.py", source), ("bad.py", "def (")]) == [
        "Return the answer to the question that the caller asked for."]


def test_heldout_prompts_stop_before_an_assistant_turn(corpus_dir: Path) -> None:
    held = list(read_jsonl(corpus_dir / "heldout.jsonl"))
    assert [r["kind"] for r in held].count("code") == 50
    for kind in ("chat", "tool"):
        prompts = [r for r in held if r["kind"] == kind]
        assert len(prompts) == 50
        for r in prompts:
            assert r["messages"][-1]["role"] in ("user", "tool")
            assert prompt_text(r).endswith("<|im_start|>assistant\n")


def test_tool_dialogues_call_offered_tools_with_valid_json() -> None:
    rng = random.Random(0)
    names = {t["function"]["name"] for t in TOOLS}
    for _ in range(200):
        rec = dialogue("tool", rng)
        offered = {t["function"]["name"] for t in rec["tools"]}
        assert offered <= names
        for i, m in enumerate(rec["messages"]):
            for call in m.get("tool_calls", []):
                fn = call["function"]
                assert fn["name"] in offered
                schema = next(t for t in TOOLS if t["function"]["name"] == fn["name"])["function"]["parameters"]
                assert set(schema["required"]) <= set(fn["arguments"]) <= set(schema["properties"])
            if m["role"] == "tool":
                json.loads(m["content"])
        text = training_text(rec)
        assert text.count("<tool_call>") == text.count("</tool_call>") >= 2  # schema example + a call


def test_cut_prompt_code_is_a_slice_of_lines() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    cut = cut_prompt({"kind": "code", "text": text}, random.Random(1))["text"]
    assert cut and cut in text and cut.endswith("\n")


def test_tokenizer_ids_and_roundtrip(tok_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    code = "def f(x):\n    return x * 12345  # ok\n\n\tpass\n"
    assert tok.decode(tok.encode(code).ids) == code
    digits = tok.encode("x = 12345").tokens
    assert all(len(t) == 1 for t in digits if t.strip("Ġ").isdigit()) and "5" in digits
    text = "<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tok.encode(text).ids
    assert ids.count(tok.token_to_id("<think>")) == 1 and ids[-1] == tok.token_to_id("<|im_end|>")
    kept = tok.decode(ids, skip_special_tokens=True)
    assert all(m in kept for m in MARKUP_TOKENS[:4]) and not any(c in kept for c in CONTROL_TOKENS)
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]


def test_template_matches_transformers(tok_dir: Path, corpus_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    records = list(read_jsonl(corpus_dir / "train.jsonl.gz"))
    dialogues = [r for r in records if r["kind"] != "code"][:80]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "x?"}]
    dialogues.append({"kind": "chat", "messages": messages, "tools": []})
    for rec in dialogues:
        tools = rec["tools"] or None
        ours = training_text(rec, eos="")
        assert ours == hf.apply_chat_template(rec["messages"], tools=tools, tokenize=False)
        cut = cut_prompt(rec, random.Random(0))
        assert prompt_text(cut) == hf.apply_chat_template(cut["messages"], tools=tools, tokenize=False,
                                                          add_generation_prompt=True)
    no_think = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # reasoning of turns before the last user query is dropped, like Qwen3
    assert "add" not in no_think and "<|im_start|>assistant\n4<|im_end|>" in no_think


def test_tool_results_render_inside_one_user_turn() -> None:
    rec = {"kind": "tool", "tools": TOOLS[:1], "messages": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": '{"t": 1}'}, {"role": "tool", "content": '{"t": 2}'}]}
    text = prompt_text(rec)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n{\"t\": 1}\n</tool_response>\n<tool_response>\n{\"t\": 2}\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]


@pytest.mark.slow  # 7 s: the training recipe's corpus step
def test_cli_builds_corpus_and_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    from flashtree.train.cli import add_train_parsers

    parser = argparse.ArgumentParser()
    add_train_parsers(parser.add_subparsers(dest="command", required=True))
    run = lambda *argv: (lambda a: a.func(a))(parser.parse_args(list(argv)))  # noqa: E731
    assert run("train", "corpus", "--out", str(tmp_path / "c"), "--n-chat", "40", "--n-tool", "40",
               "--n-heldout", "50") == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["train_chat"] == 40 and counts["heldout"] == 150 and counts["train_code"] > 50
    assert run("train", "tokenizer", "--corpus", str(tmp_path / "c" / "train.jsonl.gz"), "--out", str(tmp_path / "t"),
               "--vocab-size", "700") == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 700
    args = parser.parse_args(["eval-acceptance", "--prompts", "p.jsonl", "--modes", "chain,ddtree:8"])
    from flashtree.train.eval_acceptance import parse_modes
    assert parse_modes(args.modes) == [("chain", 0), ("ddtree", 8)]


def test_the_recipe_takes_its_code_corpus_from_code_corpus_from(tmp_path):
    """recipe.sh with CODE_CORPUS_FROM replaces the corpus's train, held-out and unseen-code files
    with that folder's (the GPU image's Python has another standard library than the one the
    committed pair's corpus came from); every finished stage is skipped, so no flashtree command
    runs (FLASHTREE=false would fail the run)."""
    import os
    import subprocess
    from pathlib import Path

    work, source = tmp_path / "work", tmp_path / "corpus311"
    for folder in (work / "corpus", work / "tokenizer", work / "target", source):
        folder.mkdir(parents=True)
    names = ("train.jsonl.gz", "unseen_code.jsonl.gz", "heldout.jsonl")
    for name in names:
        (work / "corpus" / name).write_text("built here\n")
        (source / name).write_text(f"built on 3.11.7: {name}\n")
    (work / "tokenizer" / "tokenizer.json").write_text("{}")
    (work / "target" / "config.json").write_text("{}")
    recipe = Path(__file__).resolve().parents[1] / "flashtree" / "train" / "recipe.sh"
    env = {**os.environ, "FLASHTREE": "false", "STOP_AFTER": "client", "CODE_CORPUS_FROM": str(source)}
    proc = subprocess.run(["bash", str(recipe), str(work)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name in names:
        assert (work / "corpus" / name).read_text() == f"built on 3.11.7: {name}\n"
    env.pop("CODE_CORPUS_FROM")
    (work / "corpus" / "heldout.jsonl").write_text("built here\n")
    assert subprocess.run(["bash", str(recipe), str(work)], env=env, capture_output=True, timeout=60).returncode == 0
    assert (work / "corpus" / "heldout.jsonl").read_text() == "built here\n"  # no folder, no copy


def test_the_recipe_anchors_the_agent_stage_on_its_starting_targets_answers(tmp_path):
    """recipe.sh with ANCHOR_PER_KIND: before the agent stage, the starting target answers that
    many prompts of each kind (unseen code for code, seed 1), and the stage gets those records
    with the loss on their answers; without it, no regen runs before the stage. The flashtree
    commands are stood in for by a script that logs its arguments and writes the --out path."""
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "ft.sh"
    fake.write_text('echo "$*" >> "$FT_LOG"\nprev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done\n'
                    'case "$2" in regen) touch "$out";; target) mkdir -p "$out" && echo {} > "$out/config.json";; esac\n')
    recipe = Path(__file__).resolve().parents[1] / "flashtree" / "train" / "recipe.sh"
    for anchor in ("0", "5"):
        work = tmp_path / f"work{anchor}"
        for folder in (work / "corpus", work / "tokenizer", work / "target"):
            folder.mkdir(parents=True)
        for name in ("train.jsonl.gz", "unseen_code.jsonl.gz", "client_agent.jsonl.gz"):
            (work / "corpus" / name).write_text("")
        (work / "tokenizer" / "tokenizer.json").write_text("{}")
        (work / "target" / "config.json").write_text("{}")
        log = tmp_path / f"log{anchor}"
        env = {**os.environ, "FLASHTREE": f"bash {fake}", "FT_LOG": str(log), "STOP_AFTER": "client",
               "ANCHOR_PER_KIND": anchor}
        proc = subprocess.run(["bash", str(recipe), str(work)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        calls = log.read_text().splitlines()
        stage = next(c for c in calls if c.startswith("train target"))
        if anchor == "0":
            assert len(calls) == 1 and str(work / "anchor") not in stage
            continue
        regen = calls[0].split()
        assert regen[:2] == ["train", "regen"] and len(calls) == 2
        assert regen[regen.index("--target") + 1] == str(work / "target")
        assert regen[regen.index("--per-kind") + 1] == "5" and regen[regen.index("--seed") + 1] == "1"
        assert regen[regen.index("--code-corpus") + 1] == str(work / "corpus" / "unseen_code.jsonl.gz")
        answers = stage.split("--answers-only")[1].split("--out")[0].split()
        assert answers == [str(work / "corpus" / "client_agent.jsonl.gz"), str(work / "anchor" / "regen.jsonl")]
