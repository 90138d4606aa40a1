"""The OpenAI-compatible surface of a live `flashtree serve`, driven by the real `openai` client:
chat (non-stream, stream chunk rules, include_usage, stop strings, length, seed, tools), completions,
models, responses (event order and payloads), props, metrics.

The tiny model has random weights, so assertions compare the server with itself (stream vs
non-stream, one seed vs the same seed, a stop string taken from the model's own greedy output)
rather than with fixed text.
"""

import json

import httpx
from openai.types.responses import ResponseUsage
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_harness import module_server

USER = [{"role": "user", "content": "hi"}]
SYSTEM = "Be brief."
EOS_CANDIDATES = ["What is 2+2?", "hi", "Say hello.", "ok", "Why?", "Tell me a joke.", "List three colors.",
                  "def f(x):", "Hello world!", "12345", "import os", "café", "Translate: cat", "yes or no?"]
EOS_BUDGET = 200
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look something up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def eos_question(client):
    """A question whose greedy answer (after the SYSTEM message) reaches EOS by itself: random
    weights decide which, so it is found rather than assumed."""
    for question in EOS_CANDIDATES:
        r = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                 max_tokens=EOS_BUDGET, ignore_eos=False)
        if r.choices[0].finish_reason == "stop":
            return question
    pytest.fail(f"none of {len(EOS_CANDIDATES)} prompts reaches EOS within {EOS_BUDGET} tokens")


NO_EOS = {"ignore_eos": True}  # output runs to max_tokens whatever the random weights say


def chat(client, messages=USER, ignore_eos=True, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    kw["extra_body"] = {"ignore_eos": ignore_eos, **kw.get("extra_body", {})}
    return client.chat.completions.create(model="any", messages=messages, **kw)


def test_models_report_context_length(client):
    models = client.models.list().data
    assert len(models) == 1
    extra = models[0].model_extra
    assert models[0].id == "target"
    assert extra["context_length"] == extra["max_model_len"] == extra["meta"]["n_ctx"] == 1024


def test_chat_non_stream(client):
    r = chat(client, max_tokens=8)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_reuses_the_cache(client):
    chat(client, max_tokens=2)
    r = chat(client, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_stream_chunk_rules_and_usage(client):
    reference = chat(client, max_tokens=16)
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *body, last_choice, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == reference.usage.prompt_tokens
    assert last_choice.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body + [last_choice])
    assert all(c.choices[0].finish_reason is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == reference.choices[0].message.content


def test_stream_without_usage_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": USER, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_eos_gives_finish_reason_stop(client, eos_question):
    r = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": eos_question}],
             max_tokens=EOS_BUDGET, stream=True, ignore_eos=False)
    chunks = list(r)
    assert chunks[-1].choices[0].finish_reason == "stop"
    through = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": eos_question}],
                   max_tokens=EOS_BUDGET)
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == EOS_BUDGET


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_from_the_models_own_output(client, stream):
    full = chat(client, max_tokens=40).choices[0].message.content
    stop = full[10:13]
    expected = full[:full.index(stop)]
    if stream:
        chunks = list(chat(client, max_tokens=40, stop=[stop, "\x00never"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = chat(client, max_tokens=40, stop=stop)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == expected
    assert finish == "stop"


def test_seed_reproducibility(client):
    sampled = [chat(client, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content
               for seed in (7, 7, 8, 9, 10)]
    assert sampled[0] == sampled[1]
    assert len(set(sampled)) > 1, "different seeds should not all agree at temperature 1"


def test_sampling_fields_are_accepted(client):
    r = chat(client, max_tokens=4, temperature=0.7, top_p=0.9, seed=1, frequency_penalty=0.5,
             presence_penalty=0.5, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 4


def test_named_tool_choice_forces_the_call_prefix(client):
    """The forced opener is part of the output: either a parsed call or, since the random model
    cannot finish the JSON in 8 tokens, a call cut by max_tokens, which is dropped (never text,
    never a 500)."""
    r = chat(client, [{"role": "user", "content": "look up cats"}], tools=TOOLS, max_tokens=8,
             tool_choice={"type": "function", "function": {"name": "lookup"}})
    msg = r.choices[0].message
    if msg.tool_calls:
        assert msg.tool_calls[0].function.name == "lookup" and r.choices[0].finish_reason == "tool_calls"
    else:
        assert (msg.content, r.choices[0].finish_reason) == ("", "length")


def test_tool_history_and_thinking_render(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "find x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "x is 1"}]
    r = chat(client, messages, tools=TOOLS, tool_choice="auto", max_tokens=4,
             extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.usage.completion_tokens == 4
    required = chat(client, messages, tools=TOOLS, tool_choice="required", max_tokens=4)
    msg = required.choices[0].message  # a call, or one cut by max_tokens and dropped
    assert msg.tool_calls or (msg.content, required.choices[0].finish_reason) == ("", "length")


def test_completions_string_and_token_ids(client):
    r = client.completions.create(model="any", prompt="def add(a, b):", max_tokens=6, temperature=0,
                                  extra_body=NO_EOS)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    ids = client.completions.create(model="any", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                    extra_body=NO_EOS)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3
    chunks = list(client.completions.create(model="any", prompt="def add(a, b):", max_tokens=6,
                                            temperature=0, stream=True, extra_body=NO_EOS, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_responses_non_stream(client, eos_question):
    r = client.responses.create(model="any", input=eos_question, instructions=SYSTEM,
                                max_output_tokens=EOS_BUDGET, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output[-1].type == "message" and r.output_text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens_details.cached_tokens >= 0
    # the SDK builds responses without validating: every field its model requires is really sent
    ResponseUsage.model_validate(r.usage.model_dump(exclude_unset=True))
    cut = client.responses.create(model="any", input="hi", max_output_tokens=5, temperature=0,
                                  extra_body=NO_EOS)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5


def test_responses_stream_event_sequence(client, eos_question):
    events = list(client.responses.create(model="any", input=[
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": eos_question}]}],
        max_output_tokens=EOS_BUDGET, temperature=0, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta",
                         "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text
    assert final.id == events[0].response.id and final.model == "target" and final.usage.output_tokens > 0
    plain = client.responses.create(model="any", input=eos_question, instructions=SYSTEM,
                                    max_output_tokens=EOS_BUDGET, temperature=0)
    assert plain.output_text == final.output_text


def test_responses_function_call_items_round_trip(client):
    r = client.responses.create(model="any", temperature=0, max_output_tokens=6, extra_body=NO_EOS, tools=[
        {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}},
        {"type": "web_search"}], input=[
        {"role": "user", "content": "find x"},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "x is 1"}])
    assert r.status == "incomplete" and r.usage.output_tokens == 6


def test_props(server):
    props = server.get("/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 1024 and settings["speculative"] is True
    assert props["speculative"]["mode"] == "ddtree" and props["speculative"]["has_draft"]
    assert props["model_path"].endswith("target") and "<|im_start|>" in props["chat_template"]


def test_health_and_metrics(server, client):
    chat(client, max_tokens=3)
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["worker_pid"] > 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(server.get("/metrics").text)
               for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("flashtree_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert value("flashtree_completion_tokens_total") >= 3
    assert value("flashtree_prompt_tokens_total") > 0
    assert value("flashtree_accept_length_count") >= 1
    assert value("flashtree_prefill_seconds_total") > 0
    assert 0 <= value("flashtree_snapshot_seconds_total") <= value("flashtree_prefill_seconds_total")
    assert value("flashtree_decode_steps_total") >= 1
    assert 0 < value("flashtree_decode_step_seconds_total") <= value("flashtree_decode_seconds_total")
    assert value("flashtree_cuda_mallocs_total") == value("flashtree_cuda_frees_total") == 0  # the CPU
    assert value("flashtree_worker_restarts_total") == 0
    assert value("flashtree_queue_depth") == 0
    assert value("flashtree_requests_running") == 0
