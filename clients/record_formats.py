"""`python -m clients.record_formats RUN_DIR`: each client's real request frame, from a recorded run.

The agent stage of training (flashtree/train/synth_client_agent.py) writes conversations in the
very requests the clients send: their system prompts, the context messages they put around a
task, and their tool schemas, in their own wire format. Those are read here from a run's
transcript (clients.run records every request verbatim) and written, one file per client, to
flashtree/train/assets/client_tools/CLIENT.json:

    {"client", "version", "surface": "chat" | "responses" | "anthropic", "path",
     "request": the client's first agent request (the one that offers tools), reduced to what
                reaches the model: chat {messages, tools}, responses {instructions, input, tools},
                anthropic {system, messages, tools}}

In the request the task's text is replaced by TASK_MARK and the run's own directories by
CWD_MARK / HOME_MARK, so that a generator can put any task in any directory. Nothing else is
dropped or shortened. Rerun after moving a client's pinned version (clients/install.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from . import report
from .install import NPM_COMMANDS, PIP_PACKAGE, VERSIONS

ASSETS = Path(__file__).resolve().parents[1] / "flashtree" / "train" / "assets" / "client_tools"
TASK_MARK, CWD_MARK, HOME_MARK = "{{TASK}}", "{{CWD}}", "{{HOME}}"
SURFACES = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "anthropic"}
KEEP = {"chat": ("messages", "tools"), "responses": ("instructions", "input", "tools"),
        "anthropic": ("system", "messages", "tools")}
PACKAGES = {"hermes": PIP_PACKAGE, **NPM_COMMANDS}


def _replace(value: Any, old: str, new: str) -> Any:
    """`value` (any JSON) with `old` replaced by `new` in every string."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    return value


def agent_request(records: list[dict[str, Any]], client: str) -> Optional[dict[str, Any]]:
    """The client's first generation request that offers tools (OpenCode's first request, which
    asks for a title, offers none)."""
    for r in records:
        if (r.get("client") == client and r.get("method") == "POST" and r.get("path") in SURFACES
                and isinstance(r.get("request"), dict) and r["request"].get("tools")):
            return r
    return None


def extract(record: dict[str, Any], client: str, task: str, run_dir: Path) -> dict[str, Any]:
    """The asset of one recorded request: `task` (the prompt the harness gave) and the run's
    directories become marks. Raises ValueError when the task's text is not in the request."""
    surface = SURFACES[record["path"]]
    body = {k: record["request"][k] for k in KEEP[surface] if k in record["request"]}
    text = json.dumps(body, ensure_ascii=False)
    if json.dumps(task, ensure_ascii=False)[1:-1] not in text:
        raise ValueError(f"{client}: the task {task!r} is not in its recorded request")
    body = _replace(body, task, TASK_MARK)
    base = run_dir.resolve() / client
    body = _replace(_replace(body, str(base / "work"), CWD_MARK), str(base / "home"), HOME_MARK)
    return {"client": client, "version": VERSIONS[PACKAGES[client]], "surface": surface,
            "path": record["path"], "request": body}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.record_formats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a clients.run directory (holding transcript.jsonl)")
    p.add_argument("--out", type=Path, default=ASSETS)
    args = p.parse_args(argv)
    records = report.load(args.run_dir / "transcript.jsonl")
    if not records:
        print(f"record_formats: no transcript in {args.run_dir}", file=sys.stderr)
        return 1
    entries = json.loads((args.run_dir / "report.json").read_text())
    tasks = {e["client"]: e["tasks"] for e in entries if "tasks" in e}
    args.out.mkdir(parents=True, exist_ok=True)
    for client, client_tasks in tasks.items():
        record = agent_request(records, client)
        if record is None:
            print(f"{client}: no request with tools recorded", file=sys.stderr)
            continue
        task = client_tasks[record.get("task", 1) - 1]["task"]
        try:
            asset = extract(record, client, task, args.run_dir)
        except ValueError as e:
            print(f"record_formats: {e}", file=sys.stderr)
            return 1
        path = args.out / f"{client}.json"
        path.write_text(json.dumps(asset, ensure_ascii=False, indent=1) + "\n")
        print(f"{client:9s} {asset['surface']:9s} {len(asset['request']['tools']):3d} tools "
              f"{path.stat().st_size:8d} bytes  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
