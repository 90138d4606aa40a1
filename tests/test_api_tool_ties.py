"""What ties tools, calls and results together, checked on every API surface of a live server:
each way of breaking it is a 400 naming the field at fault (and the connection goes on serving),
never a 200 that leaves it to chance which tool a call runs or which call a result answers.

- function tool names are unique, a Responses function tool has a name, a function's schema is
  for an object;
- the calls of one assistant turn have distinct ids;
- a result (a chat `tool` message, a Responses `function_call_output`, an Anthropic
  `tool_result` block) answers a call an earlier assistant turn made, and its 400 names the id
  it has, cut as every echoed value is (errors.quoted).
"""

import pytest

from flashtree.serve.errors import quoted
import test_api_surfaces as surfaces
from test_api_surfaces import assert_refused_naming, post

server, connection = surfaces.server, surfaces.connection  # its fixtures: a server of this module's own


def function(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


HI = {"role": "user", "content": "hi"}
NOPE = "nope-" + "x" * 300  # a result's id that no call has: echoed cut as errors.quoted cuts it
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
# a result that answers no earlier call: the real APIs answer 400, flashtree took it (and the
# model read the outcome of a call it never made)
UNANSWERED = [
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [
        HI, {"role": "assistant", "tool_calls": [call("c1")]},
        {"role": "tool", "tool_call_id": NOPE, "content": "ok"}]},
        "messages.2.tool_call_id", id="chat tool message answering no call"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [
        HI, {"role": "tool", "tool_call_id": NOPE, "content": "ok"},
        {"role": "assistant", "tool_calls": [call(NOPE)]}]},
        "messages.1.tool_call_id", id="chat tool message before its call"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": [
        HI, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": NOPE, "output": "ok"}]},
        "input.2.call_id", id="responses output answering no call"),
    pytest.param("/v1/messages", {"max_tokens": 1, "messages": [HI, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
        {"type": "tool_result", "tool_use_id": NOPE, "content": "ok"}]}]},
        "messages.2.content.1.tool_use_id", id="anthropic tool_result answering no tool_use"),
    pytest.param("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": NOPE, "content": "ok"}]}]},
        "messages.0.content.0.tool_use_id", id="anthropic count_tokens tool_result first"),
]
# what ties tools, calls and results together, broken: each was a 200 (the last tool of a name
# declared twice won, a function tool without a name was dropped, a result answered no call or two)
BROKEN_TIES = [
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [HI], "tools": [
        function("f"), function("g"), function("f")]}, "tools.2.function.name", id="chat tool name twice"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [
        HI, {"role": "assistant", "tool_calls": [call("c1"), call("c1")]}, {"role": "tool", "tool_call_id": "c1",
                                                                          "content": "ok"}]},
        "messages.1.tool_calls.1.id", id="chat call id twice in a turn"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [
        HI, {"role": "assistant", "tool_calls": [call("c1")]}, {"role": "tool", "content": "ok"}]},
        "messages.2.tool_call_id", id="chat tool message without its call's id"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": "hi", "tools": [
        {"type": "function", "name": "f"}, {"type": "web_search"}, {"type": "function", "name": "f"}]},
        "tools.2.name", id="responses tool name twice"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": "hi", "tools": [{"type": "function"}],
                                   "tool_choice": "required"}, "tools.0.name", id="responses function tool without name"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": "hi", "tools": [
        {"type": "function", "name": "f" * 129}]}, "tools.0.name", id="responses function tool name too long"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": [
        HI, *[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}] * 2,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]},
        "input.2.call_id", id="responses call id twice"),
    pytest.param("/v1/messages", {"max_tokens": 1, "messages": [
        HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}] * 2},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
        "messages.1.content.1.id", id="anthropic tool_use id twice"),
    *UNANSWERED,
]


@pytest.mark.parametrize("path,body,field", BROKEN_TIES)
def test_tools_calls_and_results_that_do_not_tie_up_are_a_400_naming_the_field(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)


@pytest.mark.parametrize("path,body,field", UNANSWERED)
def test_a_result_answering_no_call_names_the_id_it_has(connection, path, body, field):
    status, error, _ = post(connection, path, body)
    assert status == 400 and quoted(NOPE) in error["error"]["message"], error


# a client's note between a call and its result: the real APIs want the result in the turn just
# after the call; an earlier call is enough here (api_common.CallLedger)
NOTE = {"role": "user", "content": "note"}
NOTE_BETWEEN = [
    ("/v1/chat/completions", {"max_tokens": 1, "messages": [
        HI, {"role": "assistant", "tool_calls": [call("c1")]}, NOTE,
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    ("/v1/responses", {"max_output_tokens": 1, "input": [
        HI, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}, NOTE,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    ("/v1/messages", {"max_tokens": 1, "messages": [HI, USE, NOTE, {"role": "assistant", "content": "ok"}, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
]


@pytest.mark.parametrize("path,body", NOTE_BETWEEN, ids=[path for path, _ in NOTE_BETWEEN])
def test_a_result_may_answer_a_call_of_any_earlier_turn(connection, path, body):
    status, answer, _ = post(connection, path, body)
    assert status == 200, answer


# a function's arguments are a JSON object: a schema giving its top level another type was taken,
# and a strict tool's grammar then made calls whose arguments were a bare string
NOT_OBJECT = {"type": "string"}
NON_OBJECT_SCHEMAS = [
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "messages": [HI], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": NOT_OBJECT, "strict": True}}]},
        "tools.0.function.parameters", id="chat"),
    pytest.param("/v1/responses", {"max_output_tokens": 1, "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": ["object", "null"]}}]}, "tools.0.parameters",
        id="responses"),
    pytest.param("/v1/messages", {"max_tokens": 1, "messages": [HI], "tools": [
        {"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema", id="anthropic"),
]


@pytest.mark.parametrize("path,body,field", NON_OBJECT_SCHEMAS)
def test_a_function_schema_of_another_type_than_object_is_a_400(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)
