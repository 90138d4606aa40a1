"""Agent-style conversations: the frame that coding-agent clients put around a request.

Clients such as Claude Code and Codex open with thousands of tokens of prose instructions and
dozens of tool schemas, and append reminders after the user's request. A target trained only on
short chats drifts off into that prose (measured: the embedded target never ended an answer to a
2K-token system prompt + request) instead of answering. These records put the synthetic chat and
tool tasks in such a frame, so that the target learns to answer the request and stop. The prose is
real English technical text: paragraphs of the standard library's docstrings.
"""

from __future__ import annotations

import ast
import random
import re
from typing import Any, Iterable

from .lexicon import IDENTIFIERS, WORDS
from .synth_chat import chat_dialogue
from .synth_tools import tool_dialogue

Record = dict[str, Any]

_CHARS_PER_TOKEN = 4  # about, for English prose with the embedded tokenizer
_HEADINGS = ["Guidelines", "Tone and style", "Tool usage", "Doing tasks", "Safety", "Environment",
             "Code references", "Task management", "Output format", "Working with files", "Notes"]
_REMINDERS = ["As you answer the user's questions, you can use the following context:",
              "This context may or may not be relevant to the task. Do not respond to it unless "
              "it is highly relevant.",
              "The user opened a file in the editor. This may or may not be related to the task."]


def docstring_paragraphs(files: Iterable[tuple[str, str]], min_words: int = 8) -> list[str]:
    """English paragraphs from the docstrings of Python sources: mostly words, no code."""
    out = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                for para in re.split(r"\n\s*\n", doc):
                    flat = " ".join(para.split())
                    words = flat.split()
                    letters = sum(c.isalpha() or c.isspace() for c in flat)
                    if len(words) >= min_words and letters >= 0.85 * len(flat) and ">>>" not in flat:
                        out.append(flat)
    return out


def instructions(rng: random.Random, paragraphs: list[str], tokens: int) -> str:
    """About `tokens` tokens of system-prompt prose: sections of paragraphs and bullet lists."""
    parts = [rng.choice(["You are an interactive agent that helps users with software engineering tasks.",
                         "You are a coding agent running in the user's terminal.",
                         "You are a helpful assistant with access to tools."])]
    size = len(parts[0])
    while size < tokens * _CHARS_PER_TOKEN:
        block = f"# {rng.choice(_HEADINGS)}\n"
        for _ in range(rng.randint(1, 4)):
            para = rng.choice(paragraphs)
            block += (f"- {para}\n" if rng.random() < 0.4 else f"{para}\n\n")
        parts.append(block.rstrip())
        size += len(block)
    return "\n\n".join(parts)


def decoy_tools(rng: random.Random, paragraphs: list[str], n: int) -> list[dict[str, Any]]:
    """`n` tool schemas the task does not need, with prose descriptions, as agents offer them."""
    tools = []
    for _ in range(n):
        name = f"{rng.choice(WORDS)}_{rng.choice(IDENTIFIERS)}"
        props = {f"{rng.choice(IDENTIFIERS)}_{i}": {"type": rng.choice(["string", "integer", "boolean"]),
                                                    "description": rng.choice(paragraphs)[:200]}
                 for i in range(rng.randint(1, 4))}
        tools.append({"type": "function", "function": {
            "name": name, "description": " ".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 3))),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]}}})
    return tools


def _reminder(rng: random.Random, paragraphs: list[str]) -> dict[str, str]:
    body = "\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 12)))
    return {"role": "user", "content": f"<system-reminder>\n{rng.choice(_REMINDERS)}\n{body}\n</system-reminder>"}


def agent_dialogue(rng: random.Random, paragraphs: list[str], max_tokens: int = 24_000) -> Record:
    """A chat or tool-use conversation inside an agent's frame: long instructions, the task's tools
    among decoys, reminders around the first request. The assistant turns are the task's own."""
    if rng.random() < 0.5:
        messages, tools = tool_dialogue(rng)
    else:
        messages, tools = chat_dialogue(rng), []
    messages = [m for m in messages if m["role"] != "system"]
    budget = rng.choice([500, 1000, 2000, 4000, 8000, 12000, 16000])
    n_decoys = rng.randint(0, 30)
    tool_share = min(budget // 2, n_decoys * 150)
    tools = tools + decoy_tools(rng, paragraphs, n_decoys)
    rng.shuffle(tools)
    system = instructions(rng, paragraphs, min(max_tokens, budget) - tool_share)
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    if rng.random() < 0.5:  # Claude Code: the request, then reminders, then the answer
        messages[first + 1:first + 1] = [_reminder(rng, paragraphs) for _ in range(rng.randint(1, 2))]
    elif rng.random() < 0.5:  # context first, then the request
        messages.insert(first, _reminder(rng, paragraphs))
    return {"kind": "agent", "messages": [{"role": "system", "content": system}] + messages, "tools": tools}
