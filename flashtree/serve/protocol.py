"""The messages between the HTTP server and the engine worker, over one multiprocessing pipe.

Plain picklable dataclasses holding plain data (lists, dicts, strings) so that neither side needs
the other's classes. Every message about a request carries its `req_id`: the server drops
anything tagged with a request it no longer waits for, so tokens of a cancelled or finished
request can never be read as the next request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

# --- server -> worker --------------------------------------------------------------------------


@dataclass
class Generate:
    """Run one generation; `sampling` holds SamplingParams fields; `stop_ids` None = the model's;
    `grammar` an llguidance grammar the output must follow (structured output); `trace` asks
    for each decode step's tree with its tokens (Tokens.traces)."""

    req_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    max_tokens: int
    stop_ids: Optional[list[int]] = None
    grammar: Optional[str] = None
    trace: bool = False


@dataclass
class Cancel:
    """Stop `req_id` at the next step boundary (ignored when it is not running)."""

    req_id: str


@dataclass
class Shutdown:
    """Finish and exit cleanly."""


@dataclass
class Ping:
    """Answer with a Heartbeat: the server's check that an idle worker is still responsive."""


# --- worker -> server --------------------------------------------------------------------------


@dataclass
class Ready:
    """The engine is loaded; `info` describes model, context and decoding settings."""

    info: dict[str, Any]


@dataclass
class LoadFailed:
    """The engine could not be loaded; restarting would fail the same way."""

    error_type: str
    message: str


@dataclass
class Tokens:
    """Token ids committed by one decode step of `req_id`; when the request asked for logprobs,
    one (logprob, [(id, logprob), ...top alternatives]) per id. When it asked for a trace,
    `traces` holds the engine's trace of the step that made these ids (tree_tokens,
    tree_parents, accepted node indices): empty for the ids the prefill made."""

    req_id: str
    ids: list[int]
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    traces: Optional[list[dict[str, Any]]] = None


@dataclass
class Heartbeat:
    """The worker is alive: sent after every prefill chunk of `req_id`, and in answer to a Ping
    (`req_id` None). Every other message proves the same; this one is for the stretches that
    send nothing else, so the server's watchdog can tell slow work from a stuck worker."""

    req_id: Optional[str] = None


@dataclass
class Done:
    """`req_id` finished: finish_reason in stop | length | cancelled, plus the engine's stats."""

    req_id: str
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # engine.cache_stats() as of now


@dataclass
class Error:
    """`req_id` failed. `error_type` is an OpenAI-style code, e.g. context_length_exceeded,
    invalid_request_error, out_of_memory, non_finite_logits, engine_error."""

    req_id: str
    error_type: str
    message: str
    param: Optional[str] = None  # the request field at fault, where one is (ConfigError.param)


@dataclass
class Event:
    """Something that happened to the engine as a whole rather than to one request, e.g.
    kind="cache_cleared" with data {"reason": "oom", "dropped": 3}."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # engine.cache_stats() after the event


ToWorker = Union[Generate, Cancel, Shutdown, Ping]
FromWorker = Union[Ready, LoadFailed, Tokens, Heartbeat, Done, Error, Event]
