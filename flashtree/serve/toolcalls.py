"""Tool-call extraction from generated text, incremental and streaming-safe.

Two wire formats cover the Qwen family and its imitators:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``
  (Qwen3-Coder), whose values are plain text and are coerced to the JSON-schema type of the
  declared parameter.

Agent clients break when tool-call markup leaks into ``content`` or when a streamed call is lost,
so the parser holds back any text that could still become a ``<tool_call>`` tag and only ever
releases a call once its whole block has been seen. A block that does not parse, or names a
function the request did not declare, is handed back verbatim as text: a model's mistake must
reach the client as output, never as a 500. A block that does not parse because the output was
cut in it (max_tokens, a stop string) is not the model's mistake, and is dropped instead
(ToolCallParser.finish).

"Parses" means within json_text's bounds, read with allow_nan=False: the JSON a model writes goes
through json_text.parse_json_text, as the JSON a client sends does. A model can write anything
(a tiny model, a hostile fine-tune), and json.loads alone fails on, or takes, what the server
cannot send on: an integer of more digits than int() converts (a ValueError), an escaped lone
surrogate (`"\\ud800"`, text with no UTF-8 form), NaN / Infinity / 1e999 (refused by the
allow_nan=False serializers of the answers, and not JSON to a client), or a nesting the server
itself refuses when the client sends the call back. A hermes block holding any of these is text,
like any block that does not parse; a Qwen3-Coder value holding one keeps its text, like any value
that is not of its schema's type. Either way what is released is the text the model wrote, which
has a UTF-8 form whatever it says.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from .holdback import held_suffix_len
from .json_text import first_problem, parse_json_text

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
FORMATS = ("hermes", "qwen3_coder")

_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INT_RE = re.compile(r"\A[+-]?\d+\Z")
_MISSING = object()


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object serialized as text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


Piece = Union[str, ToolCall]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def detect_format(chat_template: Optional[str]) -> str:
    """Which format the checkpoint's template teaches the model (hermes when it does not say)."""
    if chat_template and "<function=" in chat_template:
        return "qwen3_coder"
    return "hermes"


def forces_call(choice: Optional[str]) -> bool:
    """Whether `tool_choice` (None, "auto", "none", "required" or a function name) makes the
    answer a tool call: "required" and a named function do."""
    return choice not in (None, "auto", "none")


def forced_prefix(fmt: str, function_name: Optional[str]) -> str:
    """Text that opens a tool call, appended to the prompt so the model has to complete a call.

    With a name, the prefix also commits to that function (OpenAI's named `tool_choice`)."""
    if fmt == "qwen3_coder":
        return f"{OPEN_TAG}\n" + (f"<function={function_name}>\n" if function_name else "")
    if function_name:
        return f"{OPEN_TAG}\n" + '{"name": ' + json.dumps(function_name) + ', "arguments": '
    return f"{OPEN_TAG}\n"


def declared_functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Map of function name -> JSON schema of its parameters, from OpenAI-style `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str):
            params = fn.get("parameters")
            out[name] = params if isinstance(params, dict) else {}
    return out


def _generated_json(text: str, strict: bool = True) -> Any:
    """The value of JSON text the model wrote, or _MISSING when it is not JSON or is outside
    json_text's bounds (allow_nan=False: see the module's docstring)."""
    try:
        return parse_json_text(text, strict=strict, allow_nan=False)
    except ValueError:  # json.JSONDecodeError and json_text.JsonTextError alike
        return _MISSING


def _parse_hermes(block: str, functions: dict[str, dict[str, Any]]) -> Optional[tuple[str, dict]]:
    """A `{"name", "arguments"}` call, or None. Control characters inside strings are accepted
    (strict=False): models write a raw tab or newline into an argument, and the embedded model's
    Claude Code call `{"command": "echo 'cloud tiger ket<TAB>' >> draft.csv"}` came back as text.
    The whole block is held to the bounds, so arguments written inline nest one level less than
    arguments sent as a string: stricter than a client's, never looser."""
    obj = _generated_json(block, strict=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _generated_json(args, strict=False)
    if not isinstance(args, dict) or obj["name"] not in functions:
        return None
    return obj["name"], args


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            out.extend(_schema_types(option))
    return out


def _int(text: str) -> Any:
    """int(text), or _MISSING when it has more digits than int() converts (its ValueError)."""
    try:
        return int(text)
    except ValueError:
        return _MISSING


def _coerce_one(text: str, kind: str) -> Any:
    """`text` as a value of JSON-schema type `kind`, or _MISSING when it is not one. A number is
    finite, an integer within int()'s digit limit, an object or array within json_text's bounds
    (see the module's docstring)."""
    stripped = text.strip()
    if kind == "string":
        return text
    if kind == "integer" and _INT_RE.match(stripped):
        return _int(stripped)
    if kind == "number":
        value = _int(stripped) if _INT_RE.match(stripped) else _MISSING
        if value is not _MISSING:
            return value
        try:
            value = float(stripped)  # an integer past int()'s limit reads as inf here, refused below
        except ValueError:
            return _MISSING
        return value if value == value and abs(value) != float("inf") else _MISSING
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind == "null" and stripped.lower() in ("null", "none"):
        return None
    if kind in ("object", "array"):
        value = _generated_json(stripped)
        if isinstance(value, dict if kind == "object" else list):
            return value
    return _MISSING


def coerce_value(text: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter value typed by its schema; untyped or unparsable values stay text.
    Of several allowed types the specific ones are tried first: "string" accepts anything."""
    for kind in sorted(_schema_types(schema), key=lambda k: k == "string"):
        value = _coerce_one(text, kind)
        if value is not _MISSING:
            return value
    return text


def _parse_xml(block: str, functions: dict[str, dict[str, Any]]) -> Optional[tuple[str, dict]]:
    match = _FUNCTION_RE.match(block)
    if not match:
        return None
    name, body = match.group(1).strip(), match.group(2)
    if name not in functions:
        return None
    if _PARAM_RE.sub("", body).strip():
        return None  # stray text between parameters: not a well-formed call
    props = functions[name].get("properties") or {}
    args: dict[str, Any] = {}
    for key, raw in _PARAM_RE.findall(body):
        key = key.strip()
        # the template writes each value between newlines; those are framing, not content
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        args[key] = coerce_value(value, props.get(key) if isinstance(props, dict) else None)
    return name, args


def parse_block(block: str, fmt: str, functions: dict[str, dict[str, Any]]) -> Optional[ToolCall]:
    """The call inside one `<tool_call>` block (tags excluded), or None when it is not valid.

    The arguments are checked against json_text's bounds once more as a whole, as a client's
    arguments would be: Qwen3-Coder values are bounded one by one, and a value nested exactly
    MAX_DEPTH deep is one level too deep under its argument's key."""
    parsed = (_parse_xml if fmt == "qwen3_coder" else _parse_hermes)(block, functions)
    if parsed is None or first_problem(parsed[1]) is not None:
        return None
    name, args = parsed
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits a growing text into plain text and ToolCalls; feed() pieces, then finish().

    The output does not depend on how the text was cut into pieces. Whitespace that only
    separates text from calls (or calls from each other) is dropped, the way OpenAI returns
    `content: null` next to tool calls."""

    def __init__(self, tools: list[dict[str, Any]], fmt: str = "hermes"):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self._functions = declared_functions(tools)
        self._fmt = fmt
        self._buf = ""
        self._in_call = False
        self._held_space = ""
        self._after_call = False
        self.calls_seen = 0
        self.cut_off = False  # finish() dropped a call the output was cut in

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    return out
                block, self._buf = self._buf[:end], self._buf[end + len(CLOSE_TAG):]
                self._in_call = False
                self._emit_block(block, out, closed=True)
            else:
                start = self._buf.find(OPEN_TAG)
                if start < 0:
                    keep = held_suffix_len(self._buf, (OPEN_TAG,))
                    self._emit_text(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._emit_text(self._buf[:start], out)
                self._buf = self._buf[start + len(OPEN_TAG):]
                self._in_call = True

    def finish(self, cut: bool = False) -> list[Piece]:
        """Flush: an unterminated block still counts when it parses (models sometimes stop right
        before the closing tag); otherwise everything left is text, except a block the output was
        `cut` in (by max_tokens or a stop string), which is dropped with the whitespace before it
        (as before a call) and sets `cut_off`: a call cut short is no call (its arguments are not
        JSON, and half a command must not run), and its markup is not the model's answer. A block
        the model itself left unfinished is its mistake, and stays text like a closed block that
        does not parse."""
        out: list[Piece] = []
        if self._in_call:
            self._emit_block(self._buf, out, closed=False, cut=cut)
        else:
            self._emit_text(self._buf, out)
        self._buf, self._in_call = "", False
        if self._held_space and not self.calls_seen and not self.cut_off:
            out.append(self._held_space)
        self._held_space = ""
        return out

    def _emit_block(self, block: str, out: list[Piece], closed: bool, cut: bool = False) -> None:
        call = parse_block(block, self._fmt, self._functions)
        if call is None and cut:
            self.cut_off = True
            return
        if call is None:
            self._emit_text(OPEN_TAG + block + (CLOSE_TAG if closed else ""), out)
            return
        self._held_space = ""
        self._after_call = True
        self.calls_seen += 1
        out.append(call)

    def _emit_text(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._held_space += text
            return
        joined = self._held_space + body
        out.append(joined.lstrip() if self._after_call else joined)
        self._held_space, self._after_call = text[len(body):], False
