"""The harness's reading of a transcript: tool calls the server parsed (in responses) and tool
results the client sent back (in later requests), on each of the three API surfaces, streamed and
not; and a task's check of what really happened (a file and its content, an answer's text).

The bodies are written the way the surfaces spell them (the SSE event names and fields that
flashtree's chat, Responses and Messages endpoints send); no client is needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

from clients import report  # noqa: E402
from clients import record_formats  # noqa: E402
from clients.common import Task  # noqa: E402


def sse(*events: dict, named: bool = False, done: bool = False) -> str:
    """A recorded stream body: `data:` lines (with `event:` lines for the typed surfaces)."""
    out = []
    for e in events:
        if named:
            out.append(f"event: {e['type']}")
        out.append("data: " + json.dumps(e))
        out.append("")
    if done:
        out += ["data: [DONE]", ""]
    return "\n".join(out)


def record(request: dict, response, client: str = "c", task: int = 1, status: int = 200) -> dict:
    return {"client": client, "task": task, "method": "POST", "path": "/v1/x", "status": status,
            "request": request, "response": response}


# chat completions ------------------------------------------------------------------------------

def chat_call_stream(*ids: str) -> str:
    chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for i, call_id in enumerate(ids):
        chunks.append({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": call_id, "type": "function", "function": {"name": "bash", "arguments": ""}}]}}]})
        chunks.append({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": "{\"command\": \"ls\"}"}}]}}]})
    chunks.append({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                    "finish_reason": "tool_calls"}]})
    return sse(*chunks, done=True)


def test_chat_stream_counts_each_call_once_not_each_delta():
    assert report.tool_calls(record({}, chat_call_stream("call_a", "call_b"))) == 2


def test_chat_response_counts_message_tool_calls():
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "write", "arguments": "{}"}}]}}]}
    assert report.tool_calls(record({}, body)) == 1


def test_chat_request_tool_messages_are_results():
    req = {"messages": [{"role": "user", "content": "list"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"}]}
    assert report.tool_result_ids(record(req, "")) == {"call_a"}
    assert report.tool_calls(record(req, "")) == 0  # a call repeated in a request is not a new call


# responses -------------------------------------------------------------------------------------

def test_responses_stream_counts_function_call_items():
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "shell", "arguments": "{}"}
    events = [{"type": "response.created", "response": {"object": "response", "output": []}},
              {"type": "response.output_item.added", "output_index": 0, "item": {**item, "arguments": ""}},
              {"type": "response.function_call_arguments.delta", "output_index": 0, "delta": "{}"},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed", "response": {"object": "response", "output": [item]}}]
    # the final response repeats the item inside an event: counted from output_item.done only
    assert report.tool_calls(record({}, sse(*events, named=True))) == 1


def test_responses_object_counts_function_call_output():
    body = {"object": "response", "output": [
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_b", "name": "apply_patch", "arguments": "{}"}]}
    assert report.tool_calls(record({}, body)) == 2


def test_responses_request_function_call_outputs_are_results():
    req = {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
                     {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{}"},
                     {"type": "function_call_output", "call_id": "call_a", "output": "42"}]}
    assert report.tool_result_ids(record(req, "")) == {"call_a"}


# anthropic messages ----------------------------------------------------------------------------

def test_anthropic_stream_counts_tool_use_blocks():
    events = [{"type": "message_start", "message": {"type": "message", "content": []}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_stop", "index": 0},
              {"type": "content_block_start", "index": 1, "content_block": {
                  "type": "tool_use", "id": "toolu_1", "name": "Write", "input": {}}},
              {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta",
                                                                    "partial_json": "{\"file_path\": \"a\"}"}},
              {"type": "content_block_stop", "index": 1},
              {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
              {"type": "message_stop"}]
    assert report.tool_calls(record({}, sse(*events, named=True))) == 1


def test_anthropic_message_counts_tool_use_blocks():
    body = {"type": "message", "role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "a"}}]}
    assert report.tool_calls(record({}, body)) == 2


def test_anthropic_request_tool_result_blocks_are_results():
    req = {"messages": [
        {"role": "user", "content": "make it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
                                     {"type": "text", "text": "<system-reminder>x</system-reminder>"}]}]}
    assert report.tool_result_ids(record(req, "")) == {"toolu_1"}


# totals over a conversation ----------------------------------------------------------------------

def test_summary_counts_a_result_once_across_the_requests_that_repeat_it():
    first = {"messages": [{"role": "user", "content": "go"}]}
    second = {"messages": first["messages"] + [
        {"role": "assistant", "tool_calls": [{"id": "call_a", "type": "function",
                                              "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "out"}]}
    third = {"messages": second["messages"] + [{"role": "assistant", "content": "done"},
                                               {"role": "user", "content": "again"}]}
    records = [record(first, chat_call_stream("call_a")), record(second, sse(done=True)),
               record(third, sse(done=True), task=2), record(first, chat_call_stream("call_z"), client="other")]
    total = report.summarize(records, "c")
    assert (total["tool_calls"], total["tool_results"], total["requests"]) == (1, 1, 3)
    assert report.summarize(records, "c", task=2)["tool_calls"] == 0
    assert report.summarize(records, "c", task=1)["tool_results"] == 1


def test_summary_reports_http_and_stream_errors():
    bad = record({}, {"error": {"message": "boom"}}, status=503)
    streamed = record({}, sse({"type": "message_start", "message": {}},
                              {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}, named=True))
    summary = report.summarize([bad, streamed], "c")
    assert len(summary["errors"]) == 1 and "503" in summary["errors"][0]
    assert len(summary["stream_errors"]) == 1 and "overloaded_error" in summary["stream_errors"][0]


def test_only_the_servers_out_of_memory_answer_is_an_injected_fault():
    from clients.run import is_injected_oom

    oom = record({}, {"error": {"message": "out of memory", "type": "server_error", "code": "out_of_memory"}},
                 status=503)
    full = record({}, {"error": {"message": "queue full", "code": "queue_full"}}, status=503)
    crash = record({}, {"error": {"message": "out_of_memory"}}, status=500)
    anthropic_oom = record({}, {"type": "error", "error": {"type": "overloaded_error",
                                                           "message": "out of memory during prefill"}}, status=503)
    errors = report.summarize([oom, full, crash, anthropic_oom], "c")["errors"]
    assert [is_injected_oom(e) for e in errors] == [True, False, False, True]


# task checks -------------------------------------------------------------------------------------

def test_a_file_task_needs_the_file_with_its_content(tmp_path: Path):
    task = Task("create it", file="hello.txt", content="hello from x")
    assert "not created" in task.check(tmp_path, "Done, I created hello.txt")
    (tmp_path / "hello.txt").write_text("hello from y\n")
    assert "not 'hello from x'" in task.check(tmp_path, "")
    (tmp_path / "hello.txt").write_text("hello from x\n")
    assert task.check(tmp_path, "") is None


def test_an_answer_task_needs_the_text_in_the_output(tmp_path: Path):
    task = Task("run it", answer="flashtree-42")
    assert task.check(tmp_path, "It printed flashtree-41.") is not None
    assert task.check(tmp_path, "The command printed: FLASHTREE-42") is None


# recorded formats ---------------------------------------------------------------------------------

ASSETS = Path(__file__).resolve().parents[1] / "flashtree" / "train" / "assets" / "client_tools"


@pytest.mark.parametrize("client", ["claude", "codex", "hermes", "opencode"])
def test_an_asset_is_regenerated_from_the_transcript_it_came_from(tmp_path: Path, client: str):
    """Put a task and a run directory back into a committed asset's request, record it as the
    proxy would, and extract it again: the same asset (marks where the task and directories were)."""
    asset = json.loads((ASSETS / f"{client}.json").read_text())
    task = "Count the files in this directory."
    work, home = tmp_path / client / "work", tmp_path / client / "home"
    filled = json.loads(json.dumps(asset["request"]).replace(record_formats.TASK_MARK, task)
                        .replace(record_formats.CWD_MARK, str(work)).replace(record_formats.HOME_MARK, str(home)))
    title = {"client": client, "method": "POST", "path": asset["path"], "status": 200,
             "request": {"messages": [{"role": "user", "content": "a title"}]}}  # OpenCode's: no tools
    agent = {**title, "request": {**filled, "model": "m", "stream": True}}
    found = record_formats.agent_request([title, agent], client)
    assert found is agent
    assert record_formats.extract(found, client, task, tmp_path) == asset


def test_extracting_a_request_without_the_task_is_an_error(tmp_path: Path):
    rec = {"client": "claude", "method": "POST", "path": "/v1/messages", "status": 200,
           "request": {"system": "s", "messages": [{"role": "user", "content": "other"}], "tools": [{}]}}
    with pytest.raises(ValueError, match="not in its recorded request"):
        record_formats.extract(rec, "claude", "the task", tmp_path)


def test_requests_that_ran_beside_another_are_counted_with_their_answers():
    def timed(t: float, seconds: float, status: int = 200, method: str = "POST") -> dict:
        return {**record({}, "", status=status), "t": t, "seconds": seconds, "method": method}
    main, title, later, busy, probe = (timed(0.0, 10.0), timed(2.0, 1.0), timed(10.0, 5.0), timed(12.0, 1.0, 429),
                                       timed(1.0, 30.0, method="GET"))
    records = [later, main, busy, title, probe]
    assert report.side_by_side(records) == [main, title, later, busy]  # the GET is no request of the loop's
    summary = report.summarize(records, "c")
    assert (summary["side_by_side"], summary["side_by_side_ok"]) == (4, 3)
    assert report.summarize([main, later], "c")["side_by_side"] == 0  # one after the other: none beside
