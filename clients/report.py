"""Read a recorded transcript (clients.proxy) back: per request its usage, tool calls and errors,
per client the totals the harness reports.

The three wire formats (Chat Completions, Responses, Anthropic Messages) spell the same facts
differently, streamed or not; each fact is looked up in every spelling, so one summary serves
every client.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional


@dataclass
class Usage:
    prompt: int
    cached: int
    completion: int


def load(transcript: Path) -> list[dict[str, Any]]:
    if not transcript.is_file():
        return []
    return [json.loads(line) for line in transcript.read_text().splitlines() if line.strip()]


def payloads(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a response: the body itself, or each SSE `data:` of a stream."""
    response = record.get("response")
    if isinstance(response, dict):
        yield response
        return
    if not isinstance(response, str):
        return
    for line in response.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    yield obj


def _usage_of(obj: dict[str, Any]) -> Optional[Usage]:
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" in u:  # chat completions
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Usage(u["prompt_tokens"], cached, u.get("completion_tokens", 0))
    if "input_tokens_details" in u:  # responses
        return Usage(u["input_tokens"], u["input_tokens_details"].get("cached_tokens", 0), u.get("output_tokens", 0))
    if "cache_read_input_tokens" in u:  # anthropic: input_tokens excludes what the cache held
        cached = u.get("cache_read_input_tokens") or 0
        return Usage((u.get("input_tokens") or 0) + cached, cached, u.get("output_tokens", 0))
    return None


def usage(record: dict[str, Any]) -> Optional[Usage]:
    """The final usage a generation reported (the last one seen in its payloads)."""
    found = None
    for obj in payloads(record):
        for candidate in (obj, obj.get("response") if isinstance(obj.get("response"), dict) else {}):
            found = _usage_of(candidate) or found
    return found


def tool_calls(record: dict[str, Any]) -> int:
    """Tool calls the server parsed out of one response, counted once each whatever the surface:
    chat `tool_calls` (a streamed call's first delta carries its id, later deltas do not),
    Responses `function_call` items (streamed: each `output_item.done`), Anthropic `tool_use`
    blocks (streamed: each `content_block_start`)."""
    count = 0
    for obj in payloads(record):
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or choice.get("message") or {}
            count += sum(1 for call in delta.get("tool_calls") or [] if call.get("id"))
        kind = obj.get("type")
        if kind == "response.output_item.done" and obj["item"].get("type") == "function_call":
            count += 1
        elif kind == "content_block_start" and obj["content_block"].get("type") == "tool_use":
            count += 1
        elif obj.get("object") == "response":
            count += sum(1 for item in obj.get("output") or [] if item.get("type") == "function_call")
        elif kind == "message":
            count += sum(1 for block in obj.get("content") or [] if block.get("type") == "tool_use")
    return count


def tool_result_ids(record: dict[str, Any]) -> set[str]:
    """The call ids of the tool results a request carries back: chat `tool` messages, Responses
    `function_call_output` items, Anthropic `tool_result` blocks. A request repeats the whole
    conversation, so a result is counted by its id, once, however many later requests carry it."""
    body = record.get("request")
    if not isinstance(body, dict):
        return set()
    ids: set[str] = set()
    for message in body.get("messages") or []:  # chat completions and anthropic
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            ids.add(str(message.get("tool_call_id")))
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, list):
            ids.update(str(block.get("tool_use_id")) for block in content
                       if isinstance(block, dict) and block.get("type") == "tool_result")
    items = body.get("input")
    if isinstance(items, list):  # responses
        ids.update(str(item.get("call_id")) for item in items
                   if isinstance(item, dict) and item.get("type") == "function_call_output")
    return ids


def stream_errors(record: dict[str, Any]) -> list[str]:
    """Errors sent inside a 200 stream (after the response had begun)."""
    if not isinstance(record.get("response"), str):
        return []
    out = []
    for obj in payloads(record):
        if obj.get("type") == "error":  # Responses and Anthropic error events
            out.append(json.dumps(obj))
        elif obj.get("type") is None and obj.get("error"):  # a Chat Completions error chunk
            out.append(json.dumps(obj["error"]))
    return out


def side_by_side(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The POST exchanges that ran while another POST of theirs was running (their [t, t +
    seconds) intervals overlap): the requests a client sent beside its main loop (titles,
    summaries, sub-agents), which a server of one sequence at a time would queue or refuse."""
    posts = sorted((r for r in records if r.get("method") == "POST" and "t" in r), key=lambda r: r["t"])
    beside: set[int] = set()
    for i, a in enumerate(posts):
        end = a["t"] + a.get("seconds", 0.0)
        for j in range(i + 1, len(posts)):
            if posts[j]["t"] >= end:
                break
            beside.update((i, j))
    return [posts[i] for i in sorted(beside)]


def summarize(records: list[dict[str, Any]], client: str, task: Optional[int] = None) -> dict[str, Any]:
    """What one client's exchanges came to, or those of its task number `task` (token totals
    come from the server's counters); `side_by_side` counts its requests that ran beside another
    of its own, `side_by_side_ok` those of them answered 200."""
    mine = [r for r in records if r.get("client") == client and (task is None or r.get("task") == task)]
    beside = side_by_side(mine)
    statuses = Counter(f"{r['method']} {r['path']} {r['status']}" for r in mine)
    return {
        "requests": len(mine),
        "statuses": dict(sorted(statuses.items())),
        "errors": [f"{r['method']} {r['path']} {r['status']}: {json.dumps(r['response'])[:300]}"
                   for r in mine if r["status"] >= 500 or (r["status"] >= 400 and r["method"] == "POST")],
        "stream_errors": [e for r in mine for e in stream_errors(r)],
        "tool_calls": sum(tool_calls(r) for r in mine),
        "tool_results": len(set().union(*(tool_result_ids(r) for r in mine))),
        "side_by_side": len(beside),
        "side_by_side_ok": sum(r["status"] == 200 for r in beside),
    }
