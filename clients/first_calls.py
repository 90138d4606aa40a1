"""`python -m clients.first_calls`: the agent stage's quick check. Does a target call each client's
own tool with a held-out task's exact arguments?

A real client run (`python -m clients.run --heldout-tasks N`) takes a CPU about a minute a task;
this asks only for the first turn, in the same frame (the client's recorded system prompt and
tools, rendered as the server renders them) and greedily, so a freshly trained target is judged
in seconds on a GPU and in a few minutes on a CPU, before its draft is trained. A call counts
when the server's own parser finds it and its name and arguments equal the training data's call
for that task (a tool's free-text `description` aside): the written content, the file's
(relative) path and the command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from flashtree.checkpoint import render_chat
from flashtree.serve.toolcalls import ToolCall, ToolCallParser
from flashtree.train.client_formats import CLIENTS
from flashtree.train.synth_client_agent import TOOL_FOR, load_frames
from flashtree.train.synth_tasks import Episode, heldout_episodes

# where the client runs in the check: a path like the harness's run directories, no training item in it
CHECK_RUN = "/work/flashtree/clients/.runs/2026-12-01T04-20-11/{client}"
CHECK_CWD, CHECK_HOME = CHECK_RUN + "/work", CHECK_RUN + "/home"
FREE_TEXT = ("description",)


def expected_call(client: str, ep: Episode, cwd: str) -> tuple[str, dict[str, Any]]:
    """The call the training data makes for `ep` in `client`'s frame, free-text fields dropped."""
    name, arguments, _ = TOOL_FOR[client](ep, cwd)
    return name, {k: v for k, v in arguments.items() if k not in FREE_TEXT}


def first_call(text: str, tools: list[dict[str, Any]]) -> Optional[ToolCall]:
    """The first tool call the server would parse out of a generated `text`."""
    parser = ToolCallParser(tools)
    pieces = parser.feed(text) + parser.finish()
    return next((p for p in pieces if isinstance(p, ToolCall)), None)


def judge(call: Optional[ToolCall], want: tuple[str, dict[str, Any]]) -> Optional[str]:
    """None when `call` is the wanted one, else what is wrong with it."""
    if call is None:
        return "no call of the client's tools"
    if call.name != want[0]:
        return f"called {call.name}, wanted {want[0]}"
    got = {k: v for k, v in json.loads(call.arguments).items() if k not in FREE_TEXT}
    wrong = [k for k in sorted(set(got) | set(want[1])) if got.get(k) != want[1].get(k)]
    return ", ".join(f"{k}={got.get(k)!r} (wanted {want[1].get(k)!r})" for k in wrong) or None


def evaluate_first_calls(target: Optional[str], n_tasks: int = 10, clients: tuple[str, ...] = CLIENTS,
                         max_tokens: int = 160, device: Optional[str] = None, seed: int = 0) -> dict[str, Any]:
    """Per client: how many of `n_tasks` held-out tasks get the exact call, and each task's verdict."""
    from flashtree import Engine, SamplingParams

    frames, episodes = load_frames(clients), heldout_episodes(n_tasks, seed)
    engine = Engine.from_pretrained(target, None, mode="ar", max_ctx=32768, device=device)
    greedy = SamplingParams(temperature=0.0)
    report: dict[str, Any] = {"target": target, "tasks": n_tasks, "clients": {}}
    for client in clients:
        frame, rows = frames[client], []
        cwd, home = CHECK_CWD.format(client=client), CHECK_HOME.format(client=client)
        for ep in episodes:
            body = frame.request(ep.task, cwd, home, [])
            tools = frame.chat_tools(body)
            prompt = render_chat(engine.tokenizer, frame.chat_messages(body)[:-1], tools, add_generation_prompt=True)
            result = engine.generate(engine.tokenizer.encode(prompt), sampling=greedy, max_tokens=max_tokens)
            text = engine.tokenizer.decode(result.token_ids)
            problem = judge(first_call(text, tools), expected_call(client, ep, cwd))
            rows.append({"task": ep.task, "family": ep.family, "ok": problem is None, "problem": problem,
                         "output": text})
        report["clients"][client] = {"exact_calls": sum(r["ok"] for r in rows), "tasks": rows}
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.first_calls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target dir (default: the embedded model)")
    p.add_argument("--tasks", type=int, default=10, help="held-out tasks per client")
    p.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None,
                   help="write the full report here (every task's verdict and the target's output)")
    args = p.parse_args(argv)
    clients = tuple(c for c in args.clients.split(",") if c)
    unknown = sorted(set(clients) - set(CLIENTS))
    if unknown:
        p.error(f"unknown client(s) {', '.join(unknown)}; known: {', '.join(CLIENTS)}")
    report = evaluate_first_calls(args.target, args.tasks, clients, args.max_tokens, args.device)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({c: f"{r['exact_calls']}/{args.tasks}" for c, r in report["clients"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
