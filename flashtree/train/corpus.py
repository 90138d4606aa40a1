"""Build the training corpus: standard-library Python source plus synthetic chat and tool dialogues.

Deterministic and offline: the code comes from the running interpreter's own standard library
(sorted, filtered), the dialogues from seeded generators. Held-out items never appear in training:
code files are split by a stable hash of their path, dialogues come from a separate seed. Held-out
records are already cut into prompts (messages ending before an assistant turn, or a code prefix),
so the same file drives regeneration, acceptance evaluation and tests.

Record format (one JSON object a line):
  {"kind": "code", "text": "..."}
  {"kind": "chat" | "tool", "messages": [...], "tools": [...]}
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import sysconfig
import textwrap
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from ..checkpoint import render_chat
from .chat_template import EMBEDDED
from .synth_agent import agent_dialogue, docstring_paragraphs
from .synth_chat import chat_dialogue
from .synth_client_agent import client_agent_record, load_frames
from .synth_tasks import Pools
from .synth_copy import copy_record
from .synth_tools import tool_dialogue, tool_text_dialogue

Record = dict[str, Any]

_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "pydoc_data",
               "site-packages", "__pycache__", "ensurepip", "tkinter"}
_TEST_PARTS = {"test", "tests"}
_MAX_FILE_BYTES = 100_000
_HELDOUT_MODULUS = 12  # one code file in twelve is held out


def stdlib_files(root: Optional[str] = None, tests: bool = False) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files worth learning from, sorted.

    With `tests`, only the files of its test packages instead: code in the library's style that
    the target never trains on, so its completions there are like those of a user's code."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = _SKIP_PARTS - _TEST_PARTS if tests else _SKIP_PARTS
    out = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        in_tests = bool(_TEST_PARTS & set(rel.parts))
        if in_tests != tests or skip & set(rel.parts) or rel.parts[0].startswith("config-") \
                or rel.name.startswith("_sysconfigdata") or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel.as_posix(), text))
    return out


def is_heldout_path(rel_path: str) -> bool:
    """Stable split of code files (crc32 of the path, not Python's salted hash)."""
    return zlib.crc32(rel_path.encode()) % _HELDOUT_MODULUS == 0


def code_openings(texts: Iterable[str], max_lines: int = 40) -> list[str]:
    """Every function and class of the given source files as a snippet that starts at its `def`
    or `class` line (decorators left out), dedented to column 0, at most `max_lines` lines: what a
    user's bare code prompt looks like (`def fib(n):`, `class Stack:`). Files that do not parse
    are skipped; the order is the files' and, within one, the definitions' (by line)."""
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            end = min(node.end_lineno or node.lineno, node.lineno - 1 + max_lines)
            snippet = textwrap.dedent("".join(lines[node.lineno - 1:end]))
            if snippet.strip() and not snippet[0].isspace():
                out.append(snippet if snippet.endswith("\n") else snippet + "\n")
    return out


def dialogue(kind: str, rng: random.Random) -> Record:
    """One synthetic conversation of the given kind ("tool_text": a tool one with plain-text
    results)."""
    if kind in ("tool", "tool_text"):
        messages, tools = (tool_dialogue if kind == "tool" else tool_text_dialogue)(rng)
        return {"kind": "tool", "messages": messages, "tools": tools}
    return {"kind": "chat", "messages": chat_dialogue(rng), "tools": []}


def cut_prompt(record: Record, rng: random.Random) -> Record:
    """A prompt record from a full one: a code prefix, or the messages before one assistant turn."""
    if record["kind"] == "code":
        lines = record["text"].splitlines(keepends=True)
        start = rng.randrange(max(1, len(lines) - 20))
        return {"kind": "code", "text": "".join(lines[start:start + rng.randint(12, 60)])}
    messages = record["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return {"kind": record["kind"], "messages": messages[:rng.choice(turns)], "tools": record["tools"]}


def prompt_text(record: Record, tokenizer: Any = EMBEDDED) -> str:
    """The text a model is given for a prompt record (chat ones end with the generation prompt).

    `tokenizer` is anything with `chat_template`, `bos_token` and `eos_token` (a transformers or
    flashtree tokenizer), so prompts can be rendered for any target."""
    if record["kind"] == "code":
        return record["text"]
    return render_chat(tokenizer, record["messages"], record.get("tools"), add_generation_prompt=True)


def training_text(record: Record, tokenizer: Any = EMBEDDED, eos: str = "<|endoftext|>") -> str:
    """A full record as one training document, closed by the end-of-text token."""
    if record["kind"] == "code":
        return record["text"] + eos
    return render_chat(tokenizer, record["messages"], record.get("tools"), add_generation_prompt=False) + eos


def training_document(record: Record, answers_only: bool = False, tokenizer: Any = EMBEDDED) -> tuple[str, int]:
    """(training_text(record), where its loss starts). The loss starts at 0, or with
    `answers_only` after the conversation's prompt: all it holds before the first assistant turn,
    generation prompt included (0 for a record without an assistant turn, or not a chat). A
    fine-tune that should learn the answers, not the long frame around them, predicts only those."""
    text = training_text(record, tokenizer)
    messages = record.get("messages") or []
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not answers_only or first is None:
        return text, 0
    prompt = render_chat(tokenizer, messages[:first], record.get("tools"), add_generation_prompt=True)
    return text, len(os.path.commonprefix([prompt, text]))


def write_jsonl(path: Path, records: Iterable[Record]) -> int:
    """Write records one a line (gzip when the name ends in .gz); returns how many."""
    opener = gzip.open if str(path).endswith(".gz") else open
    n = 0
    with opener(path, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: Path | str) -> Iterator[Record]:
    """Read records written by `write_jsonl` (plain or gzip)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def build_corpus(out_dir: Path, seed: int = 0, n_chat: int = 40_000, n_tool: int = 30_000,
                 n_heldout: int = 60, stdlib_root: Optional[str] = None, n_agent: int = 0,
                 n_client_agent: int = 0, n_copy: int = 0, n_openings: int = 0,
                 n_tool_text: int = 0) -> dict[str, int]:
    """Write train.jsonl.gz, heldout.jsonl and unseen_code.jsonl.gz (the standard library's tests:
    code prompts for regeneration) under `out_dir`, and with `n_agent` agent.jsonl.gz and
    agent_heldout.jsonl (agent-framed conversations, synth_agent.py: the long-context stage of
    target training), with `n_client_agent` client_agent.jsonl.gz and client_agent_heldout.jsonl
    (tool rounds in the real clients' requests, synth_client_agent.py: the agent stage; the
    held-out prompts use only held-out names, contents and phrasings), with `n_copy`
    copy_drill.jsonl.gz (synth_copy.py: repeat random vocabulary tokens, for the agent stage),
    with `n_openings` openings.jsonl.gz (code records: `code_openings` of the training code, drawn
    at random: the repair stage starts its short rows with them), with `n_tool_text`
    tool_text.jsonl.gz (tool dialogues with plain-text results). Returns counts per kind.
    The agent records draw on their own random streams, so the other files are the same with or
    without them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    code = stdlib_files(stdlib_root)
    train_code = [{"kind": "code", "text": t} for p, t in code if not is_heldout_path(p)]
    held_code = [{"kind": "code", "text": t} for p, t in code if is_heldout_path(p)]
    kinds = ["chat"] * n_chat + ["tool"] * n_tool
    train = train_code + [dialogue(k, rng) for k in kinds]
    rng.shuffle(train)

    held_rng = random.Random(seed + 1_000_003)
    cut_rng = random.Random(seed + 7)
    heldout: list[Record] = []
    for kind in ("code", "chat", "tool"):
        if kind == "code":
            pool = held_code * (1 + n_heldout // max(1, len(held_code)))
        else:
            pool = [dialogue(kind, held_rng) for _ in range(n_heldout)]
        heldout += [cut_prompt(r, cut_rng) for r in pool[:n_heldout]]
    write_jsonl(out_dir / "train.jsonl.gz", train)
    write_jsonl(out_dir / "heldout.jsonl", heldout)
    unseen = write_jsonl(out_dir / "unseen_code.jsonl.gz",
                         ({"kind": "code", "text": t} for _, t in stdlib_files(stdlib_root, tests=True)))
    counts = {"train_code": len(train_code), "train_chat": n_chat, "train_tool": n_tool,
              "heldout": len(heldout), "unseen_code": unseen}
    if n_agent:
        paragraphs = docstring_paragraphs((p, t) for p, t in code if not is_heldout_path(p))
        agent_rng = random.Random(seed + 31_337)
        counts["train_agent"] = write_jsonl(out_dir / "agent.jsonl.gz",
                                            (agent_dialogue(agent_rng, paragraphs) for _ in range(n_agent)))
        counts["heldout_agent"] = write_jsonl(out_dir / "agent_heldout.jsonl", (
            cut_prompt(agent_dialogue(agent_rng, paragraphs), agent_rng) for _ in range(n_heldout)))
    if n_client_agent:
        frames = load_frames()
        train_rng, held_rng = random.Random(seed + 4_242), random.Random(seed + 4_243)
        train_pools, held_pools = Pools.split(heldout=False), Pools.split(heldout=True)
        counts["train_client_agent"] = write_jsonl(out_dir / "client_agent.jsonl.gz", (
            client_agent_record(train_rng, frames, train_pools) for _ in range(n_client_agent)))
        counts["heldout_client_agent"] = write_jsonl(out_dir / "client_agent_heldout.jsonl", (
            cut_prompt(client_agent_record(held_rng, frames, held_pools), held_rng) for _ in range(n_heldout)))
    if n_copy:
        copy_rng = random.Random(seed + 5_151)
        counts["copy_drill"] = write_jsonl(out_dir / "copy_drill.jsonl.gz",
                                           (copy_record(copy_rng) for _ in range(n_copy)))
    if n_openings:
        snippets = code_openings(t for p, t in code if not is_heldout_path(p))
        open_rng = random.Random(seed + 6_161)
        counts["openings"] = write_jsonl(out_dir / "openings.jsonl.gz", (
            {"kind": "code", "text": open_rng.choice(snippets)} for _ in range(n_openings)))
    if n_tool_text:
        text_rng = random.Random(seed + 7_171)
        counts["tool_text"] = write_jsonl(out_dir / "tool_text.jsonl.gz",
                                          (dialogue("tool_text", text_rng) for _ in range(n_tool_text)))
    (out_dir / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts
