"""The repair stage's data and rows, and the held-out scorer that judges every stage (CPU, seconds).

The scorer's checks are plain functions of (reference, generated text): each is held here to what
it must accept and what it must refuse, with outputs the embedded targets really gave."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import torch

from flashtree.train.corpus import build_corpus, code_openings, read_jsonl, training_text, write_jsonl
from flashtree.train.datasets import pack_row_starts
from flashtree.train.heldout_score import (answered_from_result, degenerate, final_line, heldout_chat,
                                           heldout_client_rounds, heldout_tool_rounds, round_words, same_call,
                                           sensible_code, text_result_rounds)
from flashtree.train.synth_tools import as_text_result, tool_text_dialogue

RECIPE = Path(__file__).resolve().parents[1] / "flashtree" / "train" / "recipe.sh"


def _calc_round(expr: str, value: int) -> dict:
    return {"kind": "tool", "tools": [], "messages": [
        {"role": "user", "content": f"What is {expr}?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}]},
        {"role": "tool", "content": json.dumps({"result": value})}]}


def test_a_tool_answer_must_hold_the_results_values_not_near_misses() -> None:
    prompt = _calc_round("12 * 7", 84)
    assert round_words(prompt, "12 * 7 = 84.") == {"12", "7", "84"}
    assert answered_from_result(prompt, "12 * 7 = 84.", "12 * 7 = 84.<|im_end|>", True)
    assert not answered_from_result(prompt, "12 * 7 = 84.", "12 * 7 = 844.<|im_end|>", True)
    assert not answered_from_result(prompt, "12 * 7 = 84.", "12 * 7 = 84.", False)  # never ended
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7 = 84"}}\n</tool_call>'
    assert not answered_from_result(prompt, "12 * 7 = 84.", call, True)
    weather = {"kind": "tool", "tools": [], "messages": [
        {"role": "user", "content": "Weather in Lisbon?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}}]},
        {"role": "tool", "content": json.dumps({"city": "Lisbon", "temperature": -3, "unit": "celsius",
                                                "condition": "sunny", "humidity": 55})}]}
    ref = "It is -3°C and sunny in Lisbon, with 55% humidity."
    assert round_words(weather, ref) == {"-3", "sunny", "Lisbon", "55"}
    assert answered_from_result(weather, ref, "In Lisbon it is currently -3°C and sunny. Humidity is 55%.", True)
    assert not answered_from_result(weather, ref, "The text in Lisbon.", True)
    assert not answered_from_result(weather, ref, "In Lisbon it is currently 3°C and sunny. Humidity is 55%.", True)


def test_a_clients_fixed_result_text_is_not_a_value_the_answer_must_repeat() -> None:
    prompt = {"kind": "client_agent", "tools": [], "messages": [
        {"role": "user", "content": "append a line"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "Bash", "arguments": {"command": "echo 'kettle harbor 91' >> castle.md",
                                          "description": "Append a line to castle.md"}}}]},
        {"role": "tool", "content": "(Bash completed with no output)"}]}
    ref = 'Done: castle.md now ends with the line "kettle harbor 91".'
    assert round_words(prompt, ref) == {"castle.md", "kettle", "harbor", "91"}  # not "with", "line"
    assert answered_from_result(prompt, ref, 'Appended "kettle harbor 91" to castle.md.', True)


def test_a_call_turn_counts_when_name_and_arguments_match_the_reference() -> None:
    ref = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "Write", "arguments": {"file_path": "a.csv", "content": "evening apple"}}}]}
    good = '<think>\n\n</think>\n\n<tool_call>\n{"name": "Write", "arguments": {"file_path": "a.csv", ' \
           '"content": "evening apple"}}\n</tool_call>'
    assert same_call(ref, good)
    assert not same_call(ref, good.replace('"a.csv"', '" a.csv"'))
    assert not same_call(ref, "Created a.csv.")


def test_degenerate_and_sensible_code_refuse_what_the_targets_wrote() -> None:
    fib = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    assert degenerate("    return _ yield _ yield _ yield _ yield _ yield")
    assert sensible_code(fib, "    return _ yield _ yield _ yield _ yield _ yield _ yield", False)
    looped = "    return a.lower() == 'Car\n\ndef fib(n):\n" * 3
    assert degenerate(looped) and sensible_code("def fib(n):\n", looped, False)
    assert sensible_code("def fib(n):\n", "    return sum(x for x in n)\n```\n\nFor example\n", True)  # chat text
    good = "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef main("
    assert degenerate(good) is None and sensible_code(fib, good, False) is None
    assert sensible_code(fib, "    if n < 2:\n", False) is None  # a block the cut left open
    assert sensible_code(fib, "    return n\n", True) is None
    assert sensible_code(fib, "    return fib", False) == "no full line"


def test_final_line_is_the_worked_answers_last_sentence() -> None:
    assert final_line("Add 1 and 2:\n- ones: 1 + 2 = 3\n\nAnswer: 1 + 2 = 3.") == "1 + 2 = 3."
    assert final_line("1 + 2 = 3.") == "1 + 2 = 3."


def test_the_held_out_conversations_are_the_corpus_held_out_streams(tmp_path: Path) -> None:
    rounds = heldout_tool_rounds(30, seed=3, n_heldout=50)
    assert len(rounds) == 30
    for prompt, ref in rounds:
        assert prompt["messages"][-1]["role"] == "tool" and ref["role"] == "assistant" and ref["content"]
    for (prompt, ref), (text, same) in zip(rounds, text_result_rounds(rounds)):
        before = [m for m in prompt["messages"] if m["role"] != "tool"]
        assert same is ref and [m for m in text["messages"] if m["role"] != "tool"] == before
        assert text["messages"][-1]["content"] == as_text_result(prompt["messages"][-1]["content"])
    root = tmp_path / "stdlib" / "pkg"
    root.mkdir(parents=True)
    (root / "m.py").write_text("def f(x):\n    return x\n")
    counts = build_corpus(tmp_path / "c", seed=3, n_chat=5, n_tool=5, n_heldout=60, stdlib_root=str(root.parent),
                          n_client_agent=1)
    assert counts["heldout_client_agent"] == 60
    held = list(read_jsonl(tmp_path / "c" / "heldout.jsonl"))
    chats = [r for r in held if r["kind"] == "chat"]
    for (prompt, ref), cut in zip(heldout_chat(seed=3), chats):  # the same dialogues, cut elsewhere
        n = min(len(prompt["messages"]), len(cut["messages"]))
        assert prompt["messages"][:n] == cut["messages"][:n] and ref["role"] == "assistant"
    clients = [p for p, _ in heldout_client_rounds(seed=3)]
    assert clients == list(read_jsonl(tmp_path / "c" / "client_agent_heldout.jsonl"))
    more = [p for p, _ in heldout_client_rounds(seed=3, n_heldout=90)]  # a larger sample goes on past the corpus's
    assert more[:60] == clients and all(p not in clients for p in more[60:])


def test_text_results_carry_the_values_without_json() -> None:
    assert as_text_result('{"result": 84}') == "84"
    assert as_text_result('{"matches": []}') == "(none)"
    assert as_text_result('{"city": "Oslo", "time": "09:41"}') == "city: Oslo, time: 09:41"
    rng = random.Random(0)
    for _ in range(30):
        messages, _ = tool_text_dialogue(rng)
        results = [m["content"] for m in messages if m["role"] == "tool"]
        assert all(not r.startswith(("{", "[")) for r in results)


def test_code_openings_start_at_a_definition_in_column_zero() -> None:
    source = ('"""Doc."""\nimport os\n\n\nclass Stack:\n    """A stack."""\n\n    def push(self, x):\n'
              '        self.items.append(x)\n\n\n@decorated\ndef top(n):\n    return n\n')
    snippets = code_openings([source, "def broken(:\n"])
    assert snippets[0].startswith("class Stack:\n") and "def push" in snippets[0]
    assert snippets[1] == "def push(self, x):\n    self.items.append(x)\n"
    assert snippets[2] == "def top(n):\n    return n\n"
    assert len(code_openings([source], max_lines=2)[0].splitlines()) == 2


def test_short_rows_start_with_an_opening_and_fill_from_the_stream() -> None:
    class Tok:  # one token a character
        def encode_batch(self, texts, add_special_tokens=False):
            return [type("E", (), {"ids": [ord(c) for c in t], "offsets": [(i, i + 1) for i in range(len(t))]})()
                    for t in texts]

    ids, mask = pack_row_starts([("def a", 0), ("class Bb", 0)], [("xyz", 1)], Tok(), 8)
    rows = ["".join(map(chr, r.tolist())) for r in ids]
    assert rows == ["def axyz", "class Bb"]
    assert mask[0].tolist() == [True] * 5 + [False, True, True]  # the fill's prompt is context
    ids, _ = pack_row_starts([("ab", 0)], [("xyz", 0)], Tok(), 9)
    assert "".join(map(chr, ids[0].tolist())) == "abxyzxyzx"  # the fill wraps around


def test_a_fine_tune_with_openings_trains_short_rows_between_long_ones(tmp_path: Path) -> None:
    from flashtree.train.corpus import dialogue
    from flashtree.train.loop import LoopConfig
    from flashtree.train.target_train import TargetTrainConfig, train_target
    from flashtree.train.tokenizer_train import save_tokenizer, train_tokenizer

    rng = random.Random(0)
    records = [dialogue("chat" if i % 2 else "tool", rng) for i in range(60)]
    write_jsonl(tmp_path / "corpus.jsonl.gz", records)
    openings = [{"kind": "code", "text": t} for t in code_openings(["def add(a, b):\n    return a + b\n"] * 5)]
    write_jsonl(tmp_path / "openings.jsonl.gz", openings)
    save_tokenizer(train_tokenizer((training_text(r) for r in records), vocab_size=400), tmp_path / "tok")
    cfg = TargetTrainConfig(size="test", seq_len=128, batch_size=2, short_seq_len=32, short_every=2,
                            loop=LoopConfig(steps=4, lr=1e-3, warmup=1, log_every=1))
    summary = train_target(tmp_path / "corpus.jsonl.gz", tmp_path / "tok", tmp_path / "out", cfg, torch.device("cpu"),
                           openings=[tmp_path / "openings.jsonl.gz"], short_answers_only=[tmp_path / "corpus.jsonl.gz"])
    assert summary["steps"] == 4 and summary["short_rows"] == 5
    assert summary["config"]["short_every"] == 2 and (tmp_path / "out" / "config.json").is_file()


def test_the_recipe_repairs_after_the_client_stage_and_regens_on_the_repaired_target(tmp_path: Path) -> None:
    """With openings in the corpus, recipe.sh anchors on the starting target's answers, runs the
    repair stage with short rows, and regen and the draft use its target. The flashtree commands
    are stood in for by a script that logs its arguments and writes the --out path."""
    fake = tmp_path / "ft.sh"
    fake.write_text('echo "$*" >> "$FT_LOG"\nprev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done\n'
                    'case "$2" in regen) touch "$out";; target|draft) mkdir -p "$out" && echo {} > "$out/config.json";;'
                    ' esac\n')
    work = tmp_path / "work"
    for folder in ("corpus", "tokenizer", "target", "target_client"):
        (work / folder).mkdir(parents=True)
    for name in ("train.jsonl.gz", "unseen_code.jsonl.gz", "client_agent.jsonl.gz", "openings.jsonl.gz",
                 "tool_text.jsonl.gz"):
        (work / "corpus" / name).write_text("")
    (work / "tokenizer" / "tokenizer.json").write_text("{}")
    for folder in ("target", "target_client"):
        (work / folder / "config.json").write_text("{}")
    log = tmp_path / "log"
    env = {**os.environ, "FLASHTREE": f"bash {fake}", "FT_LOG": str(log), "REPAIR_ANCHOR_PER_KIND": "7",
           "REGEN_HELDOUT": "0"}
    proc = subprocess.run(["bash", str(RECIPE), str(work)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [c.split() for c in log.read_text().splitlines()]
    assert [c[:2] for c in calls] == [["train", "regen"], ["train", "target"], ["train", "regen"], ["train", "draft"]]
    anchor, stage, regen, draft = calls
    assert anchor[anchor.index("--target") + 1] == str(work / "target_client")
    assert anchor[anchor.index("--per-kind") + 1] == "7"
    assert stage[stage.index("--init") + 1] == str(work / "target_client")
    assert stage[stage.index("--openings") + 1] == str(work / "corpus" / "openings.jsonl.gz")
    short = stage[stage.index("--short-answers-only") + 1:stage.index("--short-seq-len")]
    assert short == [str(work / "corpus" / "train.jsonl.gz"), str(work / "corpus" / "tool_text.jsonl.gz")]
    answers = stage[stage.index("--answers-only") + 1:stage.index("--openings")]
    assert answers == [str(work / "corpus" / "client_agent.jsonl.gz"), str(work / "repair_anchor" / "regen.jsonl")]
    assert regen[regen.index("--target") + 1] == str(work / "target_repair")
    assert draft[draft.index("--target") + 1] == str(work / "target_repair") and "--eval" not in draft
