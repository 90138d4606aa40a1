"""Tool-call parsers: both wire formats, typed XML values, malformed and undeclared calls left as
text, and the same result however the text is cut into streamed pieces (every char and byte
offset)."""

import codecs
import json
import random

import pytest

from flashtree.serve.toolcalls import (ToolCall, ToolCallParser, coerce_value, declared_functions,
                                       detect_format, forced_prefix)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "set_options", "parameters": {
        "type": "object", "properties": {
            "ratio": {"type": "number"}, "enabled": {"type": "boolean"},
            "tags": {"type": "array"}, "extra": {"type": "object"},
            "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
]


def run(text_pieces, fmt="hermes", tools=TOOLS):
    parser = ToolCallParser(tools, fmt)
    out = []
    for piece in text_pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return normalize(out)


def normalize(pieces):
    """Merge adjacent text; calls as (name, parsed arguments) since ids are random."""
    out = []
    for p in pieces:
        if isinstance(p, ToolCall):
            assert p.id.startswith("call_")
            out.append(("call", p.name, json.loads(p.arguments)))
        elif out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + p)
        else:
            out.append(("text", p))
    return out


HERMES_TWO_CALLS = (
    "Let me check both.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Z\u00fcrich \u2603\", \"days\": 3}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"set_options\", \"arguments\": \"{\\\"ratio\\\": 0.5}\"}\n</tool_call>\n")
HERMES_EXPECTED = [("text", "Let me check both."),
                   ("call", "get_weather", {"city": "Z\u00fcrich \u2603", "days": 3}),
                   ("call", "set_options", {"ratio": 0.5})]

XML_CALL = (
    "<tool_call>\n<function=set_options>\n<parameter=ratio>\n2.5\n</parameter>\n"
    "<parameter=enabled>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
    "<parameter=extra>\n{\"k\": 1}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "<parameter=limit>\n7\n</parameter>\n<parameter=free>\nline one\nline two\n</parameter>\n"
    "</function>\n</tool_call>\nDone, \u4f60\u597d.")
XML_EXPECTED = [("call", "set_options", {"ratio": 2.5, "enabled": True, "tags": ["a", "b"], "extra": {"k": 1},
                                         "note": None, "limit": 7, "free": "line one\nline two"}),
                ("text", "Done, \u4f60\u597d.")]


def test_hermes_several_calls_with_text():
    assert run([HERMES_TWO_CALLS]) == HERMES_EXPECTED


def test_qwen3_coder_values_are_typed_by_schema():
    assert run([XML_CALL], fmt="qwen3_coder") == XML_EXPECTED


@pytest.mark.parametrize("fmt,text,expected", [
    ("hermes", HERMES_TWO_CALLS, HERMES_EXPECTED),
    ("qwen3_coder", XML_CALL, XML_EXPECTED),
])
def test_every_split_point_gives_the_same_result(fmt, text, expected):
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], fmt) == expected, cut
    assert run(list(text), fmt) == expected
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert run(pieces, fmt) == expected


@pytest.mark.parametrize("fmt,text,expected", [
    ("hermes", HERMES_TWO_CALLS, HERMES_EXPECTED),
    ("qwen3_coder", XML_CALL, XML_EXPECTED),
])
def test_every_byte_offset_through_an_incremental_utf8_decoder(fmt, text, expected):
    data = text.encode()
    for cut in range(len(data) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        pieces = [dec.decode(data[:cut]), dec.decode(data[cut:], final=True)]
        assert run(pieces, fmt) == expected, cut


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # undeclared
    ("hermes", '<tool_call>\n["get_weather"]\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'),
    ("hermes", '<tool_call>' + "[" * 100000 + '</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray <parameter=city>\nX\n</parameter>\n</function>\n</tool_call>"),
])
def test_malformed_or_undeclared_calls_stay_text(fmt, text):
    assert run([text], fmt) == [("text", text)]
    assert run(list(text[:200]) + [text[200:]], fmt) == [("text", text)]


def test_raw_control_characters_inside_strings_are_accepted():
    """Models write a raw tab or newline inside an argument; strict JSON would return the call as text."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo\tNorway\nnorth"}}\n</tool_call>'
    assert run([text]) == [("call", "get_weather", {"city": "Oslo\tNorway\nnorth"})]
    assert run(list(text)) == [("call", "get_weather", {"city": "Oslo\tNorway\nnorth"})]


def test_unterminated_block_counts_only_if_it_parses():
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert run([good]) == [("call", "get_weather", {"city": "Oslo"})]
    cut = '<tool_call>\n{"name": "get_weather", "argum'
    assert run([cut]) == [("text", cut)]


def test_text_that_only_looks_like_a_tag_is_released():
    text = "a <tool> and <tool_ca and <toolbox> end <tool_cal"
    assert run([text]) == [("text", text)]
    assert run(list(text)) == [("text", text)]


def test_no_tools_declared_means_no_call_is_valid():
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert run([text], tools=[]) == [("text", text)]


def test_forced_prefix_completes_to_the_named_call():
    for fmt, rest in [("hermes", '{"city": "Rome"}}\n</tool_call>'),
                      ("qwen3_coder", "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")]:
        prefix = forced_prefix(fmt, "get_weather")
        assert run([prefix, rest], fmt) == [("call", "get_weather", {"city": "Rome"})]
        assert forced_prefix(fmt, None) == "<tool_call>\n"


def test_coerce_value_falls_back_to_text():
    assert coerce_value("12", {"type": "integer"}) == 12
    assert coerce_value("1.5e3", {"type": "number"}) == 1500.0
    assert coerce_value("twelve", {"type": "integer"}) == "twelve"
    assert coerce_value("nan", {"type": "number"}) == "nan"
    assert coerce_value("yes", {"type": "boolean"}) == "yes"
    assert coerce_value("{bad", {"type": "object"}) == "{bad"
    assert coerce_value(" 3 ", {}) == " 3 "


def test_detect_format_and_declared_functions():
    assert detect_format("... <tool_call>\n<function=name> ...") == "qwen3_coder"
    assert detect_format("... <tool_call> {json} ...") == "hermes"
    assert detect_format(None) == "hermes"
    assert set(declared_functions(TOOLS)) == {"get_weather", "set_options"}
    with pytest.raises(ValueError):
        ToolCallParser(TOOLS, "nonsense")
