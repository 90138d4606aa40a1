"""The agent stage's quick check (`python -m clients.first_calls`): a generated first turn is parsed
the way the server parses it, and judged against the training data's call for the task, in every
client's frame and tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

from clients.first_calls import CHECK_CWD, evaluate_first_calls, expected_call, first_call, judge  # noqa: E402
from flashtree.train.client_formats import CLIENTS  # noqa: E402
from flashtree.train.synth_client_agent import TOOL_FOR, load_frames  # noqa: E402
from flashtree.train.synth_tasks import heldout_episodes  # noqa: E402


def call_text(name: str, arguments: dict) -> str:
    return "<think>\n\n</think>\n\n<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("client", CLIENTS)
def test_the_training_call_passes_and_a_wrong_argument_is_named(client: str) -> None:
    frame = load_frames((client,))[client]
    cwd = CHECK_CWD.format(client=client)
    for ep in heldout_episodes(3):  # create, append, run
        tools = frame.chat_tools(frame.request(ep.task, cwd, "/home/x", []))
        name, arguments, _ = TOOL_FOR[client](ep, cwd)
        want = expected_call(client, ep, cwd)
        assert judge(first_call(call_text(name, arguments), tools), want) is None
        # a tool's free-text description may say anything
        if "description" in arguments:
            assert judge(first_call(call_text(name, {**arguments, "description": "x"}), tools), want) is None
        key = next(iter(want[1]))
        problem = judge(first_call(call_text(name, {**arguments, key: "garbled"}), tools), want)
        assert problem is not None and problem.startswith(f"{key}='garbled'")
        other = next(t["function"]["name"] for t in tools if t["function"]["name"] != name)
        assert judge(first_call(call_text(other, arguments), tools), want) == f"called {other}, wanted {name}"
        # a call of a tool the client does not offer is text to the server, so it is no call
        assert judge(first_call(call_text("get_weather", {"city": "Oslo"}), tools), want) is not None
        assert judge(first_call("I created the file.", tools), want) == "no call of the client's tools"


@pytest.mark.slow  # a 7K-token prompt through the embedded model on the CPU
def test_the_embedded_target_is_judged_per_task() -> None:
    report = evaluate_first_calls(None, n_tasks=2, clients=("codex",), device="cpu")
    rows = report["clients"]["codex"]["tasks"]
    assert [r["family"] for r in rows] == ["create", "append"] and report["tasks"] == 2
    assert report["clients"]["codex"]["exact_calls"] == sum(r["ok"] for r in rows)
    assert all(r["ok"] == (r["problem"] is None) and r["output"] for r in rows)
