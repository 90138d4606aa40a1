"""`flashtree train score`: a target's held-out behaviour, greedy, on the CPU, in a few minutes.

A fine-tune stage must not lower what the stages before it taught, and acceptance length alone
does not say whether the target still answers correctly. This scorer regenerates, from the
corpus generators' held-out random streams, conversations whose right next turn is known, lets
the target continue each one greedily through the flashtree engine (autoregressive, float32 on
the CPU: deterministic), and checks the continuation:

- `tool`: generic tool rounds (the corpus's five tools, `synth_tools.TOOLS`), cut right after the
  last tool result. Answered from the result: the answer ends, calls no tool, and holds every word
  that the reference answer takes from the round (the call's arguments and the result's values:
  `12 * 7 = 84.` needs 12, 7 and 84, so `12 * 7 = 844.` fails; `It is 23°C and sunny in Lisbon`
  needs 23, sunny and Lisbon).
- `tool_text`: the same rounds with the results as plain text (`84`; `city: Lisbon, temperature:
  21, ...`), as a user's own tool would send them; judged alike.
- `chat`: the held-out chat dialogues cut before their last answer. Correct: the answer ends and
  its last line is the reference's (`final_line`: a worked answer may show its steps or not,
  which the question does not say, but its final sentence is fixed).
- `client`: the held-out tool rounds in the agent clients' frames, cut where the corpus's held-out
  file cuts them. A call turn counts when its first `<tool_call>` has the reference's name and
  arguments (a free-text `description` aside); an answer turn by the same word rule as `tool`.
- `agent`: held-out agent-framed prompts: the answer ends within `max_tokens`.
- `code`: held-out code prompts (cut from files the target never trained on): the continuation is
  not degenerate (`degenerate` below).
- `readme`: the README's example prompts and the model card's bare code prompts. Code ones must
  be sensible Python (`sensible_code`), chat ones must end and mention the expected text.

Every check is a plain function of (reference, generated text) with a test; `score_target` runs
them and returns the shares with every failing output, so a regression can be read, not only
counted.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional

from .corpus import Record, cut_prompt, dialogue, prompt_text, read_jsonl
from .synth_tools import with_text_results

HELDOUT_STREAM = 1_000_003  # corpus.build_corpus's held-out dialogues: random.Random(seed + this)
CLIENT_HELDOUT_STREAM = 4_243  # and its held-out client tool rounds

# The README's `flashtree generate` example and the bare prompts the model card names, continued
# as raw text; the README's chat examples with the text their answers must hold.
README_CODE = {
    "fibonacci": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "fib": "def fib(n):\n",
    "stack": "class Stack:\n",
    "stack_doc": 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "list_files": "import os\ndef list_files(path):\n",
}
README_CHAT = {"What is the capital of France?": "Paris", "How do I reverse a string in Python?": "[::-1]"}

_WORD = re.compile(r"-?[A-Za-z0-9]+(?:[._:/-][A-Za-z0-9]+)*")
_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
FREE_TEXT = ("description",)
# words a tool result's fixed text shares with any answer ("completed with no output"): not values
STOPWORDS = frozenset("a an and at for in is it no of on the to with".split())


# --- the held-out conversations ------------------------------------------------------------------

def heldout_tool_rounds(n: int, seed: int = 0, n_heldout: int = 60) -> list[tuple[Record, dict[str, Any]]]:
    """`n` held-out generic tool rounds: (prompt record ending with the tool results, reference
    answer message). The corpus's held-out stream draws `n_heldout` chat and then `n_heldout` tool
    dialogues; these are its tool dialogues, in order, and then the same stream's next ones (never
    in training: that draws on `random.Random(seed)`). Dialogues without a tool round are skipped;
    a dialogue with two is cut at its last."""
    rng = random.Random(seed + HELDOUT_STREAM)
    for _ in range(n_heldout):
        dialogue("chat", rng)
    out: list[tuple[Record, dict[str, Any]]] = []
    while len(out) < n:
        rec = dialogue("tool", rng)
        msgs = rec["messages"]
        cuts = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i and msgs[i - 1]["role"] == "tool"]
        if cuts:
            out.append(({"kind": "tool", "messages": msgs[:cuts[-1]], "tools": rec["tools"]}, msgs[cuts[-1]]))
    return out


def text_result_rounds(rounds: list[tuple[Record, dict[str, Any]]]) -> list[tuple[Record, dict[str, Any]]]:
    """The same tool rounds with every tool result of the last round as plain text
    (`synth_tools.as_text_result`)."""
    out = []
    for prompt, ref in rounds:
        msgs = prompt["messages"]
        i = len(msgs)
        while i and msgs[i - 1]["role"] == "tool":
            i -= 1
        out.append(({**prompt, "messages": msgs[:i] + with_text_results(msgs[i:])}, ref))
    return out


def heldout_chat(seed: int = 0, n_heldout: int = 60) -> list[tuple[Record, dict[str, Any]]]:
    """The corpus's `n_heldout` held-out chat dialogues, each cut before its last answer:
    (prompt record, reference answer message)."""
    rng = random.Random(seed + HELDOUT_STREAM)
    out = []
    for _ in range(n_heldout):
        msgs = dialogue("chat", rng)["messages"]
        out.append(({"kind": "chat", "messages": msgs[:-1], "tools": []}, msgs[-1]))
    return out


def heldout_client_rounds(seed: int = 0, n_heldout: int = 60) -> list[tuple[Record, dict[str, Any]]]:
    """The corpus's held-out client tool rounds (`client_agent_heldout.jsonl`, rebuilt from the same
    stream, so its first rounds are the corpus's and more may be drawn past them): (prompt record,
    the reference's next message: the call or the final answer)."""
    from .synth_client_agent import client_agent_record, load_frames
    from .synth_tasks import Pools

    rng, frames, pools = random.Random(seed + CLIENT_HELDOUT_STREAM), load_frames(), Pools.split(heldout=True)
    out = []
    for _ in range(n_heldout):
        rec = client_agent_record(rng, frames, pools)
        prompt = cut_prompt(rec, rng)
        out.append((prompt, rec["messages"][len(prompt["messages"])]))
    return out


# --- the checks ------------------------------------------------------------------------------------

def words(text: str) -> list[str]:
    """Words, numbers (with a leading minus), file names and times: `-3`, `apple.log`, `09:05`."""
    return _WORD.findall(text)


def _values(content: Any) -> list[str]:
    """The scalar values of a JSON document (keys left out), or the text itself when not JSON."""
    if isinstance(content, str):
        try:
            content = json.loads(content)
        except ValueError:
            return [content]
        if isinstance(content, str):
            return [content]
    if isinstance(content, dict):
        return [v for x in content.values() for v in _values(x)]
    if isinstance(content, list):
        return [v for x in content for v in _values(x)]
    return [] if content is None else [json.dumps(content) if isinstance(content, bool) else str(content)]


def final_line(text: str) -> str:
    """An answer's last line with letters or digits, without an `Answer: ` label: the final
    sentence of a worked answer (`2030 + 5367 = 7397.`)."""
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"[A-Za-z0-9]", ln)]
    last = lines[-1] if lines else ""
    return last[len("Answer: "):] if last.startswith("Answer: ") else last


def round_words(prompt: Record, reference: str) -> set[str]:
    """The words of `reference` that come from the prompt's last tool round: its call's arguments
    (a free-text `description` aside) and its tool results' values."""
    msgs = prompt["messages"]
    i = len(msgs)
    while i and msgs[i - 1]["role"] == "tool":
        i -= 1
    source: list[str] = [v for m in msgs[i:] for v in _values(m["content"])]
    if i and msgs[i - 1]["role"] == "assistant":
        for call in msgs[i - 1].get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments") or {}
            args = json.loads(args) if isinstance(args, str) else args
            source += _values({k: v for k, v in args.items() if k not in FREE_TEXT})
    have = {w for s in source for w in words(s)}
    return {w for w in words(reference) if w in have and w.lower() not in STOPWORDS}


def answer_text(generated: str) -> str:
    """The answer's visible text: a leading `<think>` block and the end markers removed."""
    text = _THINK.sub("", generated)
    for end in ("<|im_end|>", "<|endoftext|>"):
        text = text.split(end)[0]
    return text.strip()


def answered_from_result(prompt: Record, reference: str, generated: str, ended: bool) -> bool:
    """The answer ends, calls no tool, and holds every word the reference takes from the round."""
    text = answer_text(generated)
    if not ended or "<tool_call>" in generated or not text:
        return False
    return round_words(prompt, reference) <= set(words(text))


def first_tool_call(generated: str) -> Optional[tuple[str, dict[str, Any]]]:
    """(name, arguments) of the first well-formed `<tool_call>` in a generated text."""
    m = _CALL.search(generated)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None
    return str(call.get("name")), call["arguments"]


def same_call(reference: dict[str, Any], generated: str) -> bool:
    """The generated text's first call is the reference message's first (free text aside)."""
    got = first_tool_call(generated)
    if got is None or not reference.get("tool_calls"):
        return False
    fn = reference["tool_calls"][0].get("function", reference["tool_calls"][0])
    args = fn["arguments"] if isinstance(fn["arguments"], dict) else json.loads(fn["arguments"])
    strip = lambda a: {k: v for k, v in a.items() if k not in FREE_TEXT}  # noqa: E731
    return got[0] == fn["name"] and strip(got[1]) == strip(args)


def repeated_lines(text: str, most: int = 2) -> list[str]:
    """Lines (stripped, with at least three letters or digits) that occur more than `most` times."""
    counts = Counter(s for s in (line.strip() for line in text.splitlines()) if len(re.findall(r"[A-Za-z0-9]", s)) >= 3)
    return [s for s, c in counts.items() if c > most]


def degenerate(text: str) -> Optional[str]:
    """Why a continuation is degenerate, or None: a line repeated more than twice, or one run of
    1-4 words repeated four or more times in a row (`return _ yield _ yield _ yield ...`)."""
    rep = repeated_lines(text)
    if rep:
        return f"line repeated: {rep[0]!r}"
    toks = text.split()
    for size in range(1, 5):
        for i in range(len(toks) - 4 * size + 1):
            unit = toks[i:i + size]
            if all(toks[i + k * size:i + (k + 1) * size] == unit for k in range(1, 4)):
                return f"run repeated: {' '.join(unit)!r}"
    return None


def _compiles(source: str) -> Optional[str]:
    try:
        compile(source, "<completion>", "exec")
        return None
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"


def sensible_code(prompt: str, completion: str, ended: bool) -> Optional[str]:
    """Why a code continuation is not sensible, or None. Sensible: not `degenerate`; at least one
    new full non-blank line (the whole completion when it ended, else up to its last newline); and
    the prompt with those lines compiles as Python, where a block left open at the cut may be
    closed by one indented `pass` and a string left open by its quotes (the cut is arbitrary)."""
    why = degenerate(completion)
    if why:
        return why
    kept = completion if ended else completion[:completion.rfind("\n") + 1]
    kept = kept.split("<|endoftext|>")[0].split("<|im_end|>")[0]
    if not kept.strip():
        return "no full line"
    source = prompt + kept
    error = _compiles(source)
    if error is None:
        return None
    last = [line for line in source.splitlines() if line.strip()][-1]
    indent = len(last) - len(last.lstrip()) + 4
    for tail in ("\n" + " " * indent + "pass\n", '"""\n', "'''\n", '"""\n' + " " * indent + "pass\n"):
        if _compiles(source.rstrip("\n") + "\n" + tail if tail[0] != "\n" else source.rstrip("\n") + tail) is None:
            return None
    return error


# --- running them --------------------------------------------------------------------------------

def _share(rows: list[dict[str, Any]]) -> float:
    return round(sum(r["ok"] for r in rows) / max(1, len(rows)), 3)


def score_target(target: Optional[str], checks: Iterable[str] = ("tool", "tool_text", "chat", "client", "readme",
                                                                  "code"),
                 n_tool: int = 100, prompts: Optional[str] = None, agent_prompts: Optional[str] = None,
                 n_agent: int = 20, n_code: int = 30, n_client: int = 60, max_tokens: int = 128,
                 device: Optional[str] = None, seed: int = 0) -> dict[str, Any]:
    """Run the checks on `target` (None: the embedded one); returns each check's share of passes,
    its count, and every failing case's prompt tail and output. `prompts` is the held-out prompt
    file for `code` (default: the one shipped beside the embedded model); `agent` needs
    `agent_prompts` (the corpus's `agent_heldout.jsonl`)."""
    from .. import Engine, SamplingParams

    checks = list(checks)
    engine = Engine.from_pretrained(target, None, mode="ar", max_ctx=32768, device=device or "cpu", dtype="float32")
    tok, greedy = engine.tokenizer, SamplingParams(temperature=0.0)

    def run(text: str, limit: int = max_tokens) -> tuple[str, bool]:
        result = engine.generate(tok.encode(text), sampling=greedy, max_tokens=limit)
        return tok.decode(result.token_ids), result.finish_reason == "stop"

    report: dict[str, Any] = {"target": target or "embedded", "max_tokens": max_tokens, "checks": {}}
    t0 = time.perf_counter()
    for check in checks:
        rows: list[dict[str, Any]] = []
        if check in ("tool", "tool_text"):
            rounds = heldout_tool_rounds(n_tool, seed)
            for prompt, ref in rounds if check == "tool" else text_result_rounds(rounds):
                out, ended = run(prompt_text(prompt, tok))
                rows.append({"ok": answered_from_result(prompt, ref["content"], out, ended), "ended": ended,
                             "ask": prompt["messages"][-3 if len(prompt["messages"]) > 2 else 0]["content"],
                             "want": sorted(round_words(prompt, ref["content"])), "output": out})
        elif check == "chat":
            for prompt, ref in heldout_chat(seed):
                out, ended = run(prompt_text(prompt, tok))
                ok = ended and final_line(answer_text(out)) == final_line(ref["content"])
                rows.append({"ok": ok, "ended": ended, "ask": prompt["messages"][-1]["content"],
                             "want": ref["content"], "output": out})
        elif check == "client":
            for prompt, ref in heldout_client_rounds(seed, n_client):
                out, ended = run(prompt_text(prompt, tok), 160)
                if ref.get("tool_calls"):
                    ok, want = same_call(ref, out), ref["tool_calls"][0]
                else:
                    ok, want = answered_from_result(prompt, ref["content"], out, ended), ref["content"]
                rows.append({"ok": ok, "ended": ended, "turn": "call" if ref.get("tool_calls") else "answer",
                             "want": want, "output": out})
            report["checks"]["client_call"] = _share([r for r in rows if r["turn"] == "call"])
            report["checks"]["client_answer"] = _share([r for r in rows if r["turn"] == "answer"])
        elif check == "agent":
            if not agent_prompts:
                raise ValueError("the agent check needs agent_prompts (the corpus's agent_heldout.jsonl)")
            for rec in list(read_jsonl(agent_prompts))[:n_agent]:
                out, ended = run(prompt_text(rec, tok))
                rows.append({"ok": ended, "output": out[-300:]})
        elif check == "code":
            from .eval_acceptance import first_per_kind

            path = prompts or str(Path(__file__).resolve().parents[1] / "assets" / "heldout_prompts.jsonl")
            for rec in [r for r in first_per_kind(path, None) if r["kind"] == "code"][:n_code]:
                out, _ = run(rec["text"])
                why = degenerate(out)
                rows.append({"ok": why is None, "why": why, "prompt": rec["text"][-120:], "output": out})
        elif check == "readme":
            for name, text in README_CODE.items():
                out, ended = run(text, 64)
                why = sensible_code(text, out, ended)
                rows.append({"ok": why is None, "prompt": name, "why": why, "output": out})
            for ask, needle in README_CHAT.items():
                out, ended = run(prompt_text({"kind": "chat", "messages": [{"role": "user", "content": ask}]}, tok))
                text = answer_text(out)
                ok = ended and needle in text and degenerate(text) is None
                rows.append({"ok": ok, "prompt": ask, "output": out})
        else:
            raise ValueError(f"unknown check {check!r}")
        report["checks"][check] = _share(rows)
        report.setdefault("counts", {})[check] = f"{sum(r['ok'] for r in rows)}/{len(rows)}"
        report.setdefault("failures", {})[check] = [r for r in rows if not r["ok"]]
        if check == "readme":
            report["readme"] = {r["prompt"]: r["ok"] for r in rows}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
