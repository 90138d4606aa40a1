"""What the server makes of known output, through the real SDKs on a live server whose target
writes a fixed script (tiny_models.make_scripted_target): after any prompt that ends in a newline
(every chat prompt of the tiny template) it writes `Hmm.`, `</think>`, `Paris.`, then the same
tool call over and over, `<tool_call>{"name": "lookup", ...}</tool_call>`, until max_tokens.

- With thinking off (the prompt holds the closed, empty think block) a `</think>` the model
  writes anyway is never part of `content`.
- Tokens the engine made after a matched stop string are not counted as completion tokens
  (row 9): the count ends with the token that completed the stop string.
- `parallel_tool_calls: false` (Responses too, and Anthropic's `disable_parallel_tool_use`)
  returns one tool call, where the same request otherwise returns several (row 7).
- max_tokens that cuts a call drops it, and the answer ends as cut even after calls it made.
"""

import json

import anthropic
import pytest

from serve_harness import Server
from tiny_models import make_scripted_target

CALL = '{"name": "lookup", "arguments": {"q": "x\ty"}}'  # a raw tab inside the string, as models write
SCRIPT = [("\n", "Hmm."), ("Hmm.", "</think>"), ("</think>", "Paris."), ("Paris.", "<tool_call>"),
          ("<tool_call>", CALL), (CALL, "</tool_call>"), ("</tool_call>", "<tool_call>")]
ANSWER = "Hmm.Paris."  # the text before the calls, `</think>` dropped
USER = [{"role": "user", "content": "Where is the Louvre?"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look something up", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
CLAUDE_TOOLS = [{"name": "lookup", "description": "look something up",
                 "input_schema": TOOLS[0]["function"]["parameters"]}]
CALL_TOKENS = 3  # <tool_call>, the call, </tool_call>


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = make_scripted_target(tmp_path_factory.mktemp("scripted"), SCRIPT, ["Hmm.", "Paris.", CALL])
    srv = Server(None, None, tmp_path_factory.mktemp("log") / "server.log", "--target", str(target),
                 "--mode", "ar")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(model="x", messages=USER, temperature=0, **kw)


def test_with_thinking_off_a_stray_close_tag_never_reaches_content(client, claude):
    message = chat(client, max_tokens=3).choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None)) == (ANSWER, None)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(client, max_tokens=3, stream=True)
                       if chunk.choices)
    assert streamed == ANSWER
    assert client.responses.create(model="x", input=USER, max_output_tokens=3).output_text == ANSWER
    reply = claude.messages.create(model="x", messages=USER, max_tokens=3)
    assert [(block.type, block.text) for block in reply.content] == [("text", ANSWER)]


def test_tokens_after_a_matched_stop_string_are_not_counted(client, claude):
    stopped = chat(client, max_tokens=60, stop=["Par"])  # completed by the third token, `Paris.`
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 3
    chunks = list(chat(client, max_tokens=60, stop=["Hmm"], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].usage.completion_tokens == 1
    reply = claude.messages.create(model="x", messages=USER, max_tokens=60, stop_sequences=["Hmm"])
    assert (reply.stop_reason, reply.stop_sequence, reply.usage.output_tokens) == ("stop_sequence", "Hmm", 1)


def test_parallel_tool_calls_false_returns_one_call(client, claude):
    budget = 3 + 4 * CALL_TOKENS  # room for four calls
    several = chat(client, max_tokens=budget, tools=TOOLS).choices[0]
    assert len(several.message.tool_calls) == 4
    one = chat(client, max_tokens=budget, tools=TOOLS, parallel_tool_calls=False)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("lookup", '{"q": "x\\ty"}')]
    assert one.usage.completion_tokens == 3 + CALL_TOKENS  # the engine stopped after the call
    streamed = [call for chunk in chat(client, max_tokens=budget, tools=TOOLS, parallel_tool_calls=False, stream=True)
                if chunk.choices for call in chunk.choices[0].delta.tool_calls or [] if call.id]
    assert len(streamed) == 1

    response = client.responses.create(model="x", input=USER, tools=RESPONSES_TOOLS, max_output_tokens=budget,
                                       parallel_tool_calls=False)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.parallel_tool_calls is False

    kinds = [block.type for block in claude.messages.create(
        model="x", messages=USER, max_tokens=budget, tools=CLAUDE_TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True}).content]
    assert kinds == ["text", "tool_use"]
    assert [block.type for block in claude.messages.create(
        model="x", messages=USER, max_tokens=budget, tools=CLAUDE_TOOLS).content] == ["text"] + ["tool_use"] * 4


def test_a_raw_control_character_in_a_call_is_still_a_call(client, claude):
    """The embedded model once wrote a raw tab inside a Claude Code `Bash` command; strict
    JSON refused the block and the client got the call as text. Each surface now gets the call,
    with the tab escaped in the JSON it sends (chat / Responses) or as the character (Anthropic)."""
    budget = 3 + CALL_TOKENS
    calls = chat(client, max_tokens=budget, tools=TOOLS).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"q": "x\ty"}]
    items = client.responses.create(model="x", input=USER, tools=RESPONSES_TOOLS, max_output_tokens=budget).output
    assert [json.loads(i.arguments) for i in items if i.type == "function_call"] == [{"q": "x\ty"}]
    blocks = claude.messages.create(model="x", messages=USER, max_tokens=budget, tools=CLAUDE_TOOLS).content
    assert [b.input for b in blocks if b.type == "tool_use"] == [{"q": "x\ty"}]


def test_max_tokens_inside_a_second_call_keeps_the_first_and_says_length(client, claude):
    """Cut right after the opening tag of its second call, the answer has its text and first call
    and ends as cut (length), not as a finished call (tool_calls) with `<tool_call>` as text."""
    budget = 3 + CALL_TOKENS + 1
    choice = chat(client, max_tokens=budget, tools=TOOLS).choices[0]
    assert (choice.finish_reason, choice.message.content, len(choice.message.tool_calls)) == ("length", ANSWER, 1)
    chunks = [c.choices[0] for c in chat(client, max_tokens=budget, tools=TOOLS, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ANSWER
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    reply = claude.messages.create(model="x", messages=USER, max_tokens=budget, tools=CLAUDE_TOOLS)
    assert (reply.stop_reason, [block.type for block in reply.content]) == ("max_tokens", ["text", "tool_use"])


def test_no_tracebacks_in_the_server_log(server):
    assert "Traceback" not in server.log()
