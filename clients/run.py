"""`python -m clients.run`: run real agent clients against one `flashtree serve` and report.

One server (the embedded model unless --target is given, --max-ctx 65536, an API key so that
the clients' auth paths are exercised) sits behind a recording proxy; each client runs its
tasks in a temporary home under the run directory, which keeps everything: the server log,
the transcript of every exchange (transcript.jsonl), each task's output, and report.json.
Per client the report gives requests, HTTP statuses, tool calls the server parsed, tool results
that came back, prompt / cached / completion tokens (the server's counters) and wall time; per
task, whether its outcome was checked and found (the file with its content, or the command's
output in the answer), and its own tool calls, results and errors.

Each client's score (tasks checked) is reported against --threshold, the share of its tasks it
should pass: what a model answers is a measurement, so a score below it is a finding of the run,
not its exit status. Exit status 1 when the run itself failed: a client met an error of ours (a
5xx, a rejected request, an error inside a stream), the server died, or injected faults never
reached a client (the server not starting is an exception, exit 1 too).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import report
from .claude import Claude
from .codex import Codex
from .common import AgentClient, Endpoint, Task, file_tasks, run_client
from .hermes import Hermes
from .install import InstallError
from .opencode import OpenCode
from .proxy import RecordingProxy
from .server import AGENT_MAX_CTX, FlashtreeServer

RUNS_DIR = Path(__file__).resolve().parent / ".runs"
API_KEY = "sk-flashtree-clients"
CLIENTS = ("hermes", "codex", "claude", "opencode")


def heldout(n: int) -> list[Task]:
    """The agent stage's held-out tasks (names, contents and phrasings its training never saw)."""
    from flashtree.train.synth_tasks import heldout_tasks

    return [Task(t["prompt"], t.get("file"), t.get("content"), t.get("answer")) for t in heldout_tasks(n)]


def make_client(name: str, args: argparse.Namespace) -> AgentClient:
    client = _make_client(name, args)
    if args.heldout_tasks:
        client.tasks = heldout(args.heldout_tasks)
    return client


def _make_client(name: str, args: argparse.Namespace) -> AgentClient:
    cap, timeout = args.max_output_tokens, args.task_timeout
    if name == "hermes":
        hermes = Hermes(toolsets=args.hermes_toolsets, max_tokens=cap, timeout_s=timeout)
        if args.hermes_tasks == "tools":
            hermes.tasks = file_tasks("hermes")
        return hermes
    if name == "codex":  # Codex has no setting for it: its answers end when the model ends them
        return Codex(timeout_s=timeout)
    if name == "claude":
        return Claude(max_output_tokens=cap, timeout_s=timeout, tools=args.claude_tools)
    return OpenCode(max_output_tokens=cap, timeout_s=timeout)


def run_one(client: AgentClient, server: FlashtreeServer, proxy: RecordingProxy, run_dir: Path,
            tasks: Optional[int], threshold: float, faults: bool = False) -> dict[str, Any]:
    """Run one client's tasks; its summary, with the server's token counters for the run and the
    share of tasks it should pass (`threshold`, reported with its score). With `faults` injected,
    a 503 out_of_memory answer is what the run set out to cause: it is counted as `injected_oom`,
    not as an error (the client must still retry it and finish its tasks)."""
    proxy.label = client.name
    endpoint = Endpoint(proxy.url, server.model(), API_KEY)
    before, start = server.counters(), time.monotonic()

    def on_task(i: int) -> None:
        proxy.task = i

    results = run_client(client, endpoint, run_dir, client.tasks[:tasks] if tasks else None, on_task)
    proxy.task = 0
    wall = time.monotonic() - start
    after = server.counters()
    tokens = {name.removeprefix("flashtree_").removesuffix("_total"): int(after[name] - before[name])
              for name in after}
    records = report.load(proxy.transcript)
    summary = report.summarize(records, client.name)
    injected = [e for e in summary["errors"] if faults and is_injected_oom(e)]
    summary["errors"] = [e for e in summary["errors"] if e not in injected]
    per_task = []
    for i, r in enumerate(results, 1):
        mine = report.summarize(records, client.name, i)
        per_task.append({"task": r.task, "returncode": r.returncode, "checked": r.problem is None,
                         "problem": r.problem, "seconds": r.seconds, "requests": mine["requests"],
                         "tool_calls": mine["tool_calls"], "tool_results": mine["tool_results"],
                         "errors": [e for e in mine["errors"] if e not in injected] + mine["stream_errors"],
                         "output_tail": r.output[-300:]})
    return {"client": client.name, "wall_s": round(wall, 1), "tasks": per_task, "injected_oom": len(injected),
            "tasks_ok": sum(r.ok for r in results), "threshold": threshold, **summary, **tokens,
            "server_alive": server.alive}


def is_injected_oom(error: str) -> bool:
    """An error line of report.summarize that is the server's retryable out-of-memory answer: 503,
    with the OpenAI type `out_of_memory`, or Anthropic's `overloaded_error` saying "out of memory"."""
    return " 503: " in error and ("out_of_memory" in error or "out of memory during" in error)


def meets_threshold(entry: dict[str, Any]) -> bool:
    """Whether a client passed at least the threshold's share of its tasks (a ratio, compared as one:
    9 of 10 meets 0.9, where 9 >= 0.9 * 10 would not in floating point)."""
    return not entry["tasks"] or entry["tasks_ok"] / len(entry["tasks"]) >= entry["threshold"]


def score(entry: dict[str, Any]) -> str:
    """A client's tasks checked against its threshold, e.g. `9/10 (threshold 90%: met)`."""
    verdict = "met" if meets_threshold(entry) else "BELOW"
    return f"{entry['tasks_ok']}/{len(entry['tasks'])} (threshold {entry['threshold']:.0%}: {verdict})"


def broken(entry: dict[str, Any]) -> bool:
    """Whether a client's run met an error of ours or outlived the server: a failure whatever it
    scored (a client that was not installed is reported as skipped)."""
    return "skipped" not in entry and (bool(entry["errors"]) or bool(entry["stream_errors"])
                                       or not entry["server_alive"])


def print_table(entries: list[dict[str, Any]]) -> None:
    print(f"{'client':9} {'tasks':>6} {'reqs':>5} {'calls':>5} {'res':>4} {'prompt':>8} {'cached':>8} "
          f"{'compl':>6} {'wall_s':>7}  statuses / problems")
    for e in entries:
        if "skipped" in e:
            print(f"{e['client']:9} skipped: {e['skipped']}")
            continue
        problems = e["errors"] + e["stream_errors"]
        statuses = ", ".join(f"{k} x{v}" for k, v in e["statuses"].items())
        print(f"{e['client']:9} {e['tasks_ok']:>3}/{len(e['tasks']):<2} {e['requests']:>5} "
              f"{e['tool_calls']:>5} {e['tool_results']:>4} {e['prompt_tokens']:>8} {e['cached_tokens']:>8} "
              f"{e['completion_tokens']:>6} {e['wall_s']:>7}  {statuses}")
        print(f"{'':9} tasks checked {score(e)}")
        if e.get("side_by_side"):
            print(f"{'':9} requests that ran beside another of the client's: {e['side_by_side']} "
                  f"({e['side_by_side_ok']} answered 200)")
        for problem in problems:
            print(f"{'':9} PROBLEM {problem}")
        if e["injected_oom"]:
            print(f"{'':9} injected out-of-memory answers (503, for the client to retry): {e['injected_oom']}")
        for i, t in enumerate(e["tasks"], 1):
            verdict = "ok" if t["returncode"] == 0 and t["checked"] else (
                t["problem"] or f"exit {t['returncode']}")
            print(f"{'':9} task {i}: {verdict}; {t['requests']} requests, {t['tool_calls']} calls, "
                  f"{t['tool_results']} results, {t['seconds']} s  {t['task'][:60]!r}")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m clients.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated, from " + ", ".join(CLIENTS))
    p.add_argument("--tasks", type=int, default=None, help="run only the first N tasks of each client")
    p.add_argument("--target", help="model to serve (default: the embedded model)")
    p.add_argument("--draft", help="draft for --target")
    p.add_argument("--max-ctx", type=int, default=AGENT_MAX_CTX)
    p.add_argument("--faults", default="", help="FLASHTREE_FAULTS for the server, e.g. prefill:oom:5")
    p.add_argument("--hermes-toolsets", default=None, help="hermes -t value (default: its own)")
    p.add_argument("--hermes-tasks", choices=["reference", "tools"], default="reference",
                   help="hermes' ten-task reference loop, or the coding clients' tool tasks")
    p.add_argument("--heldout-tasks", type=int, default=0, metavar="N",
                   help="give every client N held-out tasks of the agent stage (create a file, append a "
                        "line, run a command; flashtree.train.synth_tasks) instead of its own")
    p.add_argument("--claude-tools", default=None,
                   help="claude --tools value, e.g. Bash,Read,Write (default: all its built-in tools)")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap each answer where the client has a setting for it (all but Codex)")
    p.add_argument("--task-timeout", type=float, default=900.0, help="seconds per task")
    p.add_argument("--threshold", type=float, default=1.0, metavar="SHARE",
                   help="share of its tasks each client should pass, reported with its score (not an exit "
                        "status; default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: clients/.runs/DATE)")
    p.add_argument("server_flags", nargs="*", help="more `flashtree serve` flags, after --")
    args = p.parse_args(argv)
    for flag in ("tasks", "heldout_tasks"):
        if (getattr(args, flag) or 0) < 0:
            p.error(f"--{flag.replace('_', '-')} must be 0 or more")
    if not 0 <= args.threshold <= 1:
        p.error("--threshold must be between 0 and 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # stopped from outside (`timeout`, kill): unwind, so that the running client's process group
    # and the server are stopped too instead of outliving the harness
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # absolute: the clients run in their own working directories and are handed paths inside it
    run_dir = (args.out or RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    clients = []
    for name in args.clients.split(","):
        client = make_client(name.strip(), args)
        try:
            client.executable()
            clients.append(client)
        except InstallError as e:
            entries.append({"client": client.name, "skipped": str(e)})
    flags = list(args.server_flags)
    if args.target:
        flags += ["--target", args.target] + (["--draft", args.draft] if args.draft else [])
    env = {"FLASHTREE_FAULTS": args.faults} if args.faults else {}
    print(f"run directory: {run_dir}", flush=True)
    with FlashtreeServer(run_dir / "server.log", *flags, max_ctx=args.max_ctx, api_key=API_KEY,
                         env=env) as server, \
            RecordingProxy(server.url, run_dir / "transcript.jsonl") as proxy:
        for client in clients:
            print(f"running {client.name} ...", flush=True)
            entries.append(run_one(client, server, proxy, run_dir, args.tasks, args.threshold, bool(args.faults)))
    (run_dir / "report.json").write_text(json.dumps(entries, indent=2) + "\n")
    print_table(entries)
    return exit_status(entries, args.faults)


def exit_status(entries: list[dict[str, Any]], faults: str) -> int:
    """1 when the run failed as a test of the server (an error of ours, a dead server, injected
    faults that reached no client), else 0 whatever the scores (they are in the report)."""
    ran = [e for e in entries if "skipped" not in e]
    if faults and ran and not any(e["injected_oom"] for e in ran):
        print(f"the injected faults ({faults}) never reached a client: nothing was tested", file=sys.stderr)
        return 1
    return 1 if any(broken(e) for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
