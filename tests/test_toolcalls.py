"""Tool-call parsers: both wire formats, typed XML values, malformed and undeclared calls left as
text, a call the output was cut in dropped, and the same result however the text is cut into
streamed pieces (every char and byte offset). JSON the model writes outside json_text's bounds (a
huge integer, a lone surrogate, NaN / Infinity, deep nesting) is text too, never an exception or a
call the wire cannot carry."""

import codecs
import json
import math
import random

import pytest

from flashtree.serve.json_text import MAX_DEPTH, JsonTextError, parse_json_text
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


def test_a_block_the_output_was_cut_in_is_dropped():
    """Cut by max_tokens or a stop string, a block is no call and not text; one that already
    parses is still the call."""
    done = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    for cut, expected in [('<tool_call>\n{"name": "get_weather", "argum', []),
                          (done, [("call", "get_weather", {"city": "Oslo"})])]:
        parser = ToolCallParser(TOOLS)
        pieces = parser.feed("Sure. " + cut) + parser.finish(cut=True)
        assert normalize(pieces) == [("text", "Sure.")] + expected
        assert parser.cut_off == (not expected)


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


# --- JSON a model writes is held to json_text's bounds ----------------------------------------
# A model can write anything; a block that json.loads alone would take but the server cannot send
# on (an int() past its digit limit, a lone surrogate, NaN / Infinity, a nesting the server
# refuses when the client sends the call back) is text, never an exception or invalid JSON.

HUGE = "9" * 5000  # more digits than int() converts (sys.get_int_max_str_digits() is 4300)


def nest(levels: int) -> str:
    return "[" * levels + "]" * levels


def hermes(arguments: str) -> str:
    return '<tool_call>\n{"name": "set_options", "arguments": ' + arguments + "}\n</tool_call>"


HOSTILE_HERMES = {
    "huge int": hermes('{"limit": ' + HUGE + "}"),
    "huge negative int": hermes('{"limit": -' + HUGE + "}"),
    "huge int in arguments as a string": hermes(json.dumps('{"limit": ' + HUGE + "}")),
    "lone high surrogate": hermes('{"note": "a\\ud800b"}'),
    "lone low surrogate in a key": hermes('{"\\udfff": 1}'),
    "lone surrogate in arguments as a string": hermes(json.dumps('{"note": "\\ud800"}')),
    "NaN": hermes('{"ratio": NaN}'),
    "Infinity": hermes('{"ratio": Infinity}'),
    "-Infinity": hermes('{"ratio": -Infinity}'),
    "a float past float's range": hermes('{"ratio": 1e999}'),
    "NaN in arguments as a string": hermes(json.dumps('{"ratio": NaN}')),
    "nested past MAX_DEPTH, within the recursion limit": hermes('{"tags": ' + nest(200) + "}"),
    "nested past the recursion limit": hermes('{"tags": ' + nest(100_000) + "}"),
}


def assert_wire_safe(pieces) -> None:
    """What a surface would send: text with a UTF-8 form, arguments that strict JSON reads."""
    def refuse(name):
        raise AssertionError(f"{name} in arguments")
    for piece in pieces:
        if isinstance(piece, ToolCall):
            json.loads(piece.arguments.encode("utf-8"), parse_constant=refuse)
        else:
            piece.encode("utf-8")


def run_checked(text_pieces, fmt="hermes"):
    parser = ToolCallParser(TOOLS, fmt)
    out = [p for piece in text_pieces for p in parser.feed(piece)] + parser.finish()
    assert_wire_safe(out)
    return normalize(out)


def cuts(text):
    """The ways the tests cut a text into streamed pieces: whole, at 3 random points, one char
    at a time around the block's tags (the whole text char by char when it is short)."""
    rng = random.Random(len(text))
    points = sorted(rng.sample(range(1, len(text)), 3))
    yield [text]
    yield [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    yield list(text) if len(text) < 2000 else list(text[:40]) + [text[40:-40]] + list(text[-40:])


@pytest.mark.parametrize("name", HOSTILE_HERMES)
def test_a_hermes_block_outside_the_bounds_is_text(name):
    text = HOSTILE_HERMES[name]
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>'
    for pieces in cuts("Trying. " + text + "\n" + good):
        assert run_checked(pieces) == [("text", "Trying. " + text), ("call", "get_weather", {"days": 2})]
    unterminated = text.removesuffix("</tool_call>")  # finish() parses it the same way
    assert run_checked([unterminated]) == [("text", unterminated)]


def xml(parameter: str, value: str) -> str:
    return (f"<tool_call>\n<function=set_options>\n<parameter={parameter}>\n{value}\n</parameter>\n"
            "</function>\n</tool_call>")


HOSTILE_XML_VALUES = {
    "huge integer": ("limit", HUGE),
    "huge number": ("ratio", HUGE),
    "float past float's range": ("ratio", "1e999"),
    "NaN in an object": ("extra", '{"k": NaN}'),
    "Infinity in an array": ("tags", "[1, Infinity]"),
    "lone surrogate in an object": ("extra", '{"k": "\\ud800"}'),
    "huge int in an array": ("tags", "[" + HUGE + "]"),
    "array nested past MAX_DEPTH": ("tags", nest(200)),
}


@pytest.mark.parametrize("name", HOSTILE_XML_VALUES)
def test_a_qwen3_coder_value_outside_the_bounds_keeps_its_text(name):
    """As any value that is not of its schema's type: the call stands, the value is the text."""
    key, value = HOSTILE_XML_VALUES[name]
    for pieces in cuts(xml(key, value)):
        assert run_checked(pieces, "qwen3_coder") == [("call", "set_options", {key: value})]


def test_bounds_on_depth_are_a_clients_bounds():
    """The server refuses a client's arguments nested deeper than MAX_DEPTH levels (json_text),
    so a call the model writes is held to the same: else the client's next turn would be
    refused. Arguments sent as a string, and a Qwen3-Coder value under its key, nest to exactly
    the client's limit; arguments written inline are bounded with their block, one level less."""
    def tags(levels):  # arguments nesting 1 + levels deep
        return '{"tags": ' + nest(levels) + "}"

    def call(levels):
        return [("call", "set_options", json.loads(tags(levels)))]

    assert run_checked([hermes(json.dumps(tags(MAX_DEPTH - 1)))]) == call(MAX_DEPTH - 1)
    assert run_checked([hermes(json.dumps(tags(MAX_DEPTH)))]) == [("text", hermes(json.dumps(tags(MAX_DEPTH))))]
    assert run_checked([hermes(tags(MAX_DEPTH - 2))]) == call(MAX_DEPTH - 2)
    assert run_checked([hermes(tags(MAX_DEPTH - 1))]) == [("text", hermes(tags(MAX_DEPTH - 1)))]
    assert run_checked([xml("tags", nest(MAX_DEPTH - 1))], "qwen3_coder") == call(MAX_DEPTH - 1)
    assert run_checked([xml("tags", nest(MAX_DEPTH))], "qwen3_coder") == [("text", xml("tags", nest(MAX_DEPTH)))]


def test_the_json_text_bound_on_nan_is_asked_for():
    """allow_nan=False refuses what json.dumps(allow_nan=False) would; the default keeps what a
    client sends as it was; strict=False takes a raw tab, as json.loads does."""
    for text in ("NaN", "[Infinity]", '{"a": -Infinity}', "1e999", "-1e400"):
        with pytest.raises(JsonTextError):
            parse_json_text(text, allow_nan=False)
    assert parse_json_text("[1e308, -0.5, 2]", allow_nan=False) == [1e308, -0.5, 2]
    assert math.isnan(parse_json_text("NaN"))
    assert parse_json_text('"a\tb"', strict=False) == "a\tb"
    with pytest.raises(json.JSONDecodeError):
        parse_json_text('"a\tb"')
