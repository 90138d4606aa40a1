"""What the three API surfaces (chat + completions, responses, Anthropic messages) must do alike,
checked through each of them on a live server with the real SDKs or raw HTTP:

- a lone UTF-16 surrogate in any text field (`"a\\ud800b"`, which JavaScript clients can send and
  no tokenizer can take) is a 400 naming the field, on every text route, and the connection it
  came on goes on serving;
- so is JSON sent as text (tool-call `arguments`) that the server cannot take in: a lone
  surrogate escaped in it, nesting past the recursion limit, an integer past what int()
  converts; and a value nested deeper than the prompt's rendering can walk (tool-call arguments
  as an object, an Anthropic tool_use input);
- a conversation that ends with an assistant message is continued, not answered anew: the prompt
  ends inside the open assistant turn, and the output is what the model writes after that text
  (Claude clients prefill answers this way; vLLM calls it `continue_final_message`).

The tiny model has random weights, so a continuation is compared with /v1/completions run on the
prompt the continuation must have: greedy decoding makes the two equal only if the prompts are.
"""

import asyncio
import http.client
import json
import threading
import time

import anthropic
import openai
import pytest
import uvicorn
from fastapi import APIRouter, FastAPI

from flashtree.serve.api_common import ApiRoute
from flashtree.serve.errors import ApiError
from flashtree.serve.streaming import sse_event, sse_response
from serve_harness import module_server

QUESTION = "What is the capital of France?"
PREFILL = "The capital of France is"
# the tiny template's rendering of QUESTION with the assistant turn left open after PREFILL
CONTINUED_PROMPT = (f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
                    f"<|im_start|>assistant\n<think>\n\n</think>\n\n{PREFILL}")
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes it as an argument
LONE = "a\ud800b"
TEXT_ROUTES = [
    ("/v1/chat/completions", {"max_tokens": 1, "messages": [{"role": "user", "content": LONE}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"max_tokens": 1, "stop": ["x", LONE], "messages": [{"role": "user", "content": "hi"}]},
     "stop.1"),
    ("/v1/completions", {"max_tokens": 1, "prompt": LONE}, "prompt"),
    ("/v1/responses", {"max_output_tokens": 1, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": LONE}]}]}, "input.0.content.0.text"),
    ("/v1/responses", {"max_output_tokens": 1, "input": "hi", "instructions": "\udfff"}, "instructions"),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/messages/count_tokens", {"system": LONE, "messages": [{"role": "user", "content": "hi"}]}, "system"),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {LONE: {"type": "string"}}}}]},
     "tools.0.input_schema.properties"),
]
DEEP_VALUE = json.loads("[" * 600 + "]" * 600)  # within the decoder's limit, past the renderer's


def chat_call(arguments: object) -> dict:
    """A chat request whose assistant turn called a tool with `arguments`."""
    return {"max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def responses_call(arguments: str) -> dict:
    """A Responses request whose input holds a function call with `arguments`."""
    return {"max_output_tokens": 1, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}


HOSTILE_JSON_TEXT = {"surrogate": '{"a": "\\ud800"}', "deep": "[" * 100_000 + "]" * 100_000,
                     "huge int": '{"a": ' + "9" * 5000 + "}"}
# (path, body, the field the 400 names): a value nested too deep is named by its path's first 8 levels
HOSTILE_JSON = [
    *[pytest.param("/v1/chat/completions", chat_call(text), "messages.1.tool_calls.0.function.arguments",
                   id=f"chat arguments {name}") for name, text in HOSTILE_JSON_TEXT.items()],
    *[pytest.param("/v1/responses", responses_call(text), "input.1.arguments", id=f"responses arguments {name}")
      for name, text in HOSTILE_JSON_TEXT.items()],
    pytest.param("/v1/chat/completions", chat_call({"a": DEEP_VALUE}),
                 "messages.1.tool_calls.0.function.arguments.a.0", id="chat arguments deep object"),
    pytest.param("/v1/messages", {"max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": DEEP_VALUE}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
        "messages.1.content.0.input.a.0.0", id="anthropic tool_use input deep object"),
]
# each route answered once more on the same connection, with text that needs escaping too: a
# surrogate *pair* (U+1F600 as JSON escapes it) is valid
FOLLOW_UPS = {
    "/v1/chat/completions": {"max_tokens": 1, "messages": [{"role": "user", "content": "hi \U0001f600"}]},
    "/v1/completions": {"max_tokens": 1, "prompt": "hi \U0001f600"},
    "/v1/responses": {"max_output_tokens": 1, "input": "hi \U0001f600"},
    "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "hi \U0001f600"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi \U0001f600"}]},
}


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory)


@pytest.fixture
def connection(server):
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    yield conn
    conn.close()


def post(conn: http.client.HTTPConnection, path: str, body: dict | bytes) -> tuple[int, dict, bool]:
    """POST `body` as JSON with non-ASCII escaped (so lone surrogates go out as `\\udXXX`), or
    as the bytes given."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read()), response.will_close


def assert_refused_naming(connection, path: str, body: dict | bytes, field: str) -> None:
    """`body` is a 400 naming `field` (its param, where the surface has one, and the start of its
    message), and the connection it came on then serves a good request."""
    status, error, will_close = post(connection, path, body)
    assert status == 400 and not will_close, error
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field + ": ")
    else:
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == field
        assert error["error"]["message"].startswith(field + ": ")
    sock = connection.sock
    status, answer, _ = post(connection, path, FOLLOW_UPS[path])
    assert status == 200, answer
    assert connection.sock is sock, "the server closed the connection"


@pytest.mark.parametrize("path,body,field", TEXT_ROUTES, ids=[f"{r[0]} {r[2]}" for r in TEXT_ROUTES])
def test_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)


@pytest.mark.parametrize("path,body,field", HOSTILE_JSON)
def test_hostile_json_is_a_400_naming_the_field_and_the_connection_stays(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)


# Numbers an answer cannot hold (NaN, Infinity, past a float's range), where the Responses API
# would write them back (its tools), or nowhere (metadata): raw bodies, since json.dumps writes
# them as Python's NaN and Infinity
NON_FINITE = [
    pytest.param("/v1/responses", b'{"input": "hi", "max_output_tokens": 1, "tools": [{"type": "function", '
                 b'"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number", '
                 b'"maximum": 1e400}}}}]}', "tools.0.parameters.properties.x.maximum", id="responses tool 1e400"),
    pytest.param("/v1/responses", b'{"input": "hi", "max_output_tokens": 1, "stream": true, "tools": [{"type": '
                 b'"function", "name": "f", "parameters": {"type": "object", "default": NaN}}]}',
                 "tools.0.parameters.default", id="responses stream NaN"),
    pytest.param("/v1/chat/completions", b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], '
                 b'"metadata": {"a": -Infinity}}', "metadata.a", id="chat -Infinity"),
    pytest.param("/v1/messages", b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": '
                 b'[{"name": "f", "input_schema": {"type": "object", "minimum": -1e999}}]}',
                 "tools.0.input_schema.minimum", id="anthropic tool -1e999"),
    # past a float's range with an exponent of two digits: 1e309, 211 digits before the point
    *[pytest.param("/v1/responses", b'{"input": "hi", "max_output_tokens": 1, "stream": ' + stream + b', "tools": '
                   b'[{"type": "function", "name": "f", "parameters": {"type": "object", "default": 1'
                   + b"0" * 210 + b'.0e99}}]}', "tools.0.parameters.default", id=f"responses {stream.decode()} 1e309")
      for stream in (b"false", b"true")],
]


@pytest.mark.parametrize("path,body,field", NON_FINITE)
def test_a_number_an_answer_cannot_hold_is_a_400_naming_the_field(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)


# a string, or 0 or 1, where a number or a flag goes: what the value spells is not guessed
NOT_JSON_TYPED = [
    pytest.param("/v1/chat/completions", {"max_tokens": "3", "messages": [{"role": "user", "content": "hi"}]},
                 "max_tokens", id="chat max_tokens string"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "temperature": "0.5",
                                          "messages": [{"role": "user", "content": "hi"}]},
                 "temperature", id="chat temperature string"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "stream": "yes",
                                          "messages": [{"role": "user", "content": "hi"}]},
                 "stream", id="chat stream yes"),
    pytest.param("/v1/chat/completions", {"max_tokens": 1, "logprobs": 1,
                                          "messages": [{"role": "user", "content": "hi"}]},
                 "logprobs", id="chat logprobs 1"),
    pytest.param("/v1/messages", {"max_tokens": 1, "stream": "off", "messages": [{"role": "user", "content": "hi"}]},
                 "stream", id="anthropic stream off"),
    pytest.param("/v1/completions", {"max_tokens": 1, "seed": "42", "prompt": "hi"}, "seed",
                 id="completions seed string"),
]


@pytest.mark.parametrize("path,body,field", NOT_JSON_TYPED)
def test_a_string_or_a_digit_for_a_number_or_a_flag_is_a_400_naming_the_field(connection, path, body, field):
    assert_refused_naming(connection, path, body, field)


def test_a_prompt_of_token_id_strings_is_a_400(connection):
    status, error, _ = post(connection, "/v1/completions", {"max_tokens": 1, "prompt": [["1", "2"]]})
    assert status == 400 and error["error"]["param"].startswith("prompt"), error


@pytest.mark.parametrize("body,said", [
    (b'{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}",
     "the request body holds an integer of 5000 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "the request body nests deeper than 128 levels")])
def test_a_body_the_decoder_refuses_is_a_400_saying_why(connection, body, said):
    status, error, _ = post(connection, "/v1/chat/completions", body)
    assert status == 400 and error["error"]["message"].startswith(said), error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_of_too_many_objects_is_a_413_before_validation(connection, path):
    """120,000 messages (what pydantic would validate on the event loop for seconds) are refused
    as counted; braces inside text are no objects: a message of 200,000 of them is read (and is
    then too long for the context)."""
    many = {"max_tokens": 1, "messages": [{"role": "user", "content": "a"}] * 120_000}
    status, error, _ = post(connection, path, many)
    assert status == 413, error
    assert "more than 100000 JSON objects and arrays" in json.dumps(error)
    braces = {"max_tokens": 1, "messages": [{"role": "user", "content": "{" * 200_000}]}
    status, error, _ = post(connection, path, braces)
    assert status == 400 and "context" in json.dumps(error), error


def completion(server, prompt: str, **kw) -> openai.types.Completion:
    return server.client().completions.create(model="any", prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_anthropic_final_assistant_message_is_continued(server):
    expected = completion(server, CONTINUED_PROMPT)
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": PREFILL}]
    m = client.messages.create(model="any", max_tokens=8, messages=messages, extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert (m.content[0].text if m.content else "") == expected.choices[0].text
    assert client.messages.count_tokens(model="any", messages=messages).input_tokens == expected.usage.prompt_tokens
    with client.messages.stream(model="any", max_tokens=8, extra_body=GREEDY, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "text", "text": PREFILL}]}]) as stream:
        assert "".join(stream.text_stream) == expected.choices[0].text


def test_chat_final_assistant_message_is_continued_unless_told_otherwise(server):
    expected = completion(server, CONTINUED_PROMPT)
    client = server.client()
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": PREFILL}]
    for extra in ({}, {"continue_final_message": True}):
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0,
                                           extra_body=extra)
        assert r.usage.prompt_tokens == expected.usage.prompt_tokens
        assert r.choices[0].message.content == expected.choices[0].text
    closed = completion(server, CONTINUED_PROMPT + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"continue_final_message": False})
    assert r.usage.prompt_tokens == closed.usage.prompt_tokens
    assert r.choices[0].message.content == closed.choices[0].text


def test_continue_final_message_needs_a_final_assistant_message(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=1, extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"


def test_no_tracebacks_in_the_server_log(server):
    assert "Traceback" not in server.log()


def serve_in_thread(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def test_an_unexpected_error_is_a_500_and_the_connection_stays():
    """An exception no mapping knows (a bug) is answered by the route itself: left to the server,
    it would be logged by uvicorn and would close the client's connection."""
    router = APIRouter(route_class=ApiRoute)

    @router.post("/v1/bug")
    async def bug(body: dict) -> dict:
        raise RuntimeError("a bug")

    @router.post("/v1/fine")
    async def fine(body: dict) -> dict:
        return body

    app = FastAPI()
    app.include_router(router)
    server, thread, port = serve_in_thread(app)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        status, error, will_close = post(conn, "/v1/bug", {"x": 1})
        assert status == 500 and not will_close
        assert error["error"]["code"] == "internal_error" and "a bug" in error["error"]["message"]
        sock = conn.sock
        assert post(conn, "/v1/fine", {"x": 1})[:2] == (200, {"x": 1}) and conn.sock is sock
        conn.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_a_stream_whose_error_events_fail_too_ends_with_a_bare_error_event():
    """A surface's closing events may echo the request (Responses' response.failed), which may be
    what failed: the stream still ends with an error event, not a cut connection."""

    async def events():
        yield sse_event("response.created", {"n": 1})
        raise ValueError("Out of range float values are not JSON compliant")

    async def items():
        yield None

    def echoing_error(error: ApiError) -> list[str]:
        return [sse_event("response.failed", {"echo": float("inf")})]

    async def run() -> list[str]:
        return [chunk async for chunk in sse_response(events(), echoing_error, items()).body_iterator]

    chunks = asyncio.run(run())
    assert chunks[0].startswith("event: response.created")
    name, data = chunks[1].split("\n")[:2]
    assert name == "event: error" and len(chunks) == 2
    error = json.loads(data.removeprefix("data: "))["error"]
    assert error["code"] == "internal_error" and "JSON compliant" in error["message"]
