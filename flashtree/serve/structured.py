"""Structured output requests -> llguidance grammars, checked in the HTTP process.

Chat's `response_format` and Responses' `text.format` ask for JSON (`json_object`: any JSON
object) or JSON following a schema (`json_schema`). The grammar is compiled here and checked in
the template sandbox's processes (`check`: TemplateSandbox.check_grammar, bounded in time, since
some schemas take hours to check), without the model's tokenizer (llguidance can), so a schema it
cannot enforce is a 400 naming the field before anything is queued; the worker only builds a
matcher from the grammar text.

Tool calls get a grammar too (hermes format only) when a tool is declared with `strict: true`
(a strict function's arguments follow its schema) and when `tool_choice` forces a call (the
answer is then only calls, whose arguments are any JSON object unless the function is strict).

The JSON is compact with one space after `,` and `:` (as `json.dumps` writes it): flexible
whitespace would let a model pad its output with newlines forever, which small models do.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import llguidance
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from .errors import ApiError
from .schemas import ResponseFormat
from .toolcalls import CLOSE_TAG, OPEN_TAG, forces_call

# llguidance's JSON options: compact separators, no free whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# (a grammar, whether its first byte is asked for too: start_error) -> llguidance's error, or None
GrammarCheck = Callable[[str, bool], Optional[str]]


def schema_grammar(schema: Any, param: str, check: GrammarCheck) -> str:
    """The grammar of JSON following `schema`; 400 naming `param` when it cannot be enforced."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ApiError(400, f"{param} is not a usable JSON schema: {e}", param=param) from None
    error = check(grammar, True)
    if error:
        raise ApiError(400, f"{param} cannot be enforced: {error}", param=param)
    return grammar


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer whose tokens are the 256 bytes and an end token: what start_error walks."""
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {"<end>": len(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=len(vocab), eos_token=len(alphabet))


def start_error(grammar: str) -> Optional[str]:
    """Why `grammar` cannot begin an answer, or None. A schema that no JSON value satisfies (one
    that is only a reference to itself) passes llguidance's validation and fails at the first
    mask; a strict tool's would fail only once the model opens a call to it, after the answer's
    first tokens went out. Its first mask over single bytes says so before anything runs, with
    no model's tokenizer."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        mask = matcher.compute_bitmask()
        if not matcher.is_error():
            return None if any(mask) else "no byte may begin it"
    reason = matcher.get_error().splitlines()[0]
    return "no JSON value satisfies it" if reason == "NoExtensionBias" else reason


def format_grammar(fmt: Optional[ResponseFormat], param: str, check: GrammarCheck) -> Optional[str]:
    """The grammar `fmt` asks for (None for plain text). Chat nests the schema under
    `json_schema`, Responses' `text.format` holds it directly: `param` names where it was."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return schema_grammar(ANY_OBJECT, param, check)
    holder, where = (fmt.json_schema, f"{param}.json_schema") if fmt.json_schema is not None else (fmt, param)
    if holder.schema_ is None:
        raise ApiError(400, f"{where}.schema is required for type json_schema", param=f"{where}.schema")
    return schema_grammar(holder.schema_, f"{where}.schema", check)


@dataclass(frozen=True)
class RequestGrammar:
    """A request's grammar and the field it came from: the param of its errors, those the worker
    meets while decoding included."""

    text: str
    param: str


@dataclass
class ToolSpec:
    """A declared function as the tool grammar needs it; `param` names its schema's field."""

    name: str
    parameters: Optional[dict[str, Any]]
    strict: bool
    param: str


def _json(schema: dict[str, Any]) -> str:
    """`schema` inlined in a Lark grammar, compact like every JSON answer."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _call_tags(ctx: Any, strict: bool) -> Optional[tuple[int, int]]:
    """The token ids of OPEN_TAG and CLOSE_TAG, which a tool grammar needs, or None when this
    model cannot have one: strict tools are then a 400 (`strict` promises enforcement), a call
    that is only forced stays forced by the prompt alone (as it was before grammars existed)."""
    ids = [ctx.tokenizer.token_to_id(tag) for tag in (OPEN_TAG, CLOSE_TAG)]
    if ctx.tool_format == "hermes" and None not in ids:
        return ids[0], ids[1]
    if not strict:
        return None
    if ctx.tool_format != "hermes":
        raise ApiError(400, f"strict tools are not supported yet with this model's tool-call format "
                            f"({ctx.tool_format}): remove `strict`", code="unsupported_parameter", param="tools")
    raise ApiError(400, f"strict tools need {OPEN_TAG} and {CLOSE_TAG} to be tokens of this model's "
                        "vocabulary: remove `strict`", code="unsupported_parameter", param="tools")


def _calls_json(arguments: dict[str, dict[str, Any]]) -> str:
    """The JSON of one call (`{"name": ..., "arguments": ...}`) to any function of `arguments`."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": schema}} for name, schema in arguments.items()]
    return _json({"anyOf": calls})


def tools_grammar(ctx: Any, tools: list[ToolSpec], choice: Optional[str],
                  max_calls: Optional[int] = None) -> Optional[str]:
    """The grammar of an answer with tool calls: when a tool is `strict`, or when `tool_choice`
    forces a call ("required" or a named function), strict or not (None otherwise). The calls
    are hermes blocks (`<tool_call>\n` JSON `\n</tool_call>`); the arguments of a strict
    function follow its `parameters`, those of the others are any JSON object.

    Unforced, the answer is free text and calls. Forced, the prompt already opened the first
    call (prompting.chat_prompt: after `<tool_call>\n`, or after `"arguments": ` of the named
    function) and the grammar starts inside it: the answer is that call and, unless `max_calls`
    is 1 (`parallel_tool_calls: false`), more calls after a newline, as the template writes
    them, then the end; no text. A weak model left to the prompt alone writes a block that is
    no call (it opens `<tool_call>` again inside the one opened for it), and a client that forced
    a call must get one. "required" lets every call name any of the request's functions, a
    named choice only that function (also in later calls: the client chose it). The caller has
    checked that a named function is among `tools` (chat_prompt's 400)."""
    strict = any(t.strict for t in tools)
    if choice == "none" or not (strict or forces_call(choice)):
        return None
    tags = _call_tags(ctx, strict)
    if tags is None:
        return None
    opened, closed = tags
    arguments = {}
    for tool in tools:
        schema = tool.parameters if tool.strict and tool.parameters is not None else ANY_OBJECT
        if tool.strict:
            schema_grammar(schema, tool.param, ctx.templates.check_grammar)  # a 400 naming this tool's field
        arguments[tool.name] = schema
    close, more = f"\"\\n\" <[{closed}]>", "" if max_calls == 1 else " (\"\\n\" call)*"
    allowed = arguments
    if not forces_call(choice):
        rules = ["start: free (call free)*", f"free: <[^{opened}]>*"]
    elif choice == "required":
        rules = [f"start: body {close}{more}"]
    else:  # the prompt ends after `"arguments": ` of the named function
        rules = [f"start: args \"}}\" {close}{more}", f"args: {_json(arguments[choice])}"]
        allowed = {choice: arguments[choice]}
    rules += [f"call: <[{opened}]> \"\\n\" body {close}", f"body: {_calls_json(allowed)}"]
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")
    error = ctx.templates.check_grammar(grammar)
    if error:
        raise ApiError(400, f"the tools cannot be enforced together: {error}", param="tools")
    return grammar


def request_grammar(ctx: Any, answer: Optional[str], param: str, tools: list[ToolSpec], choice: Optional[str],
                    max_calls: Optional[int]) -> Optional[RequestGrammar]:
    """The request's grammar: of its answer (`param`'s format) or of its tool calls
    (tools_grammar), not both. When a call is forced the answer is only calls, and `param`'s
    format has no text to apply to (an agent loop may send it on every turn), so the calls'
    grammar is the one; otherwise asking for both is a 400 (one grammar cannot hold free text and
    calls following their schemas yet)."""
    calls = tools_grammar(ctx, tools, choice, max_calls)
    if forces_call(choice) and calls is not None:
        return RequestGrammar(calls, "tools")
    if answer is not None and calls is not None:
        raise ApiError(400, f"structured output (`{param}`) together with strict tools is not supported "
                            f"yet: remove `{param}` or `strict`", code="unsupported_parameter", param=param)
    if answer is not None:
        return RequestGrammar(answer, param)
    return RequestGrammar(calls, "tools") if calls is not None else None
