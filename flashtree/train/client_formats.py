"""Agent clients' real requests (assets/client_tools/CLIENT.json) as conversations to train on.

Each asset is one request a client really sent (recorded by clients/record_formats.py): its
system prompt, the context messages it wraps around a task, and its tool schemas, in the wire
format of its API surface (Chat Completions, Responses or Anthropic Messages), with the task and
the working directory left as marks. `ClientFrame` fills the marks, extends the request with the
turns of one tool round in that same wire format (the model's call, the client's tool result, the
model's final answer), and turns the request into the chat messages and tools the chat template
renders.

That last step mirrors the server's own translation (flashtree/serve: anthropic_convert.py and
responses_api.py) because training may not import the server (the layer contract); a test holds
the two to the same output on every asset, so the target trains on exactly the prompt the server
builds from the client's request.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets" / "client_tools"
CLIENTS = ("claude", "codex", "hermes", "opencode")
TASK_MARK, CWD_MARK, HOME_MARK = "{{TASK}}", "{{CWD}}", "{{HOME}}"
BILLING_HEADER = "x-anthropic-billing-header:"  # dropped by the server (anthropic_convert.py)

Json = dict[str, Any]


def _fill(value: Any, marks: dict[str, str]) -> Any:
    if isinstance(value, str):
        for mark, text in marks.items():
            value = value.replace(mark, text)
        return value
    if isinstance(value, list):
        return [_fill(v, marks) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, marks) for k, v in value.items()}
    return value


def _parts_text(content: Any, sep: str) -> str:
    """Text of a string or of a list of text parts/blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return sep.join(part.get("text") or "" for part in content if isinstance(part, dict))


def _function(name: str, description: Any, parameters: Any) -> Json:
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters}}


@dataclass(frozen=True)
class ToolRound:
    """One round of a task: the model calls `name` with `arguments`, the client answers `result`,
    the model ends with `answer`. `call_id` is the id the client's surface uses for it."""

    name: str
    arguments: Json
    result: str
    answer: str
    call_id: str


class ClientFrame:
    """One client's recorded request, ready to carry any task."""

    def __init__(self, asset: Json):
        self.client: str = asset["client"]
        self.version: str = asset["version"]
        self.surface: str = asset["surface"]
        self._request: Json = asset["request"]

    @classmethod
    def load(cls, client: str, assets: Path = ASSETS) -> "ClientFrame":
        return cls(json.loads((assets / f"{client}.json").read_text()))

    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.chat_tools(self._request)}

    def request(self, task: str, cwd: str, home: str, rounds: list[ToolRound]) -> Json:
        """The client's request body after `rounds`: what it sends for the final answer, with that
        answer appended as the assistant's last turn (so the body holds the whole conversation)."""
        body = _fill(copy.deepcopy(self._request), {TASK_MARK: task, CWD_MARK: cwd, HOME_MARK: home})
        turns = body["input"] if self.surface == "responses" else body["messages"]
        for r in rounds:
            turns.extend(getattr(self, f"_{self.surface}_round")(r))
        turns.append(getattr(self, f"_{self.surface}_answer")(rounds[-1].answer if rounds else ""))
        return body

    # the wire turns of a round, per surface ------------------------------------------------------

    @staticmethod
    def _chat_round(r: ToolRound) -> list[Json]:
        call = {"id": r.call_id, "type": "function",
                "function": {"name": r.name, "arguments": json.dumps(r.arguments, ensure_ascii=False)}}
        return [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": r.call_id, "content": r.result}]

    @staticmethod
    def _chat_answer(text: str) -> Json:
        return {"role": "assistant", "content": text}

    @staticmethod
    def _responses_round(r: ToolRound) -> list[Json]:
        return [{"type": "function_call", "call_id": r.call_id, "name": r.name,
                 "arguments": json.dumps(r.arguments, ensure_ascii=False)},
                {"type": "function_call_output", "call_id": r.call_id, "output": r.result}]

    @staticmethod
    def _responses_answer(text: str) -> Json:
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}

    @staticmethod
    def _anthropic_round(r: ToolRound) -> list[Json]:
        return [{"role": "assistant", "content": [{"type": "tool_use", "id": r.call_id, "name": r.name,
                                                   "input": r.arguments}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.call_id,
                                              "content": r.result}]}]

    @staticmethod
    def _anthropic_answer(text: str) -> Json:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    # the request as the chat template sees it (the server's translation) ----------------------

    def chat_messages(self, body: Json) -> list[Json]:
        return getattr(self, f"_{self.surface}_messages")(body)

    def chat_tools(self, body: Json) -> list[Json]:
        tools = body.get("tools") or []
        if self.surface == "chat":
            return list(tools)
        if self.surface == "responses":
            return [_function(t["name"], t.get("description"),
                              t.get("parameters") or {"type": "object", "properties": {}})
                    for t in tools if t.get("type") == "function" and t.get("name")]
        return [_function(t["name"], t.get("description"), t["input_schema"])
                for t in tools if t.get("input_schema") is not None and t.get("type") in (None, "custom")]

    @staticmethod
    def _chat_messages(body: Json) -> list[Json]:
        out = []
        for m in body["messages"]:
            msg = {**m, "content": _parts_text(m.get("content"), "")}
            if m.get("tool_calls"):
                msg["tool_calls"] = [{**c, "function": {**c["function"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]
            out.append(msg)
        return out

    @staticmethod
    def _responses_messages(body: Json) -> list[Json]:
        system = [body["instructions"]] if body.get("instructions") else []
        messages: list[Json] = []
        items = [{"type": "message", "role": "user", "content": body["input"]}] \
            if isinstance(body["input"], str) else body["input"]
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                text = _parts_text(item["content"], "")
                if item["role"] in ("system", "developer"):
                    system.append(text)
                else:
                    messages.append({"role": item["role"], "content": text})
            elif kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": json.loads(item["arguments"])}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": _parts_text(item["output"], "")})
        return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + messages

    @staticmethod
    def _anthropic_messages(body: Json) -> list[Json]:
        raw = body.get("system")
        if isinstance(raw, list):
            raw = [b for b in raw if not b["text"].startswith(BILLING_HEADER)]
        system = [_parts_text(raw, "\n")] if raw else []
        messages: list[Json] = []
        for m in body["messages"]:
            content = m["content"]
            if m["role"] == "system":
                text = _parts_text(content if isinstance(content, str) else
                                   [b for b in content if b.get("type") == "text"], "\n")
                if messages:
                    messages.append({"role": "user", "content": text})
                else:
                    system.append(text)
            elif m["role"] == "user":
                messages.extend(_anthropic_user(content))
            else:
                messages.append(_anthropic_assistant(content))
        text = "\n\n".join(part for part in system if part)
        return ([{"role": "system", "content": text}] if text else []) + messages


def _anthropic_user(content: Any) -> list[Json]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[Json] = []
    for block in content:
        if block.get("type") == "tool_result":
            text = _parts_text(block.get("content"), "\n")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": "Error: " + text if block.get("is_error") else text})
        elif block.get("type") == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
    return out


def _anthropic_assistant(content: Any) -> Json:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text = "".join(b["text"] for b in content if b.get("type") == "text")
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
             for b in content if b.get("type") == "tool_use"]
    message: Json = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message
