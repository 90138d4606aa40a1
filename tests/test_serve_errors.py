"""Refusals: API-key auth, a table of malformed requests (each a 4xx OpenAI error object, never a
5xx), over-long prompts, oversized bodies, unknown routes, CORS, bad command lines, and a
schemathesis run against the server's own /openapi.json."""

import json
import os
import re
import socket
import subprocess

import httpx
import openai
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup, ServerError
from schemathesis.core.result import Err

from flashtree.serve.errors import quoted
from serve_harness import SERVE_CMD, module_server

KEY = "sk-test-key"
MAX_CTX = 256
OK_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, "--max-body-mb", "0.25", "--cors-origin",
                             "http://app.example", "--default-max-tokens", "6", api_key=KEY, max_ctx=MAX_CTX)


def assert_error(response, status, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code
    return error


def test_api_key_required_except_health(server):
    open_client = httpx.Client(base_url=server.url, timeout=30)
    assert open_client.get("/health").status_code == 200
    head = open_client.head("/health")  # what load balancers' HEAD checks send
    assert head.status_code == 200 and head.content == b""
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/props"),
                         ("GET", "/metrics"), ("POST", "/v1/responses")]:
        r = open_client.request(method, path, json={"messages": OK_MESSAGES})
        assert_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    wrong = open_client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert server.client().models.list().data[0].id == "target"


def test_the_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
        assert r.status_code == 200, (scheme, r.text)
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=30), 401)


def test_models_retrieve_the_served_model_and_404_for_others(server):
    client = server.client()
    model = client.models.retrieve("target")
    assert (model.id, model.object, model.context_length) == ("target", "model", MAX_CTX)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and "'target'" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:  # a long id is not sent back whole
        client.models.retrieve("m" * 8000)
    assert "'mmm" in info.value.body["message"] and len(info.value.body["message"]) < 400


CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    ("invalid json", CHAT, b'{"messages": [', 400),
    ("json array body", CHAT, [1, 2], 400),
    ("messages missing", CHAT, {"max_tokens": 3}, 400),
    ("messages not a list", CHAT, {"messages": "hi"}, 400),
    ("empty messages", CHAT, {"messages": []}, 400),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 42}]}, 400),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
    ("max_tokens huge", CHAT, {"messages": OK_MESSAGES, "max_tokens": 10**20}, 400),
    ("max_tokens zero", CHAT, {"messages": OK_MESSAGES, "max_tokens": 0}, 400),
    ("max_tokens text", CHAT, {"messages": OK_MESSAGES, "max_tokens": "many"}, 400),
    ("temperature negative", CHAT, {"messages": OK_MESSAGES, "temperature": -1}, 400),
    ("top_p zero", CHAT, {"messages": OK_MESSAGES, "top_p": 0}, 400),
    ("seed negative", CHAT, {"messages": OK_MESSAGES, "seed": -5}, 400),
    ("n > 1", CHAT, {"messages": OK_MESSAGES, "n": 2}, 400),
    ("top_logprobs without logprobs", CHAT, {"messages": OK_MESSAGES, "top_logprobs": 2}, 400),
    ("logit_bias key not a token id", CHAT, {"messages": OK_MESSAGES, "logit_bias": {"x": 1}}, 400),
    ("too many stops", CHAT, {"messages": OK_MESSAGES, "stop": [str(i) for i in range(17)]}, 400),
    ("stop wrong type", CHAT, {"messages": OK_MESSAGES, "stop": 5}, 400),
    ("stop too long", CHAT, {"messages": OK_MESSAGES, "stop": ["x" * 513]}, 400),
    ("tool_choice without tools", CHAT, {"messages": OK_MESSAGES, "tool_choice": "required"}, 400),
    ("tool_choice unknown function", CHAT, {"messages": OK_MESSAGES, "tools": [
        {"type": "function", "function": {"name": "a"}}],
        "tool_choice": {"type": "function", "function": {"name": "b"}}}, 400),
    ("tool without name", CHAT, {"messages": OK_MESSAGES, "tools": [{"type": "function", "function": {}}]}, 400),
    ("response_format no schema", CHAT, {"messages": OK_MESSAGES, "response_format": {"type": "json_schema"}}, 400),
    ("response_format unknown", CHAT, {"messages": OK_MESSAGES, "response_format": {"type": "yaml"}}, 400),
    ("completion prompt missing", "/v1/completions", {"max_tokens": 2}, 400),
    ("completion empty ids", "/v1/completions", {"prompt": []}, 400),
    ("completion id out of vocab", "/v1/completions", {"prompt": [1, 10**6]}, 400),
    ("completion two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("completion echo", "/v1/completions", {"prompt": "a", "echo": True}, 400),
    ("responses empty input", "/v1/responses", {"input": []}, 400),
    ("responses previous id", "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400),
    ("responses conversation", "/v1/responses", {"input": "hi", "conversation": "conv_1"}, 400),
    ("responses unknown item", "/v1/responses", {"input": [{"type": "mystery"}]}, 400),
    ("max_tokens a boolean", CHAT, {"messages": OK_MESSAGES, "max_tokens": True}, 400),
    ("completion ids as booleans", "/v1/completions", {"prompt": [True, False]}, 400),
    ("reasoning_effort unknown", CHAT, {"messages": OK_MESSAGES, "reasoning_effort": "ultra"}, 400),
]


# fields the engine's own ranges refuse (SamplingParams.validate) and ids the worker's vocabulary
# refuses: each 400 names its field
FIELD_RANGES = [
    (CHAT, {"temperature": float("nan")}, "temperature"),
    (CHAT, {"top_p": 2}, "top_p"),
    (CHAT, {"repetition_penalty": 1e-300, "temperature": 0, "logprobs": True}, "repetition_penalty"),
    (CHAT, {"repetition_penalty": 1e-45, "temperature": 1}, "repetition_penalty"),
    ("/v1/completions", {"repetition_penalty": 0.001, "logprobs": 1}, "repetition_penalty"),
    ("/v1/responses", {"repetition_penalty": 1e-40, "top_logprobs": 1}, "repetition_penalty"),
    (CHAT, {"logit_bias": {"\uff15": 100}}, "logit_bias"),   # a fullwidth 5
    (CHAT, {"logit_bias": {"\u0663": 100}}, "logit_bias"),   # an Arabic-Indic 3
    (CHAT, {"logit_bias": {"0005": 100, "5": -100}}, "logit_bias"),
    (CHAT, {"logit_bias": {"99999999": 1}}, "logit_bias"),  # past the vocabulary: the worker's check
    ("/v1/responses", {"include": ["message.output_text.logprobs", "output.secrets"]}, "include.1"),
]


@pytest.mark.parametrize("path,fields,param", FIELD_RANGES, ids=[f"{p} {sorted(f)}" for p, f, _ in FIELD_RANGES])
def test_a_field_out_of_range_is_a_400_naming_it(server, path, fields, param):
    base = {CHAT: {"messages": OK_MESSAGES}, "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}
    body = {**base[path], "max_tokens": 3, **fields}
    for stream in (False, True):
        r = server.post(path, content=json.dumps({**body, "stream": stream}),
                        headers={"Content-Type": "application/json"})
        assert assert_error(r, 400)["param"] == param, (stream, r.text)


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
def test_a_template_kwarg_that_the_template_already_has_is_a_400_naming_it(server, path):
    """A variable the server sets from the request (overwritten once, silently) or a function the
    renderer provides (`namespace` once failed the template, a 400 with no param) is refused."""
    base = {CHAT: {"messages": OK_MESSAGES, "max_tokens": 2}, "/v1/responses": {"input": "hi", "max_output_tokens": 2}}
    for key, why in [("messages", "from the request"), ("add_generation_prompt", "from the request"),
                     ("raise_exception", "function"), ("namespace", "function")]:
        r = server.post(path, json={**base[path], "chat_template_kwargs": {key: 1}})
        error = assert_error(r, 400)
        assert error["param"] == f"chat_template_kwargs.{key}" and why in error["message"], r.text
    assert server.post(path, json={**base[path], "chat_template_kwargs": {"enable_thinking": True}}).status_code == 200


def test_the_smallest_repetition_penalty_still_answers(server):
    """At the bound a seen token's logit is multiplied by 100: finite, and its logprobs too."""
    r = server.post(CHAT, json={"messages": OK_MESSAGES, "max_tokens": 3, "temperature": 0,
                                "repetition_penalty": 0.01, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    assert all(-1e30 < t["logprob"] <= 0 for t in r.json()["choices"][0]["logprobs"]["content"])


def test_anthropic_thinking_with_a_negative_budget_is_refused(server):
    r = server.post("/v1/messages", json={"messages": OK_MESSAGES, "max_tokens": 4,
                                          "thinking": {"type": "enabled", "budget_tokens": -5}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "budget_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [5] * (MAX_CTX + 10)}, "prompt"),
    ("/v1/responses", {"input": "hello world " * 200}, "input"),
    (CHAT, {"messages": [{"role": "user", "content": "hello world " * 200}]}, "messages")])
def test_a_prompt_over_the_context_names_the_routes_prompt_field(server, path, body, param):
    error = assert_error(server.post(path, json={**body, "max_tokens": 2}), 400, "context_length_exceeded")
    assert error["param"] == param


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_error_objects(server, name, path, body, status):
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post(path, json=body)
    assert_error(r, status)


UNSUPPORTED = [
    (CHAT, {"n": 2}, "n"),
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT, {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/responses", {"background": True}, "background"),
]


M = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type", "Input should be 'text', 'input_text' or 'output_text', found 'image_url': "
                                  "this server reads text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content", "Input should be a valid string or a valid list, found 5"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages.0.role", "Input should be 'system', 'developer', 'user', 'assistant' or 'tool', found 'wizard'"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard" * 200, "content": "x"}]},  # cut as errors.quoted cuts
     "messages.0.role", "Input should be 'system', 'developer', 'user', 'assistant' or 'tool', found "
                        + quoted("wizard" * 200)),
    ("/v1/responses", {"input": [{"type": "weird"}]},
     "input.0.type", "Input should be 'message', 'function_call', 'function_call_output' or 'reasoning', found 'weird'"),
    ("/v1/messages", {"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]},
     "messages.0.content.0.content.0.type", "Input should be 'text', found 'image': this server reads text only"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt.1", "Input should be a valid integer"),
])
def test_a_value_of_no_accepted_form_is_named_where_it_parts_from_them(server, path, body, param, says):
    """A field of several forms (a string or a list of parts) is refused at the place inside the
    value where it fits none of them, not as "content.str: Input should be a valid string"."""
    r = server.post(path, json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"].startswith(f"{param}: {says}"), error
    assert "more problems" not in error["message"]
    if path != "/v1/messages":  # Anthropic's error object has no param
        assert error["param"] == param


@pytest.mark.parametrize("path,fields,param", UNSUPPORTED, ids=[f"{p} {f}" for p, _, f in UNSUPPORTED])
def test_fields_not_supported_yet_are_a_400_that_says_so(server, path, fields, param):
    base = {CHAT: {"messages": OK_MESSAGES}, "/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"}}
    body = {**base[path], "max_tokens": 2, **fields}
    error = assert_error(server.post(path, json=body), 400, "unsupported_parameter")
    assert error["param"] == param and "not supported yet" in error["message"]


def test_unsupported_fields_through_the_sdk(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="more than one choice"):
        client.chat.completions.create(model="x", messages=OK_MESSAGES, n=2)
    unset = client.chat.completions.create(model="x", messages=OK_MESSAGES, max_tokens=2, logit_bias={},
                                           logprobs=False, n=1, response_format={"type": "text"})
    assert unset.choices[0].finish_reason  # asking for nothing unsupported is fine


def test_a_prompt_of_exactly_max_ctx_tokens_is_told_it_does_not_fit(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model="x", prompt=[5] * MAX_CTX, max_tokens=1)
    message = info.value.body["message"]
    assert info.value.code == "context_length_exceeded"
    assert f"prompt has {MAX_CTX} tokens" in message and f"at most {MAX_CTX - 1}" in message
    assert "at least one generated token" in message
    fits = server.client().completions.create(model="x", prompt=[5] * (MAX_CTX - 1), max_tokens=5,
                                              extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 1 and fits.choices[0].finish_reason == "length"


def test_prompt_over_context_names_both_numbers(server):
    r = server.post(CHAT, json={"messages": [{"role": "user", "content": "hello world " * 200}]})
    error = assert_error(r, 400, "context_length_exceeded")
    assert str(MAX_CTX) in error["message"]
    prompt_tokens = int(error["message"].split("prompt has ")[1].split()[0])
    assert prompt_tokens > MAX_CTX
    streamed = server.post(CHAT, json={"messages": [{"role": "user", "content": "hello world " * 200}],
                                       "stream": True})
    assert_error(streamed, 400, "context_length_exceeded")


def test_max_tokens_is_clamped_to_the_context(server):
    r = server.client().chat.completions.create(model="x", messages=OK_MESSAGES, max_tokens=100000)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= MAX_CTX


def test_a_request_without_a_limit_gets_the_servers_default(server):
    client = server.client()
    kw = {"model": "x", "messages": OK_MESSAGES, "extra_body": {"ignore_eos": True}}
    capped = client.chat.completions.create(**kw)
    assert capped.usage.completion_tokens == 6 and capped.choices[0].finish_reason == "length"
    assert client.chat.completions.create(**kw, max_tokens=9).usage.completion_tokens == 9  # explicit wins
    streamed = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens == 6
    props = server.get("/props").json()["default_generation_settings"]["params"]
    assert props["n_predict"] == 6  # what llama.cpp-style clients read as the server's default


def test_oversized_body_is_413(server):
    big = {"messages": [{"role": "user", "content": "x" * 400_000}]}
    assert_error(server.post(CHAT, json=big), 413, "request_too_large")

    def chunked():  # no Content-Length: the limit must hold for streamed uploads too
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 65536):
            yield payload[i:i + 65536]

    r = server.post(CHAT, content=chunked(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large")


def test_unknown_route_and_wrong_method(server):
    assert_error(server.post("/v1/nothing", json={}), 404, "not_found")
    assert_error(server.get(CHAT), 405)


def test_cors_preflight_for_the_allowed_origin(server):
    r = httpx.options(server.url + CHAT, timeout=30, headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(server.url + CHAT, timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(SERVE_CMD + list(args), capture_output=True, text=True, timeout=120, env=env)


def test_help_explains_every_flag_with_its_default():
    out = run_cli("--help").stdout
    for flag in ("--target", "--draft", "--host", "--port", "--max-ctx", "--mode", "--budget",
                 "--block-size", "--prefill-ubatch", "--api-key", "--model-alias", "--max-queue",
                 "--cors-origin", "--max-body-mb", "--tool-parser"):
        assert flag in out, flag
    assert "127.0.0.1" in out and "(default: 16)" in out


def test_bad_flags_and_unloadable_models_exit_with_a_message(tmp_path):
    bad = run_cli("--max-queue", "0")
    assert bad.returncode == 2 and "max_queue must be >= 1" in bad.stderr
    missing = run_cli("--target", str(tmp_path / "nope"), "--port", "0")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert re.search(r"listening on http://127\.0\.0\.1:\d+/ ", missing.stderr)  # the port 0 became
    for flag, value in (("--max-body-mb", "nan"), ("--chat-template-timeout", "inf")):
        bad = run_cli(flag, value)
        assert bad.returncode == 2 and "must be a finite number > 0, got" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_a_port_in_use_or_a_foreign_host_is_refused_before_the_model_loads(tmp_path):
    """Not after minutes of loading: the socket is bound first (the target here does not even exist)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("--target", str(tmp_path / "nope"), "--port", str(port))
    assert busy.returncode == 2, busy.stderr
    assert busy.stderr.strip() == f"flashtree serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    foreign = run_cli("--target", str(tmp_path / "nope"), "--host", "203.0.113.7", "--port", "0")
    assert foreign.returncode == 2 and "cannot listen on 203.0.113.7:0: Cannot assign requested address" in foreign.stderr


def test_no_tracebacks_in_the_server_log(server):
    assert "Traceback" not in server.log()


def fuzz_for_server_errors(schema, max_examples: int = 12, **call_kw) -> int:
    """Fuzz every operation of `schema` with valid and invalid requests (schemathesis' positive and
    negative generation, `max_examples` each through hypothesis) and raise at the first answer
    with a 5xx status; returns how many operations were fuzzed. It drives schemathesis from a
    plain test, not through `schemathesis.pytest`: that plugin rewrites pytest's private
    `Node._nodeid`, which pytest 9.2 no longer has."""
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # a route the schema describes in a way schemathesis cannot use
        operations.append(result.ok())
    for operation in operations:
        cases = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])

        @settings(max_examples=max_examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def no_server_error(case):
            case.call_and_validate(checks=[not_a_server_error], **call_kw)

        try:
            no_server_error()
        except BaseException as e:  # schemathesis' FailureGroup is a BaseExceptionGroup
            e.add_note(f"while fuzzing {operation.label}")
            raise
    return len(operations)


@pytest.mark.slow  # 7 s of generated requests
def test_schemathesis_finds_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.headers())
    fuzzed = fuzz_for_server_errors(schema, headers=server.headers(), timeout=120)
    assert fuzzed >= 9  # every route in docs/SERVING.md's endpoint table


def test_the_fuzzer_reports_a_server_error():
    """The fuzzing above can fail: a route that answers 500 for some input is found."""
    app = FastAPI()

    @app.post("/echo")
    def echo(body: dict[str, int]) -> dict[str, int]:
        if body:  # any non-empty object
            return JSONResponse({"error": "boom"}, status_code=500)
        return body

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    with pytest.raises(FailureGroup) as failed:
        fuzz_for_server_errors(schema, max_examples=50)
    [error] = failed.value.exceptions
    assert isinstance(error, ServerError) and error.status_code == 500
    assert failed.value.__notes__[-1] == "while fuzzing POST /echo"
