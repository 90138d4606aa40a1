"""From token ids per decode step to what an API response is made of.

Every endpoint shares one path: submit to the supervisor, then per step detokenize (never
splitting a character), apply stop strings (cancelling the engine at a match), split reasoning
from content, and pull tool calls out of the content. Endpoints only format the resulting
deltas, so chat, completions and responses cannot disagree on what the model said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from .chat import IncrementalDetokenizer
from .decoder_trace import DecodeSteps, StepTracer
from .holdback import StopMatcher
from .logprobs import LogprobTracker, Logprobs, WorkerLogprob
from .protocol import Done
from .reasoning import CONTENT, ReasoningSplitter
from .supervisor import RequestFailed, Supervisor
from .toolcalls import ToolCall, ToolCallParser


@dataclass
class GenerationSpec:
    """One request, ready for the engine, with what is needed to interpret its output.

    `prefix` is text the prompt already put in the model's mouth (a forced tool-call opener):
    the output is parsed as if the model had written it."""

    prompt_ids: list[int]
    sampling: dict[str, Any]
    max_tokens: int
    stop_ids: Optional[list[int]] = None  # None: the model's EOS tokens; [] ignores EOS
    stops: list[str] = field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None
    tool_format: str = "hermes"
    prefix: str = ""
    split_reasoning: bool = False
    reasoning_open: bool = False
    max_tool_calls: Optional[int] = None  # the output ends after this many (parallel_tool_calls: false)
    grammar: Optional[str] = None  # llguidance grammar the output must follow (structured.py)
    grammar_param: Optional[str] = None  # the request field the grammar came from (its errors' param)
    trace: bool = False  # yield each decode step's tokens and tree (DecodeSteps: the decoder view)


@dataclass
class TextDelta:
    channel: str  # "content" | "reasoning"
    text: str


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Started:
    """The engine has begun answering: from here on, failures happen mid-response."""


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls
    usage: Usage
    stats: dict[str, Any] = field(default_factory=dict)
    stop_sequence: Optional[str] = None  # the stop string that ended the output, if one did


Delta = Union[TextDelta, ToolCall, Logprobs]
Item = Union[Started, TextDelta, ToolCall, Logprobs, DecodeSteps, Finish]


class OutputPipeline:
    """Synchronous core: push() the ids of each step, finish() once; both return deltas.

    The output ends early at a stop string, or after the last tool call `max_tool_calls` allows:
    from the id that ended it, nothing more is looked at or emitted, and `completion_tokens`
    counts the ids up to that one (the engine, a decode step ahead, may have made more: they were
    never part of the answer). When the engine sends logprobs, each push and the finish end with
    a Logprobs delta for the tokens whose text has been released (logprobs.LogprobTracker)."""

    def __init__(self, tokenizer: Any, spec: GenerationSpec):
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)
        self._logprobs: Optional[LogprobTracker] = None
        self._stops = StopMatcher(spec.stops)
        self._reasoning = ReasoningSplitter(spec.reasoning_open) if spec.split_reasoning else None
        self._tools = ToolCallParser(spec.tools, spec.tool_format) if spec.tools else None
        self._max_calls = spec.max_tool_calls
        self._calls_out = 0  # tool calls emitted
        self._pending: list[Delta] = []
        self.completion_tokens = 0
        if spec.prefix:
            self._content(spec.prefix)

    @property
    def stopped(self) -> bool:
        """The output has ended (a stop string, the last allowed tool call): the engine may be
        cancelled, nothing more will be emitted."""
        return self._stops.matched or self._calls_exhausted

    @property
    def _calls_exhausted(self) -> bool:
        return self._max_calls is not None and self._calls_out >= self._max_calls

    @property
    def stop_sequence(self) -> Optional[str]:
        return self._stops.matched_stop

    @property
    def tool_calls(self) -> int:
        """Tool calls emitted."""
        return self._calls_out

    @property
    def call_cut_off(self) -> bool:
        """finish() dropped a tool call the output was cut in (ToolCallParser.finish)."""
        return self._tools is not None and self._tools.cut_off

    def push(self, ids: list[int], logprobs: Optional[list[WorkerLogprob]] = None) -> list[Delta]:
        if logprobs is not None and self._logprobs is None:
            self._logprobs = LogprobTracker()
        for i, token in enumerate(ids):  # one at a time, to know which id ended the output
            if self.stopped:
                break
            self.completion_tokens += 1
            text = self._detok.push([token])
            if self._logprobs is not None and logprobs is not None:
                self._logprobs.add(token, text, self._tokenizer.decode([token]), logprobs[i])
            self._released(self._stops.feed(text))
        return self._take()

    def finish(self, length: bool = False) -> list[Delta]:
        """The deltas still held. `length`: the engine stopped at max_tokens (or a full context);
        then, or at a stop string, the output was cut, and a tool call it was cut in is dropped."""
        if self._calls_exhausted:  # what the parsers still hold came after the last call
            return self._take()
        self._released(self._stops.feed(self._detok.flush()))
        self._released(self._stops.finish())
        if self._reasoning:
            self._route(self._reasoning.finish())
        if self._tools:
            self._add_pieces(self._tools.finish(cut=length or self._stops.matched))
        return self._take(ended=not self._stops.matched)

    def _released(self, text: str) -> None:
        """Text the stop strings let through: the answer's, and its tokens' logprobs with it."""
        if self._logprobs is not None:
            self._logprobs.released += len(text)
        self._text(text)

    def _take(self, ended: bool = False) -> list[Delta]:
        out, self._pending = self._pending, []
        if self._logprobs is not None and (released := self._logprobs.take(everything=ended)).entries:
            out.append(released)
        return out

    def _text(self, text: str) -> None:
        if not text or self._calls_exhausted:
            return
        if self._reasoning:
            self._route(self._reasoning.feed(text))
        else:
            self._content(text)

    def _route(self, parts: list[tuple[str, str]]) -> None:
        for channel, text in parts:
            if channel == CONTENT:
                self._content(text)
            else:
                self._pending.append(TextDelta(channel, text))

    def _content(self, text: str) -> None:
        if self._tools:
            self._add_pieces(self._tools.feed(text))
        else:
            self._pending.append(TextDelta(CONTENT, text))

    def _add_pieces(self, pieces: list[Union[str, ToolCall]]) -> None:
        for piece in pieces:
            if self._calls_exhausted:
                return  # what the model wrote after the last call it may make is not part of the answer
            if isinstance(piece, ToolCall):
                self._calls_out += 1
            self._pending.append(TextDelta(CONTENT, piece) if isinstance(piece, str) else piece)


def _finish_reason(done: Done, pipe: OutputPipeline) -> str:
    """tool_calls when the answer ends with its calls; an answer cut inside a call ends as it
    was cut (length, or stop at a stop string) even after calls it completed, so that the
    client learns the model meant more than it got (a larger max_tokens gets it)."""
    if pipe.tool_calls and not pipe.call_cut_off:
        return "tool_calls"
    if pipe.stopped:
        return "stop"
    return "length" if done.finish_reason == "length" else "stop"


async def generate(supervisor: Supervisor, tokenizer: Any, spec: GenerationSpec) -> AsyncIterator[Item]:
    """Run `spec` and yield Started, then deltas (with a traced spec, each step's DecodeSteps
    before its text), then one Finish.

    Raises the supervisor's errors (QueueFull at submit; RequestFailed, EngineUnavailable later).
    Closing the iterator early cancels the generation in the engine."""
    handle = supervisor.submit(spec.prompt_ids, spec.sampling, spec.max_tokens, spec.stop_ids, spec.grammar,
                               spec.trace)
    pipe = OutputPipeline(tokenizer, spec)
    tracer = StepTracer(tokenizer) if spec.trace else None
    try:
        msg = await handle.next()
        yield Started()
        while not isinstance(msg, Done):
            if tracer is not None:
                yield tracer.push(msg.ids, msg.traces)
            for delta in pipe.push(msg.ids, msg.logprobs):
                yield delta
            if pipe.stopped:
                handle.cancel()  # the rest of this generation is unwanted; Done still follows
            msg = await handle.next()
        for delta in pipe.finish(msg.finish_reason == "length"):
            yield delta
        if tracer is not None and (tail := tracer.finish()) is not None:
            yield tail
        stats = msg.stats
        usage = Usage(prompt_tokens=stats.get("prompt_tokens", len(spec.prompt_ids)),
                      completion_tokens=pipe.completion_tokens, cached_tokens=stats.get("cached_tokens", 0))
        yield Finish(_finish_reason(msg, pipe), usage, stats, pipe.stop_sequence)
    except RequestFailed as e:
        if e.error_type == "invalid_grammar" and e.param is None:
            e.param = spec.grammar_param  # the worker knows the grammar, not the field it came from
        raise
    finally:
        if not handle.finished:
            handle.cancel()
