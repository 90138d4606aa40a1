"""What every agent client run shares: the endpoint it is pointed at, a private home directory,
a clean environment, and one subprocess per task with its output kept.

Clients read configuration and credentials from the home directory and the environment, so each
run gets a fresh HOME (never the user's) and an environment built from nothing but PATH and the
locale: no API key or config of the person running the harness can leak into a run or be
overwritten by it.
"""

from __future__ import annotations

import os
import signal
from abc import ABC, abstractmethod
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

DEFAULT_TASK_TIMEOUT_S = 900


@dataclass
class Endpoint:
    """Where a client sends its requests: `url` is the server root (no /v1)."""

    url: str
    model: str
    api_key: str


@dataclass(frozen=True)
class Task:
    """A job for a client and how to tell that it was really done, not just that the client
    exited: `file` (a path relative to the working directory) must exist holding `content`
    (compared without surrounding whitespace), and/or `answer` must appear, ignoring case, in
    what the client printed on stdout, its answer (a command's output, a fact read from a file;
    not stderr, where some clients echo the request). Neither: only the exit status counts."""

    prompt: str
    file: Optional[str] = None
    content: Optional[str] = None
    answer: Optional[str] = None

    def check(self, workdir: Path, output: str) -> Optional[str]:
        """None when the task's outcome is there, else what is missing (one line)."""
        if self.file is not None:
            path = workdir / self.file
            if not path.is_file():
                return f"{self.file} was not created"
            if self.content is not None and path.read_text(errors="replace").strip() != self.content.strip():
                return f"{self.file} holds {path.read_text(errors='replace')[:80]!r}, not {self.content!r}"
        if self.answer is not None and self.answer.casefold() not in output.casefold():
            return f"the answer does not contain {self.answer!r}"
        return None


@dataclass
class TaskResult:
    task: str
    returncode: int
    seconds: float
    output: str  # the tail of what the client printed
    problem: Optional[str] = None  # Task.check's verdict: None when the outcome was checked and found

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.problem is None


@dataclass
class AgentClient(ABC):
    """One client: how to find it, configure it and run it on a task. Subclasses fill in the
    three methods; `tasks` are the small jobs `clients.run` gives it."""

    name: str
    tasks: list[Task] = field(default_factory=list)
    timeout_s: float = DEFAULT_TASK_TIMEOUT_S

    @abstractmethod
    def executable(self) -> Path:
        """The installed client (install.InstallError when it cannot be had)."""

    @abstractmethod
    def configure(self, home: Path, endpoint: Endpoint) -> dict[str, str]:
        """Write the client's configuration under `home`; return the environment it also needs."""

    @abstractmethod
    def argv(self, task: str, workdir: Path) -> list[str]:
        """The command line that runs `task` non-interactively in `workdir`."""


def clean_env(home: Path) -> dict[str, str]:
    """PATH, locale and a private HOME (with its XDG directories) and nothing else."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "TERM": "dumb",
           "HOME": str(home), "NO_COLOR": "1"}
    for var, sub in (("XDG_CONFIG_HOME", ".config"), ("XDG_DATA_HOME", ".local/share"),
                     ("XDG_STATE_HOME", ".local/state"), ("XDG_CACHE_HOME", ".cache")):
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    return env


@contextmanager
def _stops_held() -> Iterator[Callable[[], None]]:
    """Hold SIGTERM and SIGINT while a client starts, until the caller calls the function this
    yields: a stop whose handler ran inside Popen (the client already forked, its pid not yet
    returned) would leave the client running with nobody to kill it. Held stops are raised
    again, to the handlers they were meant for, on release. Handlers belong to the main thread;
    elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    held: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in before:
        signal.signal(s, lambda number, _frame: held.append(number))

    def release() -> None:
        for s, handler in before.items():
            signal.signal(s, handler)
        while held:
            signal.raise_signal(held.pop(0))

    try:
        yield release
    finally:
        release()  # Popen failed: the handlers come back all the same


def run_task(argv: list[str], env: dict[str, str], workdir: Path, log_stem: Path,
             timeout_s: float) -> TaskResult:
    """Run one task to completion (or kill its whole process group at the timeout, or when the
    harness is stopped); stdout and stderr go to `<log_stem>.out` / `.err`."""
    out_path, err_path = log_stem.with_suffix(".out"), log_stem.with_suffix(".err")
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err, _stops_held() as release:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True)
        try:
            release()  # a stop that came while the client started is raised here, its pid known
            code: Optional[int] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = -9
        finally:  # at the timeout, and when the harness itself is stopped: no orphaned client
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = out_path.read_text(errors="replace")[-4000:]
    return TaskResult(task="", returncode=code if code is not None else -1,
                      seconds=round(time.monotonic() - start, 2), output=output)


def run_client(client: AgentClient, endpoint: Endpoint, run_dir: Path,
               tasks: Optional[list[Task]] = None,
               on_task: Optional[Callable[[int], None]] = None) -> list[TaskResult]:
    """Configure `client` in a fresh home under `run_dir` and run its tasks one after another
    in one working directory (later tasks may build on what earlier ones wrote), checking each
    one's outcome. `on_task(i)` is called before task i (1-based) starts (the proxy tags the
    exchanges with it)."""
    base = run_dir / client.name
    home, workdir = base / "home", base / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    env = clean_env(home)
    env.update(client.configure(home, endpoint))
    results = []
    for i, task in enumerate(tasks if tasks is not None else client.tasks, 1):
        if on_task is not None:
            on_task(i)
        result = run_task(client.argv(task.prompt, workdir), env, workdir, base / f"task{i:02d}",
                          client.timeout_s)
        result.task = task.prompt
        result.problem = task.check(workdir, (base / f"task{i:02d}.out").read_text(errors="replace"))
        results.append(result)
    return results


def file_tasks(client: str) -> list[Task]:
    """The coding clients' tasks: a reply, then a real tool round each (write a file, read it
    back, run a command whose output the model cannot guess), all checked."""
    return [
        Task("Reply with exactly one word: ready.", answer="ready"),
        Task(f"Create a file named hello.txt containing the text: hello from {client}",
             file="hello.txt", content=f"hello from {client}"),
        Task("Show the contents of hello.txt.", answer=f"hello from {client}"),
        Task("Run the shell command `echo flashtree-$((6*7))` and tell me what it printed.",
             answer="flashtree-42"),
    ]
