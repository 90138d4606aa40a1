"""One real tool round through each agent client (hermes-agent, Codex CLI, Claude Code, OpenCode, at
their pinned versions; clients/install.py): the served model calls the client's own shell tool,
the client runs it, sends the result back on its own wire format (chat `tool` message, Responses
`function_call_output`, Anthropic `tool_result`), and the model's final answer reaches the client.

The model is tiny_models.make_tool_round_target: it writes the client's call at the end of a
prompt and its answer once a `<tool_response>` is in the prompt, whatever the frame around it, so
what is tested is the protocol, not what a model learned (clients.run --heldout-tasks measures
that). A client is skipped only when it cannot be installed here (no npm, no registry).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

from clients import install, report  # noqa: E402
from clients.common import Endpoint, Task, run_client  # noqa: E402
from clients.proxy import RecordingProxy  # noqa: E402
from clients.run import make_client, parse_args  # noqa: E402
from clients.server import FlashtreeServer  # noqa: E402
from flashtree.runtime.engine import ASSETS  # noqa: E402
from tiny_models import make_tool_round_target  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-tool-round"
COMMAND = "echo flashtree-round > round.txt"
ANSWER = "Done: round.txt now holds flashtree-round."
TASK = Task("Create the file round.txt holding the text flashtree-round.", file="round.txt",
            content="flashtree-round", answer="round.txt now holds flashtree-round")
# each client's own shell tool, with the arguments its schema asks for; and the file-writing tools
# with a relative path, which the agent stage's training data relies on (synth_client_agent.py)
CALLS = [
    ("hermes", "terminal", {"command": COMMAND}),
    ("codex", "exec_command", {"cmd": COMMAND}),
    ("claude", "Bash", {"command": COMMAND, "description": "Write round.txt"}),
    ("opencode", "bash", {"command": COMMAND, "description": "Writes round.txt"}),
    ("hermes", "write_file", {"path": "round.txt", "content": "flashtree-round"}),
    ("claude", "Write", {"file_path": "round.txt", "content": "flashtree-round"}),
    ("opencode", "write", {"filePath": "round.txt", "content": "flashtree-round"}),
]


# the clients as `python -m clients.run` configures them with these flags
HARNESS = parse_args(["--hermes-toolsets", "file,terminal", "--claude-tools", "Bash,Read,Write,Edit,Glob,Grep",
                      "--task-timeout", "300"])


@pytest.mark.parametrize("name,tool,arguments", CALLS, ids=[f"{c}-{t}" for c, t, _ in CALLS])
def test_a_tool_call_is_run_by_the_client_and_its_result_answered(name: str, tool: str, arguments: dict,
                                                                   tmp_path: Path) -> None:
    client = make_client(name, HARNESS)
    try:
        client.executable()
    except install.InstallError as e:
        pytest.skip(f"{name} cannot be installed here: {e}")
    target = make_tool_round_target(tmp_path / "target", json.dumps({"name": tool, "arguments": arguments}),
                                    ANSWER, ASSETS / "target")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with FlashtreeServer(run_dir / "server.log", "--target", str(target), "--mode", "ar", api_key=KEY) as server, \
            RecordingProxy(server.url, run_dir / "transcript.jsonl") as proxy:
        proxy.label, proxy.task = name, 1
        [result] = run_client(client, Endpoint(proxy.url, server.model(), KEY), run_dir, [TASK])
        alive = server.alive
    records = report.load(run_dir / "transcript.jsonl")
    summary = report.summarize(records, name)
    assert alive and result.returncode == 0, (result.output, summary)
    assert result.problem is None, (result.problem, result.output)  # round.txt written, the answer printed
    assert summary["tool_calls"] >= 1 and summary["tool_results"] >= 1, summary
    assert not summary["errors"] and not summary["stream_errors"], summary
