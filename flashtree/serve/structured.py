"""Structured output requests -> llguidance grammars, checked in the HTTP process.

Chat's `response_format` and Responses' `text.format` ask for JSON (`json_object`: any JSON
object) or JSON following a schema (`json_schema`). The grammar is compiled and validated here,
without the model's tokenizer (llguidance can), so a schema it cannot enforce is a 400 naming the
field before anything is queued; the worker only builds a matcher from the grammar text.

The JSON is compact with one space after `,` and `:` (as `json.dumps` writes it): flexible
whitespace would let a model pad its output with newlines forever, which small models do.
"""

from __future__ import annotations

from typing import Any, Optional

import llguidance

from .errors import ApiError
from .schemas import ResponseFormat

# llguidance's JSON options: compact separators, no free whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON following `schema`; 400 naming `param` when it cannot be enforced."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ApiError(400, f"{param} is not a usable JSON schema: {e}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(400, f"{param} cannot be enforced: {error}", param=param)
    return grammar


def format_grammar(fmt: Optional[ResponseFormat], param: str) -> Optional[str]:
    """The grammar `fmt` asks for (None for plain text). Chat nests the schema under
    `json_schema`, Responses' `text.format` holds it directly: `param` names where it was."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return schema_grammar(ANY_OBJECT, param)
    holder, where = (fmt.json_schema, f"{param}.json_schema") if fmt.json_schema is not None else (fmt, param)
    if holder.schema_ is None:
        raise ApiError(400, f"{where}.schema is required for type json_schema", param=f"{where}.schema")
    return schema_grammar(holder.schema_, f"{where}.schema")
