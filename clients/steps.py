"""`python -m clients.steps NAME=FLAGS ...`: the steps of `make clients`, each one `clients.run`
with its own flags and its own directory, every step run whatever the ones before it scored,
then one summary of them all.

A step's tasks are scored against its threshold (`clients.run --threshold`) in its report: a
score below it is a finding, printed in the summary, and no reason to skip the steps after it.
The exit status is 1 when a step could not run or did not run cleanly: its `clients.run` exited
non-zero (the server did not start, an error of ours, injected faults that reached no client),
it left no report, or a client of it was not installed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .run import RUNS_DIR, broken, score

RUN_COMMAND = [sys.executable, "-m", "clients.run"]


@dataclass
class Step:
    name: str
    flags: list[str]


@dataclass
class StepResult:
    step: Step
    out: Path
    returncode: int
    entries: Optional[list[dict[str, Any]]]  # report.json's, None when the step wrote none

    @property
    def failed(self) -> bool:
        """Could not run, or not cleanly (see the module's docstring)."""
        return (self.returncode != 0 or self.entries is None
                or any("skipped" in e for e in self.entries))


def parse_step(text: str) -> Step:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a step is NAME=FLAGS (clients.run's flags), not {text!r}")
    return Step(name, shlex.split(flags))


def run_step(step: Step, out: Path) -> StepResult:
    """Run one step to its end, its output on the terminal. Stopped from outside, it passes the
    stop on as SIGTERM, on which clients.run stops its client and server before it exits."""
    cmd = [*RUN_COMMAND, *step.flags, "--out", str(out)]
    print(f"== step {step.name}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd)
    try:
        returncode = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    report = out / "report.json"
    return StepResult(step, out, returncode, json.loads(report.read_text()) if report.is_file() else None)


def client_line(entry: dict[str, Any]) -> str:
    """One client of a step: its score against the threshold, or why it did not run, and what
    went wrong of ours."""
    if "skipped" in entry:
        return f"{entry['client']}: not run ({entry['skipped']})"
    line = f"{entry['client']}: {score(entry)}"
    if entry["injected_oom"]:
        line += f", {entry['injected_oom']} injected out-of-memory answer(s) retried"
    if broken(entry):
        line += (f"; FAILED: {len(entry['errors']) + len(entry['stream_errors'])} error(s) of ours"
                 + ("" if entry["server_alive"] else ", the server died"))
    return line


def summary(results: list[StepResult]) -> list[str]:
    """Every step: its clients' lines, and whether the step itself ran cleanly."""
    lines = ["== summary"]
    for r in results:
        lines.append(f"{r.step.name}: FAILED, clients.run exit {r.returncode}"
                     + (", no report" if r.entries is None else "") + f" (its output is above; {r.out})"
                     if r.failed else f"{r.step.name}: ran")
        lines += [f"  {client_line(e)}" for e in r.entries or []]
    failed = [r.step.name for r in results if r.failed]
    lines.append(f"{len(results) - len(failed)} of {len(results)} steps ran cleanly"
                 + (f"; failed: {', '.join(failed)}" if failed else "")
                 + "; scores below a threshold are findings, not failures")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="+", type=parse_step, metavar="NAME=FLAGS",
                   help="a step: its name (its directory) and clients.run's flags, e.g. "
                        "reference='--clients hermes --threshold 1'")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory, a subdirectory per step (default: clients/.runs/DATE)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_step, which stops the step
    run_dir = args.out or RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
    results = [run_step(step, run_dir / step.name) for step in args.steps]
    lines = summary(results)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
