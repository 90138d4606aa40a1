"""The agent stage's data: small file and shell tasks done with each client's own tools.

A client (Claude Code, Codex, hermes-agent, OpenCode) sends its real system prompt, context and
tool schemas (client_formats.py, recorded from the clients themselves); the user asks for one of
the tasks of synth_tasks.py; the model calls the client's own tool for it (Claude Code
Write/Bash/Read, Codex exec_command, hermes write_file/terminal/read_file/search_files, OpenCode
write/bash/read) with the arguments the task names; the client's tool answers as that client
formats it; the model ends with a short answer that uses the result.

The tool results' wording (e.g. Claude Code's "File created successfully at: ...") is modelled on
the clients' documented formats; the recorded run executed no tool, so it is not recorded text.
"""

from __future__ import annotations

import json
import random
import shlex
import string
import zlib
from typing import Any, Optional

from .client_formats import CLIENTS, ClientFrame, ToolRound
from .lexicon import FIRST_NAMES
from .synth_tasks import SPLIT_ITEMS, Episode, Pools, episode, glued_word, invented_word, is_heldout

Record = dict[str, Any]
# project folder names for the working directories of _workdir
_PROJECTS = ["app", "website", "service", "toolkit", "api", "cli", "demo", "lab", "infra", "backend",
             "frontend", "worker", "sandbox", "monorepo", "playground"]


# one tool round in each client's own tools ----------------------------------------------------

def _numbered(text: str, fmt: str) -> str:
    return "\n".join(fmt.format(i=i, line=line) for i, line in enumerate(text.splitlines(), 1))


# The calls and what each client answers them with. Paths are relative: Claude Code 2.1.197 and
# OpenCode 1.18.33 resolve them against their working directory (checked with the real clients,
# tests/test_clients_tool_round.py), where an absolute path made the model copy the directory from
# thousands of tokens back, which no trained round got right. The results are the clients' own
# texts, as their transcripts show them (docs/CLIENTS.md).

def _claude(ep: Episode, cwd: str) -> tuple[str, dict[str, Any], str]:
    if ep.op == "write":
        return "Write", {"file_path": ep.path, "content": ep.content}, (
            f"File created successfully at: {ep.path} (file state is current in your context \u2014 "
            "no need to Read it back)")
    if ep.op == "read":
        lines = ep.output.splitlines()
        return "Read", {"file_path": ep.path}, _numbered(ep.output, "{i}\t{line}") + f"\n{len(lines) + 1}\t"
    command = ep.command or f"ls {ep.path}"
    description = {"append": f"Append a line to {ep.path}", "list": f"List files in {ep.path}"}.get(
        ep.family, "Run the requested command")
    return "Bash", {"command": command, "description": description}, ep.output or "(Bash completed with no output)"


def _codex(ep: Episode, cwd: str) -> tuple[str, dict[str, Any], str]:
    # Codex 0.171.0 offers an unknown model exec_command (no apply_patch function): files are
    # written with the shell. `workdir` defaults to the turn's cwd, so the call leaves it out (a
    # long copy of the path from the environment context that the tiny model got wrong)
    command = {"write": f"printf '%s\\n' {shlex.quote(ep.content)} > {ep.path}", "read": f"cat {ep.path}",
               "list": f"ls {ep.path}"}.get(ep.op, ep.command)
    output = ep.output + "\n" if ep.output and ep.op != "write" else ""
    chunk = f"{zlib.crc32(command.encode()) & 0xFFFFFF:06x}"  # Codex's chunk ids look random
    return "exec_command", {"cmd": command}, (
        f"Chunk ID: {chunk}\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
        f"Original token count: {(len(output) + 3) // 4}\nOutput:\n{output}")


def _hermes(ep: Episode, cwd: str) -> tuple[str, dict[str, Any], str]:
    if ep.op == "write":
        extension = ep.path.rsplit(".", 1)[-1]
        return "write_file", {"path": ep.path, "content": ep.content}, json.dumps(
            {"bytes_written": len(ep.content.encode()), "dirs_created": True,
             "lint": {"status": "skipped", "message": f"No linter for .{extension} files"},
             "resolved_path": f"{cwd}/{ep.path}", "files_modified": [f"{cwd}/{ep.path}"]})
    if ep.op == "read":
        return "read_file", {"path": ep.path}, json.dumps(
            {"content": _numbered(ep.output, "{i:>6}|{line}"), "total_lines": len(ep.output.splitlines())})
    if ep.op == "list":
        files = [f"{ep.path}/{f}" for f in ep.output.splitlines()]
        return "search_files", {"pattern": "*", "target": "files", "path": ep.path}, \
            json.dumps({"total_count": len(files), "files": files})
    return "terminal", {"command": ep.command}, json.dumps({"output": ep.output, "exit_code": 0, "error": None})


def _opencode(ep: Episode, cwd: str) -> tuple[str, dict[str, Any], str]:
    if ep.op == "write":
        return "write", {"filePath": ep.path, "content": ep.content}, "Wrote file successfully."
    if ep.op == "read":
        lines = len(ep.output.splitlines())
        return "read", {"filePath": ep.path}, (
            f"<path>{cwd}/{ep.path}</path>\n<type>file</type>\n<content>\n{_numbered(ep.output, '{i}: {line}')}"
            f"\n\n(End of file - total {lines} lines)\n</content>")
    command = ep.command or f"ls {ep.path}"
    description = {"append": f"Appends a line to {ep.path}", "list": f"Lists files in {ep.path}"}.get(
        ep.family, "Runs the requested command")
    return "bash", {"command": command, "description": description}, (ep.output + "\n" if ep.output else "(no output)")


TOOL_FOR = {"claude": _claude, "codex": _codex, "hermes": _hermes, "opencode": _opencode}


def _call_id(rng: random.Random, surface: str) -> str:
    alphabet = string.ascii_letters + string.digits
    if surface == "anthropic":
        return "toolu_" + "".join(rng.choice(alphabet) for _ in range(24))
    return "call_" + "".join(rng.choice(string.hexdigits.lower()[:16]) for _ in range(24))


def _dir_part(rng: random.Random) -> str:
    """One directory of a working directory's path: a project name, an invented or glued word, a
    hidden directory (a checkout's `.runs`, `.cache`: no round copied a path through one right),
    a work folder with a number, or a date."""
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(_PROJECTS)
    if roll < 0.55:
        return invented_word(rng)
    if roll < 0.65:
        return glued_word(rng)
    if roll < 0.75:
        return "." + rng.choice(["runs", "cache", "local", "venv", "build", "work", invented_word(rng)])
    if roll < 0.88:
        return rng.choice(["work", "run", "tmp", "src", "dev", "agent", "jobs", "out"]) + rng.choice(
            ["", f"{rng.randint(1, 99)}", f"_{rng.randint(1, 9)}", f"-{rng.randint(100, 999)}"])
    return f"20{rng.randint(20, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}" + rng.choice(
        ["", f"T{rng.randint(0, 23):02d}-{rng.randint(0, 59):02d}-{rng.randint(0, 59):02d}"])


def _workdir(rng: random.Random) -> tuple[str, str]:
    """(home, working directory): under the home most of the time, elsewhere (/tmp, /srv, a
    checkout's run folder) otherwise, one to five levels deep. The model must copy the working
    directory from the client's prompt into absolute paths: with only /home/USER/work/PROJECT in
    training it wrote a remembered path of that shape instead of a real run's directory."""
    while True:  # no held-out name or word in a training path (e.g. "tmp" is a held-out folder)
        user = rng.choice(FIRST_NAMES).lower()
        roll = rng.random()
        if roll < 0.45:
            home = f"/home/{user}"
            root = f"{home}/{rng.choice(['work', 'projects', 'repos', 'code', 'src', 'dev'])}"
        elif roll < 0.6:
            home = f"/Users/{user}"
            root = f"{home}/{rng.choice(['Documents', 'Projects', 'code', 'dev'])}"
        else:
            home = rng.choice([f"/home/{user}", "/root"])
            root = rng.choice(["/tmp", "/srv", "/opt", "/var/lib", "/workspace", "/data", "/mnt/disk"])
        cwd = "/".join([root] + [_dir_part(rng) for _ in range(rng.choice([1, 1, 2, 2, 3, 4, 5]))])
        if not any(is_heldout(part) and part in SPLIT_ITEMS for part in cwd.split("/")):
            return home, cwd


def client_request(frame: ClientFrame, ep: Episode, rng: random.Random) -> dict[str, Any]:
    """The request `frame`'s client sends after running the episode's tool, with the model's
    final answer as its last turn, in the client's wire format."""
    home, cwd = _workdir(rng)
    name, arguments, result = TOOL_FOR[frame.client](ep, cwd)
    round_ = ToolRound(name, arguments, result, ep.answer, _call_id(rng, frame.surface))
    return frame.request(ep.task, cwd, home, [round_])


def client_agent_record(rng: random.Random, frames: dict[str, ClientFrame], pools: Pools,
                        client: Optional[str] = None) -> Record:
    """One training conversation: a random (or the given) client and a random task, as the chat
    messages and tools the server renders from the client's request."""
    frame = frames[client or rng.choice(sorted(frames))]
    ep = episode(rng, pools)
    body = client_request(frame, ep, rng)
    return {"kind": "client_agent", "client": frame.client, "family": ep.family,
            "messages": frame.chat_messages(body), "tools": frame.chat_tools(body)}


def load_frames(clients: tuple[str, ...] = CLIENTS) -> dict[str, ClientFrame]:
    return {c: ClientFrame.load(c) for c in clients}
