"""`make clients` runs every step and reports them all: a client's score below its threshold is
printed against it, in its step's table and in the summary at the end, and neither stops the
steps after it nor fails `make`; a step that could not run (no report, a non-zero exit, a client
not installed) is listed and fails the run. A stand-in for `clients.run` writes the reports, so
no client or server is needed."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clients import run, steps

ROOT = Path(__file__).resolve().parents[1]

# what clients.run leaves behind for `--score OK/N` (one hermes entry), or nothing with --no-report
FAKE_RUN = textwrap.dedent("""
    import argparse, json, sys
    from pathlib import Path
    p = argparse.ArgumentParser()
    p.add_argument("--score", default="10/10")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--skipped")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.out.mkdir(parents=True)
    ok, n = map(int, args.score.split("/"))
    entry = ({"client": "codex", "skipped": args.skipped} if args.skipped else
             {"client": "hermes", "tasks": [{}] * n, "tasks_ok": ok, "threshold": args.threshold,
              "errors": [], "stream_errors": [], "server_alive": True, "injected_oom": 0})
    if not args.no_report:
        (args.out / "report.json").write_text(json.dumps([entry]))
    sys.exit(args.exit)
""")


def entry(ok: int, n: int = 10, threshold: float = 0.9, **fields) -> dict:
    """A client's entry of report.json (clients.run.run_one) with `ok` of `n` tasks checked."""
    tasks = [{"task": f"task {i}", "returncode": 0, "checked": i < ok, "problem": None if i < ok else "not created",
              "seconds": 1.0, "requests": 1, "tool_calls": 1, "tool_results": 1} for i in range(n)]
    return {"client": "hermes", "wall_s": 10.0, "tasks": tasks, "injected_oom": 0, "tasks_ok": ok,
            "threshold": threshold, "requests": n, "statuses": {"POST /v1/chat/completions 200": n},
            "errors": [], "stream_errors": [], "tool_calls": n, "tool_results": n, "prompt_tokens": 100,
            "cached_tokens": 50, "completion_tokens": 10, "server_alive": True, **fields}


@pytest.fixture
def fake_run(tmp_path: Path, monkeypatch) -> Path:
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(steps, "RUN_COMMAND", [sys.executable, str(script)])
    return tmp_path / "run"


def test_a_score_below_its_threshold_is_reported_and_is_no_failure(fake_run: Path, capfd) -> None:
    code = steps.main(["--out", str(fake_run), "heldout=--score 8/10", "reference=--score 9/10"])
    out = capfd.readouterr().out
    assert code == 0
    summary = out[out.index("== summary"):].splitlines()
    assert summary[1:] == ["heldout: ran", "  hermes: 8/10 (threshold 90%: BELOW)",
                           "reference: ran", "  hermes: 9/10 (threshold 90%: met)",
                           "2 of 2 steps ran cleanly; scores below a threshold are findings, not failures"]
    assert (fake_run / "summary.txt").read_text().splitlines() == summary


def test_a_step_that_could_not_run_fails_the_run_and_the_steps_after_it_still_run(fake_run: Path,
                                                                                   capfd) -> None:
    code = steps.main(["--out", str(fake_run), "heldout=--skipped 'npm is not installed'",
                       "reference=--exit 1 --no-report", "reference-oom=--score 10/10"])
    out = capfd.readouterr().out
    assert code == 1
    assert (fake_run / "reference-oom" / "report.json").is_file()
    summary = out[out.index("== summary"):]
    assert "heldout: FAILED, clients.run exit 0" in summary and "codex: not run (npm is not installed)" in summary
    assert "reference: FAILED, clients.run exit 1, no report" in summary
    assert "reference-oom: ran\n  hermes: 10/10 (threshold 90%: met)" in summary
    assert summary.splitlines()[-1].startswith("1 of 3 steps ran cleanly; failed: heldout, reference")


def test_clients_run_reports_scores_against_the_threshold_and_fails_only_on_errors_of_ours(capsys) -> None:
    met, below = entry(9), entry(8)
    assert run.exit_status([met, below], faults="") == 0
    run.print_table([met, below])
    assert "tasks checked 9/10 (threshold 90%: met)" in capsys.readouterr().out
    assert run.score(below) == "8/10 (threshold 90%: BELOW)" and run.score(entry(7, threshold=0.7)).endswith("met)")
    assert run.exit_status([entry(10, errors=["POST /v1/responses 500: ..."])], faults="") == 1
    assert run.exit_status([entry(10, server_alive=False)], faults="") == 1
    assert run.exit_status([entry(10)], faults="prefill:oom:3") == 1, "the injected fault reached no client"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_clients_runs_every_step_through_one_summary() -> None:
    dry = subprocess.run(["make", "-n", "clients"], cwd=ROOT, capture_output=True, text=True, check=True)
    command = next(shlex.split(line) for line in dry.stdout.splitlines() if "clients.steps" in line)
    named = dict(arg.split("=", 1) for arg in command[3:])
    assert list(named) == ["heldout", "reference", "reference-oom"]
    assert all("--threshold 0.9" in flags for flags in named.values())
    assert "--heldout-tasks 10" in named["heldout"] and "--faults prefill:oom:" in named["reference-oom"]
