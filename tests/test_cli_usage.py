"""What a user sees when a command is used wrongly or asked for help: one line and exit 2, never
a traceback, and help text that says what each flag does. Every check runs the real command in
a subprocess, as a user would."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
FLASHTREE = [sys.executable, "-m", "flashtree.cli"]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "FLASHTREE_FAULTS"}
    full_env.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run([*FLASHTREE, *args], capture_output=True, text=True, timeout=120,
                          env=full_env, cwd=REPO_ROOT)


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("args", [
    ["--help"], ["generate", "--help"], ["serve", "--help"], ["train", "--help"], ["bench", "--help"],
    ["generate", "--prompt", "x", "--max-tokens", "1"], ["serve", "--port", "0"]])
def test_invalid_fault_spec_is_one_line_for_every_command(args):
    r = run(*args, FLASHTREE_FAULTS="prefill:explode:1")
    assert_one_line_error(r, "FLASHTREE_FAULTS", "prefill:explode:1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line():
    assert_one_line_error(run("generate", "--device", "cuda", "--prompt", "x"), "cuda", "CUDA")


def test_generate_on_an_unknown_device_is_one_line():
    assert_one_line_error(run("generate", "--device", "tpu7", "--prompt", "x"), "tpu7")


def test_serve_with_a_file_as_cache_dir_says_so(tmp_path):
    not_a_dir = tmp_path / "kv"
    not_a_dir.write_text("")
    r = run("serve", "--port", "0", "--cache-dir", str(not_a_dir))
    assert r.returncode == 2, r.stderr
    assert f"{not_a_dir} is a file, not a directory" in r.stderr
    assert "cannot load the model" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_states_each_default_once(command):
    options = [" ".join(o.split()) for o in re.split(r"\n  (?=-)", run(command, "--help").stdout)[1:]]
    assert len(options) > 20
    for option in options:  # one per flag, its wrapped lines joined
        assert option.count("(default:") <= 1, option


def test_help_of_a_no_flag_describes_what_it_turns_off():
    options = [" ".join(o.split()) for o in re.split(r"\n  (?=-)", run("generate", "--help").stdout)]
    no_chain_seed = next(o for o in options if o.startswith("--no-chain-seed ")).removeprefix("--no-chain-seed ")
    assert no_chain_seed.startswith("do not "), no_chain_seed
    assert "(default: True)" not in no_chain_seed


def test_numpy_is_a_dependency():
    """torch prints "Failed to initialize NumPy" at import where numpy is missing (a fresh
    `pip install torch -e .` does not bring it), once per process that imports torch."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "numpy" for dep in project["dependencies"])


def test_generate_prints_its_text_and_one_summary_line_and_its_setup_only_when_verbose():
    """stdout is the text; stderr is the one-line summary (mode, tokens, tokens/s, accept length),
    the engine's setup logs (CPU threads, memory plan, prefill) only with -v."""
    args = ("generate", "--prompt", "def add(a, b):\n", "--max-tokens", "4")
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert re.fullmatch(r"\[(ddtree|chain|ar)\] \d+ tokens, finish=\w+, prefill [\d.]+s, decode [\d.]+ tok/s, "
                        r"mean accept length [\d.]+\n", r.stderr), r.stderr
    verbose = run(*args, "-v")
    assert verbose.returncode == 0 and verbose.stdout == r.stdout
    assert "flashtree: memory plan:" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].split(", prefill")[0] == r.stderr.split(", prefill")[0]
