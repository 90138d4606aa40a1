"""Bounds on the JSON a request carries, and the one parser of JSON text sent inside a request.

A request's values go on to code less forgiving than the JSON decoder: the chat template (Jinja
recurses through a value to print it), the content shield (prompt_tokens, recursive too), the
tokenizer (a string with a lone UTF-16 surrogate has no UTF-8 form, so no tokenizer takes it) and
int() (CPython refuses to convert an integer of more digits than sys.get_int_max_str_digits()).
Each would fail with a 500 on a value a client can send, so every value is held to bounds that
keep all of them safe, and a value outside them is refused with a 400 naming where it is:

- arrays and objects nest at most MAX_DEPTH levels;
- every string, object keys included, is valid Unicode (no lone surrogate);
- JSON text that a client sends as a string (tool-call `arguments`) holds no integer of more
  digits than int() converts, and its value is held to the two bounds above as well.

api_common holds a request's body to the first two before its route runs (first_problem), and a
route each field of JSON text to all three (api_common.check_json_text, with parse_json_text,
which is also how the prompt's rendering reads that text).

The model's own tool calls (toolcalls.py) are JSON text too, written by a model that can write
anything, and read by the same parser with one more bound (allow_nan=False): no NaN, Infinity or
number too large for a float. json.loads takes those, but the server writes its answers with
allow_nan=False (a JSON client cannot read them), so a call holding one would fail as a 500 or
break a stream; and a call outside the other bounds is one the server would refuse when the client
sends it back on the next turn.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Optional

# Deeper than any tool schema or arguments a client really sends, and shallow enough that the
# recursive walks over a request (the shield's, Jinja's, json.dumps') stay far below Python's
# recursion limit, which is what a deeper value would reach.
MAX_DEPTH = 128
SHOWN_LEVELS = 8  # the first levels of a too deep value's path that an error names
TOO_DEEP = f"nests deeper than {MAX_DEPTH} levels of arrays and objects"
NOT_FINITE = "is NaN or infinite (NaN, Infinity, or a number past a float's range such as 1e400), which JSON answers cannot hold"

__all__ = ["MAX_DEPTH", "JsonTextError", "decode_bounded", "first_problem", "parse_json_text", "path_text"]


class JsonTextError(ValueError):
    """JSON text outside the bounds; the message says where in the JSON, and which bound."""


def path_text(loc: tuple[str, ...]) -> str:
    """A value's path as errors name it (`messages.1.content`)."""
    return ".".join(loc)


def first_problem(value: Any, finite: bool = False) -> Optional[tuple[tuple[str, ...], str]]:
    """The path of the first string of `value` holding a lone surrogate, of the first array or
    object nested deeper than MAX_DEPTH (cut to its first SHOWN_LEVELS levels), or with `finite`
    of the first number that is NaN or infinite, with what is wrong there; None when `value` is
    within the bounds. Walked with a stack, not recursion: a decoded value nests as deep as its
    sender liked. Keys are checked before the values under them, so a path never holds a key
    that is not valid text."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, (dict, list)) and len(loc) >= MAX_DEPTH:
            return loc[:SHOWN_LEVELS], TOO_DEEP
        if isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack += [(child, loc + (key,)), (key, loc)]
        elif isinstance(item, list):
            stack += [(child, loc + (str(i),)) for i, child in reversed(list(enumerate(item)))]
        elif finite and isinstance(item, float) and not math.isfinite(item):
            return loc, NOT_FINITE
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return loc, (f"text is not valid Unicode: a lone surrogate U+{ord(item[e.start]):04X} "
                             f"at character {e.start}")
    return None


def count_containers(value: Any) -> int:
    """The objects and arrays of a decoded JSON value, walked with a stack (not recursion)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            count += 1
            stack.extend(item)
    return count


def _bounded_int(digits: str) -> int:
    limit = sys.get_int_max_str_digits()
    count = len(digits.lstrip("-"))
    if limit and count > limit:
        raise JsonTextError(f"holds an integer of {count} digits, more than the {limit} this server takes")
    return int(digits)


def _no_constant(name: str) -> float:
    raise JsonTextError(f"holds {name}, which JSON has no number for")


def _finite_float(digits: str) -> float:
    value = float(digits)  # a number past float's range reads as inf: no error of its own
    if not math.isfinite(value):
        raise JsonTextError(f"holds a number too large for a float ({digits[:24]}...)")
    return value


def decode_bounded(text: str | bytes, *, strict: bool = True, allow_nan: bool = True) -> Any:
    """json.loads of `text` with the decoder's own bounds: no integer of more digits than int()
    converts, nesting within the recursion limit (deeper is past MAX_DEPTH too), and with
    `allow_nan=False` no NaN, Infinity or number that overflows a float (1e999). JsonTextError
    saying which bound (not where: the decoder does not know), json.JSONDecodeError (another
    ValueError) for text that is not JSON."""
    hooks: dict[str, Any] = {} if allow_nan else {"parse_constant": _no_constant, "parse_float": _finite_float}
    try:
        return json.loads(text, strict=strict, parse_int=_bounded_int, **hooks)
    except RecursionError:
        raise JsonTextError(TOO_DEEP) from None


def parse_json_text(text: str, *, strict: bool = True, allow_nan: bool = True) -> Any:
    """The value of the JSON text `text`; JsonTextError when it is outside the bounds, and
    json.JSONDecodeError (another ValueError) when it is not JSON at all. The decoder meets a
    nesting deeper than the recursion limit as a RecursionError, which is deeper than MAX_DEPTH
    too, so it is that bound's error.

    `strict=False` takes raw control characters inside strings, as json.loads does. With
    `allow_nan=False`, NaN, Infinity, -Infinity and a number that overflows a float (1e999) are
    outside the bounds too: json.dumps(allow_nan=False), how answers are written, refuses them."""
    try:
        value = decode_bounded(text, strict=strict, allow_nan=allow_nan)
    except JsonTextError as e:
        raise JsonTextError(f"the JSON: {e}") from None
    problem = first_problem(value)
    if problem is None:
        return value
    loc, what = problem
    where = f" at {path_text(loc)}" if loc and what != TOO_DEEP else ""  # a depth's path says nothing
    raise JsonTextError(f"the JSON{where}: {what}")
