"""A request body that failed validation, said as one line naming the field at fault.

Pydantic reports a field of several accepted forms (a message's `content`: a string or a list of
parts) once per form, each error's location carrying the form's label (`content.str`,
`content.list[TextPart].0.type`). The first of them is the least useful: "content.str: Input
should be a valid string" for a list holding an image part. So the path of each error is walked
through the body itself, keeping only the keys and indices the body has (a form's label is
neither), and the error reported is the one that reached deepest into the body: there the request
and every accepted form part ways. Several forms refusing the same value at the same place (an
item's `type`) are merged into one list of what is accepted, with the value that was found,
quoted as every error message quotes a value the client sent (errors.quoted).
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

from .errors import ApiError, quoted

# part and block types of other modalities: their refusal says why, not only what is accepted
NOT_TEXT = {"image", "image_url", "input_image", "input_audio", "audio", "file", "input_file", "document",
            "video", "video_url"}


def _body_path(loc: tuple[Any, ...], body: Any, missing_key: bool) -> list[Any]:
    """The keys and indices of `loc` that lead through `body`; the last step of a missing field
    (a key the body lacks by definition) is kept too."""
    path: list[Any] = []
    value = body
    for n, step in enumerate(loc):
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        elif not (missing_key and n == len(loc) - 1 and isinstance(value, dict)):
            continue  # a union member's label
        path.append(step)
    return path


def _accepted(errors: list[dict[str, Any]]) -> str:
    """What several literal errors at one place accept, together: 'a', 'b' or 'c'."""
    expected: list[str] = []
    for e in errors:
        for option in str((e.get("ctx") or {}).get("expected", "")).replace(" or ", ", ").split(", "):
            if option and option not in expected:
                expected.append(option)
    return expected[0] if len(expected) == 1 else ", ".join(expected[:-1]) + " or " + expected[-1]


def validation_error(exc: RequestValidationError) -> ApiError:
    """The problem of a request body that reaches deepest into it, as `field.path: what is wrong,
    found value`, `param` the path."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return ApiError(400, "request body is not valid JSON" + (f": {detail}" if detail else ""))
    body = {"body": getattr(exc, "body", None)}
    paths = [[str(p) for p in _body_path(tuple(e.get("loc", ())), body, e.get("type") == "missing")
              if p != "body"] for e in errors]
    if not paths or not max(paths, key=len):
        return ApiError(400, "the request body must be a JSON object (Content-Type: application/json)")
    deepest = max(paths, key=len)
    here = [e for e, p in zip(errors, paths) if p == deepest]
    chosen = [e for e in here if e.get("type") != "missing"] or here
    kinds = {e.get("type", "") for e in chosen}
    if kinds == {"literal_error"}:
        found = chosen[0].get("input")
        message = f"Input should be {_accepted(chosen)}, found {quoted(found)}"
    elif all(kind.endswith("_type") for kind in kinds):  # a value of none of the accepted types
        found = chosen[0].get("input")
        shapes = dict.fromkeys(str(e.get("msg", "")).removeprefix("Input should be ") for e in chosen)
        message = f"Input should be {' or '.join(shapes)}, found {quoted(found)}"
    else:
        found = (chosen[0].get("ctx") or {}).get("tag")  # union_tag_invalid: the item's type
        message = chosen[0].get("msg", "invalid value")
    if isinstance(found, str) and found in NOT_TEXT:
        message += ": this server reads text only"
    where = ".".join(deepest)
    item = deepest[:-1]  # problems inside the item at fault are that one problem, seen by each form
    elsewhere = {tuple(p) for p in paths if p[:len(item)] != item and p != deepest[:len(p)]}
    more = f" (and {len(elsewhere)} more problems)" if elsewhere else ""
    return ApiError(400, f"{where}: {message}{more}", param=where)
