"""The output pipeline on real tokenizer ids of a known text (random-weight models cannot be made
to say a tool call): detokenize -> stop strings -> reasoning -> tool calls, for every way of
grouping the ids into decode steps; the stop-string matcher on its own; and how chat and
responses format tool calls and reasoning (checked against the openai SDK's own types)."""

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from flashtree.checkpoint import load_tokenizer
from flashtree.serve.holdback import StopMatcher, held_suffix_len
from flashtree.serve.openai_api import _chat_chunks, _chat_message
from flashtree.serve.pipeline import Finish, GenerationSpec, OutputPipeline, TextDelta, Usage
from flashtree.serve.responses_api import _OutputBuilder
from flashtree.serve.toolcalls import ToolCall, forced_prefix
from tiny_models import make_tokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return load_tokenizer(out)


def run(tokenizer, text, step, length=False, **spec_kw):
    """Feed the ids of `text` `step` at a time, the last cut by max_tokens when `length`; return
    merged deltas and the pipeline."""
    pipe = OutputPipeline(tokenizer, GenerationSpec(prompt_ids=[1], sampling={}, max_tokens=1, **spec_kw))
    ids = tokenizer.encode(text)
    out = []
    stopped_at = None
    for i in range(0, len(ids), step):
        out.extend(pipe.push(ids[i:i + step]))
        if pipe.stopped and stopped_at is None:
            stopped_at = i
    out.extend(pipe.finish(length))
    merged = []
    for d in out:
        if isinstance(d, ToolCall):
            merged.append(("call", d.name, json.loads(d.arguments)))
        elif merged and merged[-1][0] == d.channel:
            merged[-1] = (d.channel, merged[-1][1] + d.text)
        else:
            merged.append((d.channel, d.text))
    return merged, pipe


STEPS = [1, 2, 3, 5, 8, 1000]


@pytest.mark.parametrize("step", STEPS)
def test_reasoning_content_and_tool_call(tokenizer, step):
    text = ("<think>\nplan \u2603 first\n</think>\n\nCalling \U0001f98a.\n<tool_call>\n"
            '{"name": "lookup", "arguments": {"q": "caf\u00e9"}}\n</tool_call>')
    out, pipe = run(tokenizer, text, step, tools=TOOLS, split_reasoning=True)
    assert out == [("reasoning", "plan \u2603 first"), ("content", "Calling \U0001f98a."),
                   ("call", "lookup", {"q": "caf\u00e9"})]
    assert pipe.tool_calls == 1


@pytest.mark.parametrize("step", STEPS)
def test_stop_string_cuts_output(tokenizer, step):
    out, pipe = run(tokenizer, "alpha beta STOP gamma STOP", step, stops=["STOP", "never"])
    assert out == [("content", "alpha beta ")]
    assert pipe.stopped


@pytest.mark.parametrize("step", STEPS)
def test_forced_named_call_prefix(tokenizer, step):
    out, _ = run(tokenizer, '{"q": "x"}}\n</tool_call>', step, tools=TOOLS,
                 prefix=forced_prefix("hermes", "lookup"))
    assert out == [("call", "lookup", {"q": "x"})]


@pytest.mark.parametrize("step", STEPS)
def test_a_call_the_output_is_cut_in_is_dropped(tokenizer, step):
    """Cut inside its second call by a stop string or max_tokens, the answer keeps its text and
    first call; had the model itself ended there, the unfinished block would be its own text."""
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    cut = '<tool_call>\n{"name": "lookup", "arguments": {"q": "'
    made = [("content", "Looking."), ("call", "lookup", {"q": "x"})]
    out, pipe = run(tokenizer, "Looking." + call + cut + 'STOP"}}\n</tool_call>', step, tools=TOOLS, stops=["STOP"])
    assert out == made and pipe.call_cut_off
    out, pipe = run(tokenizer, "Looking." + call + cut, step, length=True, tools=TOOLS)
    assert out == made and pipe.call_cut_off
    out, pipe = run(tokenizer, "Looking." + call + cut, step, tools=TOOLS)
    assert out == made + [("content", cut)] and not pipe.call_cut_off


def test_without_parsers_markup_is_plain_content(tokenizer):
    text = "<think>a</think><tool_call>b</tool_call>"
    out, _ = run(tokenizer, text, 1)
    assert out == [("content", text)]


def test_prompt_that_opened_the_think_block(tokenizer):
    out, _ = run(tokenizer, "hmm\n</think>\n\nyes", 2, split_reasoning=True, reasoning_open=True)
    assert out == [("reasoning", "hmm"), ("content", "yes")]


def test_stop_matcher_across_pieces_and_held_tail():
    m = StopMatcher(["END", "xyz"])
    assert m.feed("abc E") == "abc "
    assert m.feed("N") == ""
    assert m.feed("X") == "ENX"
    assert m.feed("...xy") == "..."
    assert m.finish() == "xy"
    m = StopMatcher(["bb", "ab"])
    assert m.feed("xab") == "x" and m.matched
    assert m.feed("more") == ""
    assert StopMatcher([]).feed("anything") == "anything"
    assert StopMatcher([""]).feed("empty stops are ignored") == "empty stops are ignored"


def test_held_suffix_len():
    assert held_suffix_len("abc<tool", ["<tool_call>"]) == 5
    assert held_suffix_len("abc", ["<tool_call>"]) == 0
    assert held_suffix_len("xx</th", ["<think>", "</think>"]) == 4
    assert held_suffix_len("abcd", ["abcd"]) == 0, "a whole marker is no proper prefix"


def test_held_suffix_len_is_the_longest_suffix_that_begins_a_marker():
    """Against its definition (every suffix length tried) on random texts and markers of a small
    alphabet, where suffixes and prefixes overlap often."""
    import random

    rng = random.Random(0)

    def word(n):
        return "".join(rng.choice("ab<") for _ in range(n))

    for _ in range(2000):
        text, markers = word(rng.randrange(0, 12)), [word(rng.randrange(0, 8)) for _ in range(rng.randrange(1, 4))]
        want = max([n for m in markers for n in range(1, min(len(m) - 1, len(text)) + 1)
                    if text.endswith(m[:n])], default=0)
        assert held_suffix_len(text, markers) == want, (text, markers)


def test_responses_output_items_and_event_order():
    """Reasoning, text and a function call become three output items, each opened and closed by
    the events Codex expects (the model cannot be made to call a tool, so this feeds deltas)."""
    builder = _OutputBuilder()
    call = ToolCall(id="call_x", name="lookup", arguments='{"q": "x"}')
    events = []
    for item in [TextDelta("reasoning", "plan"), TextDelta("reasoning", " more"), TextDelta("content", "Sure."),
                 call, Finish("tool_calls", Usage(3, 4))]:
        events.extend(builder.feed(item))
    assert [name for name, _ in events] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [p["output_index"] for _, p in events] == [0] * 5 + [1] * 6 + [2] * 4
    reasoning, message, function_call = builder.output
    assert reasoning["content"][0]["text"] == "plan more"
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert function_call == {"id": function_call["id"], "type": "function_call", "status": "completed",
                             "call_id": "call_x", "name": "lookup", "arguments": '{"q": "x"}'}
    added = events[11][1]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress"


ITEMS = [TextDelta("reasoning", "plan"), TextDelta("content", "Calling."),
         ToolCall(id="call_a", name="lookup", arguments='{"q": "a"}'),
         ToolCall(id="call_b", name="lookup", arguments='{"q": "b"}'), Finish("tool_calls", Usage(5, 7, 2))]


def test_chat_stream_chunks_carry_tool_calls_and_reasoning():
    async def items():
        for item in ITEMS:
            yield item

    async def run_chunks():
        return [c async for c in _chat_chunks(items(), {"id": "chatcmpl-1", "created": 1, "model": "m"}, True)]

    raw = asyncio.run(run_chunks())
    assert raw[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(c[len("data: "):])) for c in raw[:-1]]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert deltas[1].model_extra["reasoning_content"] == "plan"
    assert deltas[2].content == "Calling."
    first_a, args_a, first_b, args_b = (d.tool_calls[0] for d in deltas[3:7])
    assert (first_a.index, first_a.id, first_a.function.name, first_a.function.arguments) == (0, "call_a", "lookup", "")
    assert (args_a.index, args_a.id, args_a.function.arguments) == (0, None, '{"q": "a"}')
    assert (first_b.index, first_b.id, args_b.function.arguments) == (1, "call_b", '{"q": "b"}')
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 2


def test_chat_message_with_only_tool_calls_has_null_content():
    body = _chat_message([ITEMS[0], ITEMS[2], ITEMS[4]], {"id": "chatcmpl-1", "created": 1, "model": "m"})
    msg = ChatCompletion.model_validate(body).choices[0].message
    assert msg.content is None and msg.tool_calls[0].function.name == "lookup"
    assert msg.model_extra["reasoning_content"] == "plan"
    assert body["choices"][0]["finish_reason"] == "tool_calls"
