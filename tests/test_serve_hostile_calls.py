"""Tool calls a model writes outside json_text's bounds, end to end: a live server whose target
writes a fixed script (tiny_models.make_scripted_target) answers 200 with valid JSON on every
surface (chat, Responses, Anthropic), streamed or not, and each such block reaches the client as
the text the model wrote, while the well-formed call after them is still a call.

The script writes, after the chat prompt's final newline, one block per hostile payload (an
integer past int()'s digit limit, an escaped lone surrogate, NaN, a float past float's range,
arrays nested past MAX_DEPTH), each after a label, then a good call. `<tool_call>` and
`</tool_call>` are special tokens, and the bigram script needs every token to be a different
one, so the text is cut into tokens just before each tag's closing `>`: `surrogate: <tool_call`,
`>{...}</tool_call`, `>` and so on.
"""

import json
import re

import httpx
import pytest

from serve_harness import Server
from tiny_models import make_scripted_target

HOSTILE = {
    "huge int": '{"name": "lookup", "arguments": {"q": ' + "9" * 5000 + "}}",
    "surrogate": '{"name": "lookup", "arguments": {"q": "a\\ud800b"}}',
    "nan": '{"name": "lookup", "arguments": {"q": NaN}}',
    "overflow": '{"name": "lookup", "arguments": {"q": 1e999}}',
    "deep": '{"name": "lookup", "arguments": {"q": ' + "[" * 200 + "]" * 200 + "}}",
}
GOOD = '{"name": "lookup", "arguments": {"q": "ok"}}'
SAID = "".join(f"{label}: <tool_call>{block}</tool_call>\n" for label, block in HOSTILE.items()) + \
    f"<tool_call>{GOOD}</tool_call>"
TOKENS = re.split(r"(?<=tool_call)(?=>)", SAID)  # the last one, `>`, is in the vocabulary already
SCRIPT = list(zip(["\n"] + TOKENS[:-1], TOKENS))
TEXT = SAID[:SAID.rindex("<tool_call>")].rstrip()  # the hostile blocks as text; the newline before the call goes
BUDGET = len(TOKENS) + 4
USER = [{"role": "user", "content": "Look it up."}]
PARAMETERS = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
BODIES = {
    "/v1/chat/completions": {"model": "x", "messages": USER, "max_tokens": BUDGET, "tools": [
        {"type": "function", "function": {"name": "lookup", "parameters": PARAMETERS}}]},
    "/v1/responses": {"model": "x", "input": USER, "max_output_tokens": BUDGET, "tools": [
        {"type": "function", "name": "lookup", "parameters": PARAMETERS}]},
    "/v1/messages": {"model": "x", "messages": USER, "max_tokens": BUDGET, "tools": [
        {"name": "lookup", "input_schema": PARAMETERS}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = make_scripted_target(tmp_path_factory.mktemp("scripted"), SCRIPT, TOKENS[:-1])
    srv = Server(None, None, tmp_path_factory.mktemp("log") / "server.log", "--target", str(target),
                 "--mode", "ar")
    yield srv
    srv.stop()


def strict_json(data: bytes):
    """`data` as JSON the way a strict client reads it: UTF-8, and no NaN or Infinity."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def answer(server, path: str) -> dict:
    response = server.post(path, json=BODIES[path])
    assert response.status_code == 200, response.text
    return strict_json(response.content)


def events(server, path: str) -> list[dict]:
    """The stream's `data:` payloads, each read as strict JSON."""
    with httpx.stream("POST", server.url + path, json={**BODIES[path], "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        body = response.read()
    lines = body.decode("utf-8").splitlines()
    return [strict_json(line[6:].encode()) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def chat_result(server, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    if not stream:
        message = answer(server, "/v1/chat/completions")["choices"][0]["message"]
        return message["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text, calls = "", []
    for chunk in events(server, "/v1/chat/completions"):
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                if call.get("id"):
                    calls.append([call["function"]["name"], ""])
                calls[-1][1] += call["function"].get("arguments") or ""
    return text, [tuple(call) for call in calls]


def responses_result(server, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    if stream:
        done = [e["response"] for e in events(server, "/v1/responses") if e.get("type") == "response.completed"]
        assert len(done) == 1
        output = done[0]["output"]
    else:
        output = answer(server, "/v1/responses")["output"]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return text, [(item["name"], item["arguments"]) for item in output if item["type"] == "function_call"]


def anthropic_result(server, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    if not stream:
        content = answer(server, "/v1/messages")["content"]
        return ("".join(b["text"] for b in content if b["type"] == "text"),
                [(b["name"], json.dumps(b["input"])) for b in content if b["type"] == "tool_use"])
    text, calls = "", []
    for event in events(server, "/v1/messages"):
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            calls.append([event["content_block"]["name"], ""])
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            text += delta.get("text", "")
            if delta["type"] == "input_json_delta":
                calls[-1][1] += delta["partial_json"]
    return text, [tuple(call) for call in calls]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("result", [chat_result, responses_result, anthropic_result],
                         ids=["chat", "responses", "anthropic"])
def test_calls_outside_the_bounds_are_text_and_the_answer_is_valid_json(server, result, stream):
    text, calls = result(server, stream)
    assert text == TEXT
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("lookup", {"q": "ok"})]


def test_no_tracebacks_in_the_server_log(server):
    assert "Traceback" not in server.log()
