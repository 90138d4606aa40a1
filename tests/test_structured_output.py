"""Structured output through the live server and the real `openai` client, on the embedded model:
chat `response_format` (json_object, json_schema) and Responses `text.format`, streamed and not,
greedy and sampled. Every answer that finished with "stop" must parse as JSON and validate against
its schema; the schemas are bounded (enums, booleans, small integers, short strings, no extra
keys), so every answer must finish. A ddtree server and an ar server answer a greedy request
alike. A schema that cannot be enforced is a 400 naming the field. Tools declared `strict` get
calls whose arguments validate against their schemas (tool_choice auto, required, named).
"""

import copy
import json
import os

import jsonschema
import openai
import pytest

from flashtree.train.synth_tools import TOOLS
from serve_harness import Server
from test_grammar import VERDICT, WEATHER  # the schemas a tiny model can finish

ASSETS = os.path.join(os.path.dirname(__file__), "..", "flashtree", "assets", "target")
pytestmark = pytest.mark.skipif(not os.path.isdir(ASSETS), reason="no embedded model in this checkout")

QUESTIONS = ["What's the weather like in Paris?", "Is Python a programming language?",
             "Check the weather in Tokyo."]


def chat_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(None, None, tmp_path_factory.mktemp("structured") / "server.log", max_ctx=2048)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ar_server(tmp_path_factory):
    srv = Server(None, None, tmp_path_factory.mktemp("structured_ar") / "server.log", "--mode", "ar",
                 max_ctx=2048)
    yield srv
    srv.stop()


def ask(client: openai.OpenAI, question: str, response_format: dict, **kw):
    return client.chat.completions.create(model="x", messages=[{"role": "user", "content": question}],
                                          response_format=response_format, max_tokens=120, **kw)


@pytest.mark.parametrize("schema", [WEATHER, VERDICT], ids=["weather", "verdict"])
def test_chat_json_schema_outputs_validate(server, schema):
    client = server.client()
    for i, question in enumerate(QUESTIONS):
        for sampling in ({"temperature": 0}, {"temperature": 1.5, "seed": i}):
            choice = ask(client, question, chat_format(schema), **sampling).choices[0]
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_chat_json_schema_streamed(server):
    client = server.client()
    stream = ask(client, QUESTIONS[0], chat_format(WEATHER), temperature=1.0, seed=7, stream=True)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), WEATHER)


def test_thinking_is_closed_before_a_structured_answer(server):
    choice = ask(server.client(), QUESTIONS[1], chat_format(VERDICT), temperature=0,
                 reasoning_effort="high").choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), VERDICT)


@pytest.mark.slow  # CLI processes / long unconstrained-length answers: seconds each
def test_chat_json_object_outputs_are_objects(server):
    client = server.client()
    for i, question in enumerate(QUESTIONS):
        choice = ask(client, question, {"type": "json_object"}, temperature=1.0, seed=i).choices[0]
        if choice.finish_reason == "stop":  # any object may run past max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_responses_text_format_validates(server):
    client = server.client()
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    response = client.responses.create(model="x", input=QUESTIONS[1], text={"format": fmt},
                                       max_output_tokens=120, temperature=0)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), VERDICT)
    assert response.text.format.type == "json_schema"
    events = list(client.responses.create(model="x", input=QUESTIONS[0], text={"format": {"type": "json_object"}},
                                          max_output_tokens=120, temperature=0, stream=True))
    text = [e for e in events if e.type == "response.output_text.done"][-1].text
    final = events[-1].response
    if final.status == "completed":
        assert isinstance(json.loads(text), dict)
    else:  # any object may run past max_output_tokens: then it says so, and what came is an object's start
        assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
        assert text.startswith("{")


def test_ddtree_and_ar_answer_alike(server, ar_server):
    for question, schema in zip(QUESTIONS, [WEATHER, VERDICT, WEATHER]):
        spec = ask(server.client(), question, chat_format(schema), temperature=0).choices[0].message.content
        ar = ask(ar_server.client(), question, chat_format(schema), temperature=0).choices[0].message.content
        assert spec == ar


@pytest.mark.parametrize("body,param", [
    ({"response_format": chat_format({"type": "foo"})}, "response_format.json_schema.schema"),
    ({"response_format": chat_format("not a schema")}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": chat_format({"type": "integer", "minimum": "x"})}, "response_format.json_schema.schema"),
    ({"response_format": chat_format({"$ref": "#"})}, "response_format.json_schema.schema"),  # no value satisfies it
])
def test_bad_schema_is_a_400_naming_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, **body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    assert param in err.value.body["message"]


def test_bad_responses_schema_is_a_400_naming_the_field(server):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().responses.create(model="x", input="hi", max_output_tokens=4, text={
            "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "required": 3}}})
    assert err.value.body["param"] == "text.format.schema"


def test_a_schema_the_parser_gives_up_on_while_decoding_is_a_400_naming_the_field(server):
    """An anyOf of more objects than a parser row may hold passes the grammar check (no check
    short of decoding foresees it) and fails at the first mask in the worker: a 400 naming the
    field that held the schema, and the server goes on serving."""
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                        for i in range(2500)]}
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "hi", chat_format(schema))
    assert err.value.body["param"] == "response_format" and err.value.body["code"] == "invalid_grammar"
    assert "structured output failed" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="x", input="hi", max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert err.value.body["param"] == "text.format"
    assert ask(client, QUESTIONS[0], chat_format(WEATHER), temperature=0).choices[0].finish_reason == "stop"


def strict_tools() -> list[dict]:
    """The embedded model's tools, strict, with schemas its unconstrained calls break: every
    property required (it leaves out `unit`), strings of at most 6 characters ("123 * 45")."""
    tools = copy.deepcopy(TOOLS)
    for tool in tools:
        params = tool["function"]["parameters"]
        params["additionalProperties"] = False
        params["required"] = list(params["properties"])
        for prop in params["properties"].values():
            if prop.get("type") == "string" and "enum" not in prop:
                prop["maxLength"] = 6
        tool["function"]["strict"] = True
    return tools


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["auto", "required", "named"])
def test_strict_tool_calls_validate(server, choice):
    client = server.client()
    tools = strict_tools()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = 0
    for i, question in enumerate(["What's the weather like in Paris?", "What is 123 * 45?",
                                  "Check the weather in Tokyo."]):
        for sampling in ({"temperature": 0}, {"temperature": 1.5, "seed": i}):
            choice_out = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": question}], tools=tools, tool_choice=choice,
                max_tokens=120, **sampling).choices[0]
            if choice != "auto":
                assert choice_out.finish_reason == "tool_calls", choice_out
            for call in choice_out.message.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
                calls += 1
            if isinstance(choice, dict):
                assert [c.function.name for c in choice_out.message.tool_calls] == ["get_weather"]
    assert calls >= 3


def test_strict_tools_refusals(server):
    client = server.client()
    bad = strict_tools()
    bad[1]["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], tools=bad,
                                       max_tokens=4)
    assert err.value.body["param"] == "tools.1.function.parameters"
    # no value satisfies it: refused before the answer starts, not once the model opens a call
    bad[1]["function"]["parameters"] = {"$ref": "#"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], tools=bad,
                                       max_tokens=4, stream=True)
    assert err.value.body["param"] == "tools.1.function.parameters"
    assert "no JSON value satisfies it" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                       tools=strict_tools(), response_format={"type": "json_object"}, max_tokens=4)
    assert err.value.body["code"] == "unsupported_parameter" and err.value.body["param"] == "response_format"


def test_responses_strict_function_call_validates(server):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": True} for t in strict_tools()]
    schemas = {t["name"]: t["parameters"] for t in tools}
    response = server.client().responses.create(model="x", input="What's the weather like in Paris?", tools=tools,
                                                tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
