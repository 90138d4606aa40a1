"""Synthetic tool-use dialogues over a handful of tools, in OpenAI chat format.

A dialogue is: the user asks, the assistant (sometimes after `<think>` reasoning) emits one or two
tool calls whose arguments are copied from the question, the tool answers with JSON, and the
assistant answers using the numbers in that JSON. `tool_text_dialogue` is the same with the
results as plain text (`84`, `city: Lisbon, temperature: 21, ...`), as a user's own tool may send
them: a model that saw only JSON results answers those from its own guesses. `TOOLS` is public
so that tests and examples can offer the tiny model exactly the tool schemas it was trained with.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from .lexicon import CONDITIONS, WORDS, city
from .synth_chat import GENERATORS, SYSTEM_PROMPTS


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS: list[dict[str, Any]] = [
    _tool("get_weather", "Get the current weather in a city.",
          {"city": {"type": "string", "description": "City name"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("calculator", "Evaluate an arithmetic expression.",
          {"expression": {"type": "string", "description": "Expression such as 12 * (3 + 4)"}}, ["expression"]),
    _tool("search_files", "Find files whose names match a glob pattern in a directory.",
          {"pattern": {"type": "string"}, "directory": {"type": "string"}}, ["pattern", "directory"]),
    _tool("convert_units", "Convert a value from one unit to another.",
          {"value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
          ["value", "from_unit", "to_unit"]),
    _tool("get_current_time", "Get the current local time in a city.",
          {"city": {"type": "string"}}, ["city"]),
]
_BY_NAME = {t["function"]["name"]: t for t in TOOLS}

# one tool invocation: (tool name, arguments, the tool's JSON result)
Call = tuple[str, dict[str, Any], dict[str, Any]]


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 2)


def _weather(rng: random.Random, place: str, unit: str) -> Call:
    temp = rng.randint(-10, 35) if unit == "celsius" else rng.randint(14, 95)
    args = {"city": place} if unit == "celsius" else {"city": place, "unit": unit}
    result = {"city": place, "temperature": temp, "unit": unit, "condition": rng.choice(CONDITIONS),
              "humidity": rng.randint(20, 95)}
    return "get_weather", args, result


def _weather_ask(rng: random.Random) -> tuple[str, list[Call], str]:
    places = list(dict.fromkeys([city(rng)] if rng.random() < 0.8 else [city(rng), city(rng)]))
    unit = "fahrenheit" if rng.random() < 0.25 else "celsius"
    calls = [_weather(rng, p, unit) for p in places]
    q = rng.choice(["What's the weather like in {w}?", "How is the weather in {w} today?",
                    "Is it cold in {w} right now?", "Check the weather in {w}.",
                    "Tell me the current weather for {w}."]).format(w=" and ".join(places))
    if unit == "fahrenheit":
        q = q.rstrip(".?") + ", in Fahrenheit?"
    lines = []
    for _, _, r in calls:
        deg = "°F" if r["unit"] == "fahrenheit" else "°C"
        lines.append(rng.choice(["It is {t}{d} and {c} in {p}, with {h}% humidity.",
                                 "In {p} it is currently {t}{d} and {c}. Humidity is {h}%."]).format(
            t=r["temperature"], d=deg, c=r["condition"], p=r["city"], h=r["humidity"]))
    return q, calls, " ".join(lines)


def _calc_ask(rng: random.Random) -> tuple[str, list[Call], str]:
    a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
    expr = rng.choice([f"{a} * {b}", f"{a} + {b} * {c}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}",
                       f"{a * c} / {c}"])
    value = _num(eval(expr, {"__builtins__": {}}))  # noqa: S307 - our own digits and operators only
    q = rng.choice(["What is {e}?", "Use the calculator to compute {e}.", "Calculate {e} for me.",
                    "Can you work out {e}?"]).format(e=expr)
    return q, [("calculator", {"expression": expr}, {"result": value})], f"{expr} = {value}."


def _search_ask(rng: random.Random) -> tuple[str, list[Call], str]:
    ext = rng.choice(["py", "md", "txt", "json", "csv"])
    pattern = rng.choice([f"*.{ext}", f"test_*.{ext}", f"{rng.choice(WORDS)}*.{ext}"])
    directory = rng.choice(["src", "docs", "tests", "data", "notes", "project", f"{rng.choice(WORDS)}s"])
    stems = rng.sample(WORDS, rng.choice([0, 1, 2, 2, 3, 4]))
    prefix = pattern.split("*")[0]
    matches = [f"{directory}/{prefix}{s}.{ext}" for s in stems]
    q = rng.choice(["Find all files matching {p} in {d}.", "Which {p} files are in the {d} directory?",
                    "Search {d} for files named {p}.", "List the {p} files under {d}."]).format(p=pattern, d=directory)
    if matches:
        answer = f"I found {len(matches)} file{'s' if len(matches) > 1 else ''} matching {pattern} in {directory}:\n" + \
            "\n".join(f"- {m}" for m in matches)
    else:
        answer = f"No files matching {pattern} were found in {directory}."
    return q, [("search_files", {"pattern": pattern, "directory": directory}, {"matches": matches})], answer


_UNITS = [("kilometers", "miles", 0.621371), ("miles", "kilometers", 1.609344), ("kilograms", "pounds", 2.204623),
          ("pounds", "kilograms", 0.453592), ("meters", "feet", 3.28084), ("feet", "meters", 0.3048),
          ("liters", "gallons", 0.264172), ("celsius", "fahrenheit", None), ("fahrenheit", "celsius", None)]


def _convert_ask(rng: random.Random) -> tuple[str, list[Call], str]:
    src, dst, factor = rng.choice(_UNITS)
    value = _num(rng.choice([rng.randint(1, 500), rng.randint(1, 100) + 0.5]))
    if factor is None:
        result = _num(value * 9 / 5 + 32 if src == "celsius" else (value - 32) * 5 / 9)
    else:
        result = _num(value * factor)
    q = rng.choice(["Convert {v} {s} to {d}.", "How many {d} is {v} {s}?", "What is {v} {s} in {d}?"]).format(
        v=value, s=src, d=dst)
    args = {"value": value, "from_unit": src, "to_unit": dst}
    return q, [("convert_units", args, {"result": result, "unit": dst})], f"{value} {src} is {result} {dst}."


def _time_ask(rng: random.Random) -> tuple[str, list[Call], str]:
    place = city(rng)
    hh, mm, off = rng.randint(0, 23), rng.randint(0, 59), rng.randint(-10, 12)
    zone = f"UTC{off:+d}" if off else "UTC"
    q = rng.choice(["What time is it in {c}?", "What's the local time in {c} right now?",
                    "Tell me the current time in {c}."]).format(c=place)
    result = {"city": place, "time": f"{hh:02d}:{mm:02d}", "timezone": zone}
    return q, [("get_current_time", {"city": place}, result)], f"It is {hh:02d}:{mm:02d} in {place} ({zone})."


_ASKS: list[Callable[[random.Random], tuple[str, list[Call], str]]] = [
    _weather_ask, _weather_ask, _calc_ask, _search_ask, _convert_ask, _time_ask]


def _reasoning(calls: list[Call]) -> str:
    names = sorted({n for n, _, _ in calls})
    parts = ", ".join(f"{n} with {json.dumps(a)}" for n, a, _ in calls)
    return f"The user's request needs the {' and '.join(names)} tool. I will call {parts}."


def _tool_messages(rng: random.Random, ask: Callable) -> tuple[list[dict], set[str]]:
    q, calls, answer = ask(rng)
    call_msg: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a, _ in calls]}
    if rng.random() < 0.3:
        call_msg["reasoning_content"] = _reasoning(calls)
    messages = [{"role": "user", "content": q}, call_msg]
    messages += [{"role": "tool", "content": json.dumps(r)} for _, _, r in calls]
    messages.append({"role": "assistant", "content": answer})
    return messages, {n for n, _, _ in calls}


def tool_dialogue(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """One tool-use conversation and the tool list offered in it (always holding the tools used)."""
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    used: set[str] = set()
    for i in range(rng.choice([1, 1, 1, 2])):
        if i == 0 and rng.random() < 0.1:
            user, answer, _ = rng.choice(GENERATORS)(rng)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            continue
        turn, names = _tool_messages(rng, rng.choice(_ASKS))
        messages += turn
        used |= names
    extra = [n for n in _BY_NAME if n not in used]
    offered = sorted(used) + rng.sample(extra, rng.randint(0 if used else 1, len(extra)))
    rng.shuffle(offered)
    return messages, [_BY_NAME[n] for n in offered]


def as_text_result(content: str) -> str:
    """A JSON tool result as a tool without JSON would send it: a lone value as itself (`84`),
    several as `key: value` pairs (`city: Lisbon, temperature: 21, ...`), a list as its items one
    a line (`(none)` when empty)."""
    data = json.loads(content)
    if isinstance(data, dict) and len(data) == 1:
        data = next(iter(data.values()))
    if isinstance(data, list):
        return "\n".join(map(str, data)) or "(none)"
    if isinstance(data, dict):
        return ", ".join(f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in data.items())
    return str(data)


def with_text_results(messages: list[dict]) -> list[dict]:
    """The messages with every tool result `as_text_result` (the others unchanged)."""
    return [{**m, "content": as_text_result(m["content"])} if m["role"] == "tool" else m for m in messages]


def tool_text_dialogue(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """`tool_dialogue` with its tool results as plain text."""
    messages, tools = tool_dialogue(rng)
    return with_text_results(messages), tools
