"""Chat templates rendered, and structured-output grammars checked, in child processes, each job
bounded in time, memory and output.

A chat template is a program from a downloaded file (tokenizer_config.json, a GGUF file's
metadata). Jinja's sandbox keeps it from reaching anything outside itself, but not from running
forever or allocating without end: two nested `range(100000)` loops run for hours, and
`'A' * 3000000000` takes 3 GB in one operation. In the HTTP process neither could be stopped: a
Python loop in a thread cannot be interrupted (it would hold one of the threads every route
shares, and keep the server from exiting), and memory the process took stays taken. So templates
render in child processes, where every limit is enforced from outside the template:

- time: the server waits for the answer up to --chat-template-timeout, then kills the child, which
  stops anything, a long C-level operation included, and starts a fresh one;
- memory: the child's data segment is capped (RLIMIT_DATA), so an allocation past the cap is a
  MemoryError in the child, not the host's OOM killer;
- output: the child produces the rendering a piece at a time and stops at the output limit.

A rendering past a limit is a ChatTemplateLimit (400 for its request); the other children go on
serving meanwhile. A child also arms a timer of its own (SIGALRM, whose default action ends the
process even inside C code) so that a rendering never outlives its limit by long, even when the
server that should kill it is gone.

A grammar from a client's JSON schema is checked the same way (check_grammar): llguidance decides
whether each of its regular expressions can match anything, which for an `allOf` of patterns
takes time exponential in their number (20 patterns, half a minute; a few more, hours), in C
code a thread could not stop.

At start-up `check_template` renders a one-message conversation, with and without a tool: a
template that fails that, or whose rendering does not fit the context with room for an answer,
cannot serve any chat request, and is refused there, naming its source.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import queue
import re
import resource
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..checkpoint import ChatTemplateError, Tokenizer, render_chat
from ..checkpoint.chat_template import ChatTemplateLimit, render_template
from ..config import ServerConfig
from ..errors import ContextLengthError
from .prompt_tokens import encode_prompt

log = logging.getLogger("flashtree.serve")

MIB = 1 << 20
GIB = 1 << 30
RENDERERS = 2  # one template stuck until its time limit does not hold up the others' renderings
GRAMMARS_KEPT = 256  # grammar checks remembered (TemplateSandbox.check_grammar)
ORPHAN_GRACE_S = 5.0  # a child's own timer fires this long after the limit the server enforces
MARKUP_TOKEN = re.compile(r"<\|[^<>|\s]{1,64}\|>")  # <|im_start|>, <|eot_id|>: a template's special tokens
PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may take: wall-clock seconds, bytes of the child's data segment, and
    characters of output."""

    seconds: float
    memory_bytes: int
    output_chars: int

    @classmethod
    def for_server(cls, config: ServerConfig) -> "RenderLimits":
        """A rendering holds the request's text (at most one body, --max-body-mb) and the template's
        markup: four bodies and a MiB of markup is more than a template that prints each message
        once or twice writes. The memory leaves room for the request's objects, the output's
        pieces and their join: 1 GiB and sixteen bodies."""
        body = int(config.max_body_mb * MIB)
        return cls(config.chat_template_timeout, GIB + 16 * body, 4 * body + MIB)


def _render_job(limits: RenderLimits, template: str, variables: dict[str, Any]) -> str:
    return render_template(template, variables, limits.output_chars)


def _grammar_job(limits: RenderLimits, grammar: str, start: bool) -> str:
    """llguidance's error about `grammar`, or "" (warnings are not errors); with `start`, also
    about its first byte (structured.start_error)."""
    import llguidance

    from .structured import start_error

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return messages[0]
    return (start_error(grammar) or "") if start else ""


JOBS = {"render": _render_job, "grammar": _grammar_job}


def _child_main(conn: Connection, limits: RenderLimits) -> None:
    """A sandbox process: say it is ready, then answer each (job, arguments), a job of JOBS, with
    (kind, text), kind one of ok, error, limit, memory."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the server kills
    # its renderers itself when it stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]  # a cap set from outside stays in force
    cap = limits.memory_bytes if hard == resource.RLIM_INFINITY else min(limits.memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    conn.send(("ready", ""))
    while True:
        try:
            job, args = conn.recv()
        except EOFError:
            return
        signal.setitimer(signal.ITIMER_REAL, limits.seconds + ORPHAN_GRACE_S)
        try:
            reply = ("ok", JOBS[job](limits, *args))
        except ChatTemplateLimit as e:
            reply = ("limit", str(e))
        except ChatTemplateError as e:
            reply = ("error", str(e))
        except MemoryError:
            reply = ("memory", "")
        except Exception as e:  # RecursionError and the like: the job's failure all the same
            reply = ("error", f"{type(e).__name__}: {e}" if job == "grammar" else
                     f"the chat template cannot render this conversation: {type(e).__name__}: {e}")
        signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send(reply)


class _Renderer:
    """One sandbox process and the server's end of its pipe; a fresh process replaces one that
    was killed or died. Used by one thread at a time (TemplateSandbox hands it out)."""

    def __init__(self, sandbox: "TemplateSandbox"):
        self._sandbox = sandbox
        self._lock = threading.Lock()  # start and stop, which close() calls from another thread
        self._proc: Any = None
        self._conn: Optional[Connection] = None

    def run(self, job: str, args: tuple, subject: str) -> str:
        """JOBS[job](*args)'s text; ChatTemplateError for its error, ChatTemplateLimit naming
        `subject` (what went past a limit) for a job stopped by one."""
        limits = self._sandbox.limits
        conn = self._start()
        try:
            conn.send((job, args))
            answered = conn.poll(limits.seconds)
            kind, text = conn.recv() if answered else ("time", "")
        except (EOFError, OSError):  # the child died, or was killed by close()
            kind, text = "died", ""
        if kind == "ok":
            return text
        if kind == "error":
            raise ChatTemplateError(text)
        code = None
        if kind != "limit":  # the process is stuck, short of memory or gone: a fresh one, now, at
            code = self.stop()  # the cost of the request that lost this one
            self._start()
        if kind == "time" or code == -signal.SIGALRM:
            text = f"{subject} exceeded its time limit of {limits.seconds:g} s"
        elif kind == "memory":
            text = f"{subject} exceeded its memory limit of {limits.memory_bytes / GIB:.1f} GiB"
        elif kind == "died":
            text = f"{subject} ended its process (exit code {code})"
        log.warning("sandbox job stopped: %s", text)
        raise ChatTemplateLimit(text)

    def _start(self) -> Connection:
        """The pipe to a running process, started (and waited for: its start-up is not the
        template's time) if there is none."""
        with self._lock:
            if self._sandbox.closed:
                raise ChatTemplateError("the server is shutting down")
            if self._proc is None or not self._proc.is_alive():  # not started yet, or died idle
                if self._conn is not None:
                    self._conn.close()
                ctx = mp.get_context("spawn")  # a fork of this threaded process could inherit held locks
                parent, child = ctx.Pipe(duplex=True)
                self._proc = ctx.Process(target=_child_main, args=(child, self._sandbox.limits),
                                         name="flashtree-template", daemon=True)
                self._proc.start()
                child.close()
                self._conn = parent
                try:
                    parent.recv()  # ("ready", "")
                except EOFError:
                    raise ChatTemplateError(f"the process that renders the chat template could not start "
                                            f"(exit code {self._proc.exitcode})") from None
            assert self._conn is not None
            return self._conn

    def stop(self) -> Optional[int]:
        """Kill the process (if any); its exit code."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return None
            proc.kill()
            proc.join()
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            return proc.exitcode


class TemplateSandbox:
    """Renders chat templates and checks grammars in RENDERERS child processes (started on first
    use), each job within `limits`; a caller waits while all of them are busy. `render` is a
    chat_template.Render. A grammar's check is remembered (GRAMMARS_KEPT of them): agents send the
    same tools every turn, and a schema that went past the time limit once is refused at once."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.closed = False
        self._renderers = [_Renderer(self) for _ in range(RENDERERS)]
        self._idle: queue.SimpleQueue[_Renderer] = queue.SimpleQueue()
        self._grammars: dict[bytes, Optional[str]] = {}  # grammar's hash -> its error (None: usable), oldest first
        self._grammars_lock = threading.Lock()
        for renderer in self._renderers:
            self._idle.put(renderer)

    def render(self, template: str, variables: dict[str, Any]) -> str:
        return self._run("render", (template, variables), "the chat template")

    def check_grammar(self, grammar: str, start: bool = False) -> Optional[str]:
        """llguidance's error about `grammar` (None if it is usable), with `start` also about its
        first byte (structured.start_error: a JSON schema's grammar, whose bytes need no model's
        tokens), or ChatTemplateLimit's text when checking it went past a limit."""
        key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass") + bytes([start])).digest()  # a schema may be megabytes
        with self._grammars_lock:
            if key in self._grammars:
                return self._grammars[key]
        try:
            error = self._run("grammar", (grammar, start), "checking the grammar") or None
        except ChatTemplateLimit as e:
            error = str(e)
        with self._grammars_lock:
            self._grammars[key] = error
            while len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.pop(next(iter(self._grammars)))
        return error

    def _run(self, job: str, args: tuple, subject: str) -> str:
        renderer = self._idle.get()
        try:
            return renderer.run(job, args, subject)
        finally:
            self._idle.put(renderer)  # after close() too: it wakes the next waiter, which then fails

    def close(self) -> None:
        """Kill every renderer: renderings in progress end at once (the server is stopping)."""
        self.closed = True
        for renderer in self._renderers:
            renderer.stop()


def check_template(tokenizer: Tokenizer, sandbox: TemplateSandbox, max_ctx: int) -> None:
    """Refuse (ChatTemplateError naming the template's source) a chat template that cannot render
    a one-message conversation, renders it without the message's text (a template of a constant,
    or one reading a key no message has: the model would answer every request alike) or with
    `<|...|>` markup that is no token of the tokenizer (another model's template, or a tokenizer
    that lost its added tokens: the model would read the markup as text, and answer nonsense),
    renders it to a prompt that leaves no room for one
    token of answer in the `max_ctx`-token context, or goes past a limit when a tool is declared
    too: it would fail every chat request. One that only rejects tools (a model trained without them) is
    kept, with a warning: requests with tools get 400, the others are served."""
    if not tokenizer.chat_template:
        return
    source = tokenizer.chat_template_source or "the model"
    kwargs = {"enable_thinking": False}  # as chat requests render, unless they ask otherwise
    for tools in (None, PROBE_TOOLS):
        what = "a one-message conversation" + (" with a tool" if tools else "")
        try:
            text = render_chat(tokenizer, PROBE_MESSAGES, tools, True, kwargs, sandbox.render)
        except ChatTemplateError as e:
            if tools is not None and not isinstance(e, ChatTemplateLimit):
                log.warning("the chat template from %s cannot render tools (%s): requests with tools "
                            "will get 400", source, e)
                return
            raise ChatTemplateError(f"the chat template from {source} cannot be served: {e} "
                                    f"(rendering {what})") from None
        if tools is None:
            if PROBE_MESSAGES[0]["content"] not in text:
                raise ChatTemplateError(f"the chat template from {source} cannot be served: it renders {what} "
                                        "without the message's text (every chat request would get the same "
                                        "prompt, whatever it asks)")
            added = {t.content for t in tokenizer.raw.get_added_tokens_decoder().values()}
            unknown = sorted(set(MARKUP_TOKEN.findall(text)) - added)
            if unknown:
                raise ChatTemplateError(f"the chat template from {source} cannot be served: it writes "
                                        f"{', '.join(unknown)}, which the tokenizer has no token for (the model "
                                        "would read that markup as plain text)")
            try:
                tokens, bound = len(encode_prompt(tokenizer, text, max_ctx, max_ctx - 1)), ""
            except ContextLengthError as e:
                tokens, bound = e.prompt_tokens, "at least "
            if tokens >= max_ctx:
                raise ChatTemplateError(f"the chat template from {source} cannot be served: it renders "
                                        f"{what} to {bound}{tokens} tokens, which leaves no room for an "
                                        f"answer in the {max_ctx}-token context")
