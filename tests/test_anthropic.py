"""The Anthropic Messages surface (/v1/messages, /v1/messages/count_tokens) driven by the real
`anthropic` SDK: against a live server (non-stream, stream event order, prefix-cache usage, stop
sequences, conversations with tools and tool results, thinking, count_tokens, auth, errors, an
injected out-of-memory prefill), and, in-process, the content blocks and events built from
known token sequences (tool_use, thinking) parsed back by the SDK, and the pings of a long
prefill.

The tiny model has random weights, so live assertions compare the server with itself and never
depend on what the model says; tool_use blocks are produced from a known token sequence instead.
"""

import asyncio
import json
import os

import anthropic
import httpx
import httpx2
import pytest

from flashtree.checkpoint import load_tokenizer
from flashtree.serve import anthropic_api
from flashtree.serve.anthropic_convert import chat_messages, chat_tools
from flashtree.serve.anthropic_output import BlockBuilder, MessageShell
from flashtree.serve.anthropic_schemas import MessagesRequest
from flashtree.serve.pipeline import Finish, GenerationSpec, OutputPipeline, TextDelta, Usage
from flashtree.serve.streaming import sse_event, sse_response
from flashtree.serve.supervisor import RequestFailed
from serve_harness import Server, module_server

KEY = "sk-ant-test"
MAX_CTX = 1024
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"name": "lookup", "description": "look something up",
          "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}]
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Find the weather."}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "weather"}},
        {"type": "tool_use", "id": "toolu_2", "name": "lookup", "input": {"q": "forecast"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "service down"}]},
        {"type": "text", "text": "Summarize."}]},
]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, api_key=KEY, max_ctx=MAX_CTX)


def sdk(url, **kw):
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=url, max_retries=0, timeout=120,
                               _strict_response_validation=True, **kw)


@pytest.fixture(scope="module")
def client(server):
    return sdk(server.url)


def create(client, messages=USER, **kw):
    kw.setdefault("max_tokens", 12)
    return client.messages.create(model="any", messages=messages, **kw)


def prompt_size(usage):
    return usage.input_tokens + usage.cache_read_input_tokens


def test_non_stream_message(client):
    # sampling fields newer SDKs no longer send are still accepted from older clients
    m = create(client, max_tokens=8, extra_body={"temperature": 0, "top_p": 1.0, "top_k": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("max_tokens", "end_turn") and m.stop_sequence is None
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 8)
    assert m.usage.cache_creation_input_tokens == 0 and prompt_size(m.usage) > 0


def test_stream_events_in_order_and_same_as_non_stream(client):
    reference = create(client, max_tokens=16)
    with create(client, max_tokens=16, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + \
        ["content_block_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert all(e.index == 0 for e in events[1:-2])
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert "".join(e.delta.text for e in events[2:-3]) == reference.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == reference.stop_reason
    assert delta.usage.output_tokens == reference.usage.output_tokens
    assert prompt_size(delta.usage) == prompt_size(reference.usage)
    assert events[0].message.usage.input_tokens == prompt_size(reference.usage)


def test_sdk_stream_helper_accumulates_the_message(client):
    reference = create(client, max_tokens=10)
    with client.messages.stream(model="any", messages=USER, max_tokens=10) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == reference.content[0].text
    assert final.usage.output_tokens == reference.usage.output_tokens


def test_repeated_prompt_reads_the_prefix_cache(client):
    create(client, max_tokens=2)
    m = create(client, max_tokens=2)
    assert m.usage.cache_read_input_tokens > 0
    assert m.usage.input_tokens < prompt_size(m.usage)


def test_a_new_billing_header_still_reads_the_prefix_cache(client):
    """Claude Code's per-request billing line in `system` does not cost the cached prompt."""
    def ask(tag: str):
        header = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{tag}; cc_entrypoint=sdk-cli;"}
        return create(client, max_tokens=2, system=[header, {"type": "text", "text": "You help with code. " * 20}])
    first, second = ask("423"), ask("c5e")
    assert prompt_size(second.usage) == prompt_size(first.usage)
    assert second.usage.input_tokens <= 2 < second.usage.cache_read_input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_from_the_models_own_output(client, stream):
    full = create(client, max_tokens=40).content[0].text
    start = next(i for i in range(5, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].strip())
    stop = full[start:start + 3]
    kw = dict(max_tokens=40, stop_sequences=["\x01never", stop])
    if stream:
        with client.messages.stream(model="any", messages=USER, **kw) as s:
            m = s.get_final_message()
    else:
        m = create(client, **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert (m.content[0].text if m.content else "") == full[:full.index(stop)]


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "any"},
                                    {"type": "tool", "name": "lookup"}, {"type": "none"}])
def test_conversation_with_tools_and_results(client, choice):
    extra = {"tool_choice": choice} if choice else {}
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    m = create(client, HISTORY, system=system, tools=TOOLS, max_tokens=16, **extra)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert all(b.type in ("text", "tool_use") for b in m.content)
    count = client.messages.count_tokens(model="any", messages=HISTORY, system=system, tools=TOOLS, **extra)
    assert count.input_tokens == prompt_size(m.usage)


def test_tools_change_the_prompt_and_none_drops_them(client):
    plain = client.messages.count_tokens(model="any", messages=USER).input_tokens
    tools = client.messages.count_tokens(model="any", messages=USER, tools=TOOLS).input_tokens
    none = client.messages.count_tokens(model="any", messages=USER, tools=TOOLS,
                                        tool_choice={"type": "none"}).input_tokens
    assert tools > plain == none


def test_thinking_enabled_leaves_the_think_block_to_the_model(client):
    def count(thinking):
        return client.messages.count_tokens(model="any", messages=USER, thinking=thinking).input_tokens
    enabled = count({"type": "enabled", "budget_tokens": 1024})
    assert count({"type": "disabled"}) > enabled  # disabled: the template closes an empty think block
    with client.messages.stream(model="any", messages=USER, max_tokens=8,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        m = s.get_final_message()
    assert prompt_size(m.usage) == enabled
    assert all(b.type in ("thinking", "text") for b in m.content)


def test_tool_names_must_be_unique_as_anthropic_requires(client):
    for call in (create, lambda c, m, **kw: c.messages.count_tokens(model="any", messages=m, **kw)):
        with pytest.raises(anthropic.BadRequestError) as info:
            call(client, USER, tools=TOOLS + TOOLS)
        assert info.value.body["error"]["message"] == "tools: Tool names must be unique ('lookup' is declared twice)"


def test_a_tool_choice_without_tools_says_what_it_asked_for(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, USER, tool_choice={"type": "any"})
    assert info.value.body["error"]["message"].startswith(
        "tool_choice asks for a tool call (any tool), which needs at least one function tool in `tools`")


def test_count_tokens_still_counts_a_prompt_over_the_context(client):
    long = [{"role": "user", "content": "hello world " * 1000}]
    assert client.messages.count_tokens(model="any", messages=long).input_tokens > MAX_CTX
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, long)
    assert info.value.body["error"]["message"].startswith("prompt is too long: ")


def test_auth_by_x_api_key_or_bearer_and_headers_accepted(server):
    headers = {"anthropic-version": "2023-06-01",
               "anthropic-beta": "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"}
    by_key = sdk(server.url, default_headers=headers)
    assert by_key.messages.count_tokens(model="any", messages=USER).input_tokens > 0
    by_bearer = sdk(server.url, api_key=None, auth_token=KEY)
    assert create(by_bearer, max_tokens=1).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as info:
        sdk(server.url, api_key="wrong").messages.count_tokens(model="any", messages=USER)
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": info.value.body["error"]["message"]}}
    r = httpx.post(server.url + "/v1/messages?beta=true", json={"messages": USER, "max_tokens": 1},
                   headers={"x-api-key": KEY, **headers}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"


BAD = [
    ("missing max_tokens", {"messages": USER}, "max_tokens"),
    ("max_tokens zero", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("empty messages", {"messages": [], "max_tokens": 4}, "messages"),
    ("image block", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages"),
    ("unknown role", {"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("undeclared tool", {"max_tokens": 4, "messages": USER, "tools": TOOLS,
                         "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ("tool choice without name", {"max_tokens": 4, "messages": USER, "tools": TOOLS,
                                  "tool_choice": {"type": "tool"}}, "tool_choice"),
    ("temperature out of range", {"max_tokens": 4, "messages": USER, "temperature": -1}, "temperature"),
    ("temperature over anthropic's 1", {"max_tokens": 4, "messages": USER, "temperature": 2.0}, "temperature"),
    ("top_p over 1", {"max_tokens": 4, "messages": USER, "top_p": 1.5}, "top_p"),
    ("mcp servers", {"max_tokens": 4, "messages": USER, "mcp_servers": [
        {"type": "url", "url": "https://example.com/sse", "name": "x"}]}, "not supported yet"),
    ("stop_sequences not a list", {"max_tokens": 4, "messages": USER, "stop_sequences": "x"},
     "stop_sequences"),
]


@pytest.mark.parametrize("name,body,mentions", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_anthropic_errors(server, name, body, mentions):
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["x-should-retry"] == "false"
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and mentions in error["error"]["message"]


def test_invalid_json_and_sdk_error_class(server, client):
    r = httpx.post(server.url + "/v1/messages", content=b'{"messages": [', timeout=60,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", content=b"\xff\xfe{", timeout=60,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        create(client, max_tokens=4, extra_body={"temperature": -1})
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        create(client, max_tokens=4, extra_body={"temperature": 2.0})
    assert create(client, max_tokens=1, extra_body={"temperature": 1.0}).type == "message"  # 1 is in range


def test_no_tracebacks_in_the_server_log(server):
    assert "Traceback" not in server.log()


# --- an engine that runs out of memory on every prefill --------------------------------------


@pytest.fixture(scope="module")
def oom_server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    os.environ["FLASHTREE_FAULTS"] = "prefill:oom:*"
    try:
        srv = Server(target, draft, tmp_path_factory.mktemp("log") / "oom.log", max_ctx=MAX_CTX)
    finally:
        del os.environ["FLASHTREE_FAULTS"]
    yield srv
    srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_out_of_memory_is_a_retryable_overloaded_error(oom_server, stream):
    client = sdk(oom_server.url)
    with pytest.raises(anthropic.InternalServerError) as info:
        if stream:
            with client.messages.stream(model="any", messages=USER, max_tokens=4) as s:
                s.get_final_message()
        else:
            create(client, max_tokens=4)
    assert info.value.status_code == 503
    assert info.value.response.headers["x-should-retry"] == "true"
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert "out of memory" in info.value.body["error"]["message"]
    assert client.messages.count_tokens(model="any", messages=USER).input_tokens > 0
    assert oom_server.proc.poll() is None


# --- block assembly from known token sequences, parsed back by the SDK -----------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                for t in TOOLS]
SAID = ("<think>\nThe user wants a lookup.\n</think>\n\nLet me check."
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "caf\u00e9"}}\n</tool_call>')


def items_from_tokens(tokenizer, text, finish_reason):
    """What the pipeline yields for a model that generated exactly `text`, one token per step."""
    spec = GenerationSpec(prompt_ids=[1, 2, 3], sampling={}, max_tokens=100, tools=OPENAI_TOOLS,
                          split_reasoning=True)
    pipe = OutputPipeline(tokenizer, spec)
    ids = tokenizer.encode(text)
    items = [delta for i in ids for delta in pipe.push([i])] + pipe.finish()
    return items + [Finish(finish_reason, Usage(prompt_tokens=3, completion_tokens=len(ids), cached_tokens=2))]


def mock_sdk(body: bytes, content_type: str):
    def handler(request):
        return httpx2.Response(200, content=body, headers={"content-type": content_type})
    return sdk("http://mock", http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_tool_use_and_thinking_blocks_from_known_tokens(tokenizer):
    items = items_from_tokens(tokenizer, SAID, "tool_calls")
    shell, builder = MessageShell("tiny", 3), BlockBuilder()
    events = [event for item in items for event in builder.feed(item)]
    stream_body = "".join([shell.start_event()] + [sse_event(e["type"], e) for e in events]
                          + shell.closing_events(builder)).encode()
    with mock_sdk(stream_body, "text/event-stream").messages.stream(
            model="tiny", messages=USER, max_tokens=100) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
        streamed = s.get_final_message()
    plain = mock_sdk(json.dumps(shell.final(builder)).encode(), "application/json").messages.create(
        model="tiny", messages=USER, max_tokens=100)
    for m in (streamed, plain):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        thinking, text, call = m.content
        assert thinking.thinking == "The user wants a lookup." and text.text == "Let me check."
        assert call.name == "lookup" and call.input == {"q": "caf\u00e9"} and call.id.startswith("toolu_")
        assert m.stop_reason == "tool_use"
        assert (m.usage.input_tokens, m.usage.cache_read_input_tokens) == (1, 2)
    assert ("content_block_delta", "input_json_delta") in kinds
    assert ("content_block_delta", "thinking_delta") in kinds
    assert kinds.count(("content_block_start", None)) == kinds.count(("content_block_stop", None)) == 3


def test_stop_reasons_from_known_tokens(tokenizer):
    for reason, expected in (("stop", "end_turn"), ("length", "max_tokens")):
        builder = BlockBuilder()
        for item in items_from_tokens(tokenizer, "Hello world", reason):
            builder.feed(item)
        message = MessageShell("tiny", 3).final(builder)
        assert message["stop_reason"] == expected
        assert message["content"] == [{"type": "text", "text": "Hello world"}]


def test_long_prefill_is_kept_alive_with_pings(monkeypatch):
    monkeypatch.setattr(anthropic_api, "PING_INTERVAL_S", 0.01)

    async def items():
        yield TextDelta("content", "ok")
        yield Finish("stop", Usage(prompt_tokens=3, completion_tokens=1))

    async def run():
        opening = asyncio.get_running_loop().create_future()
        events = anthropic_api._events(opening, items(), MessageShell("tiny", 3))
        chunks = [await events.__anext__(), await events.__anext__()]
        opening.set_result(None)  # the first token arrives only after a ping went out
        return chunks + [chunk async for chunk in events]

    chunks = asyncio.run(run())
    names = [chunk.split("\n", 1)[0].removeprefix("event: ") for chunk in chunks]
    assert names[:2] == ["message_start", "ping"]
    assert names[names.index("content_block_start") - 1] == "ping"
    assert names[-2:] == ["message_delta", "message_stop"]


def test_oom_after_the_stream_committed_is_an_error_event(monkeypatch):
    monkeypatch.setattr(anthropic_api, "PING_INTERVAL_S", 0.01)

    async def items():
        yield Finish("stop", Usage(prompt_tokens=3, completion_tokens=0))

    async def run():
        opening = asyncio.get_running_loop().create_future()
        shell = MessageShell("tiny", 3)
        response = sse_response(anthropic_api._events(opening, items(), shell), shell.error_events, items())
        body = response.body_iterator
        chunks = [await body.__anext__(), await body.__anext__()]
        opening.set_exception(RequestFailed("out_of_memory", "out of memory during prefill"))
        return "".join(chunks + [chunk async for chunk in body]).encode()

    with pytest.raises(anthropic.APIStatusError) as info:
        with mock_sdk(asyncio.run(run()), "text/event-stream").messages.stream(
                model="tiny", messages=USER, max_tokens=4) as s:
            s.get_final_message()
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "out of memory during prefill"}


def test_request_translation_to_chat_messages():
    body = MessagesRequest(model="any", max_tokens=4, messages=HISTORY, tools=TOOLS + [
        {"name": "web_search", "type": "web_search_20250305"}],
        system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B."}])
    assert chat_messages(body) == [
        {"role": "system", "content": "A.\nB."},
        {"role": "user", "content": "Find the weather."},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "I should look it up.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "weather"}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "forecast"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: service down"},
        {"role": "user", "content": "Summarize."}]
    assert [t["function"]["name"] for t in chat_tools(body)] == ["lookup"]  # server tools are skipped


def test_claude_codes_billing_header_block_is_not_rendered():
    def system(tag: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{tag}; cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "You are an agent."}]
    a, b = (MessagesRequest(model="any", max_tokens=4, system=system(t), messages=[{"role": "user", "content": "hi"}])
            for t in ("423", "c5e"))
    assert chat_messages(a) == chat_messages(b) == [{"role": "system", "content": "You are an agent."},
                                                    {"role": "user", "content": "hi"}]


def test_system_role_messages_join_the_system_prompt_only_before_the_first_turn():
    body = MessagesRequest(model="any", max_tokens=4, system="S", messages=[
        {"role": "system", "content": "early"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "late"}]}])
    assert chat_messages(body) == [{"role": "system", "content": "S\n\nearly"},
                                   {"role": "user", "content": "hi"}, {"role": "user", "content": "late"}]
