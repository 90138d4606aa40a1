"""The client harness never leaves an agent client running: not at a task's timeout, and not when
the harness itself is stopped from outside (a real SIGTERM to a real process)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from clients.common import run_task

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """Running (a killed child that nobody has reaped yet is a zombie: not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _dies(pid: int, within_s: float = 10.0) -> bool:
    """Whether `pid` stops running within `within_s`: a process group's SIGKILL reaches the
    grandchild at once, but on a busy machine it may run on for a moment before it exits."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _client_that_spawns(pid_file: Path) -> list[str]:
    # a "client" whose own child outlives it unless the whole process group is killed
    return ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]


def _wait_for(path: Path) -> int:
    for _ in range(200):
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_a_task_timeout_kills_the_clients_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    result = run_task(_client_that_spawns(pid_file), dict(os.environ), tmp_path, tmp_path / "task", timeout_s=1.0)
    assert result.returncode == -9
    assert _dies(_wait_for(pid_file))


def test_stopping_the_harness_stops_the_running_client(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        from clients.common import run_task
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as clients.run.main does
        run_task({_client_that_spawns(pid_file)!r}, dict(os.environ), Path({str(tmp_path)!r}),
                 Path({str(tmp_path / "task")!r}), timeout_s=600)
    """)
    harness = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = _wait_for(pid_file)
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=30) == 143
    assert _dies(child)


def test_an_install_of_another_version_than_the_pinned_one_is_not_used(tmp_path: Path, monkeypatch) -> None:
    from clients import install

    monkeypatch.setattr(install, "INSTALL_DIR", tmp_path)
    monkeypatch.setattr(install, "VENV_DIR", tmp_path / "venv")
    assert install.installed_version("@openai/codex") is None
    manifest = tmp_path / "node_modules" / "@openai" / "codex" / "package.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"name": "@openai/codex", "version": "0.1.0"}')
    assert install.installed_version("@openai/codex") == "0.1.0" != install.VERSIONS["@openai/codex"]
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / f"hermes_agent-{install.VERSIONS['hermes-agent']}.dist-info").mkdir(parents=True)
    assert install.installed_version("hermes-agent") == install.VERSIONS["hermes-agent"]
    # every npm package is installed at its pinned version
    assert install.npm_spec("@openai/codex") == f"@openai/codex@{install.VERSIONS['@openai/codex']}"
    assert set(install.NPM_COMMANDS.values()) <= set(install.VERSIONS)


FAKE_NPM = """\
import json, sys
from pathlib import Path
args = sys.argv[1:]  # install ... --prefix DIR NAME@VERSION, as clients.install calls it
prefix, (name, version) = Path(args[args.index("--prefix") + 1]), args[-1].rsplit("@", 1)
package = prefix / "node_modules" / name
package.mkdir(parents=True)
(package / "package.json").write_text(json.dumps({"name": name, "version": version}))
(package / "bin.js").write_bytes(bytes(3_000_000))
(prefix / "node_modules" / ".bin").mkdir()
(prefix / "node_modules" / ".bin" / "codex").symlink_to(package / "bin.js")
print("fake npm: added 1 package")
"""


def test_an_install_shows_the_installers_output_and_what_each_package_took(tmp_path: Path, monkeypatch,
                                                                           capfd) -> None:
    """A first install downloads about 1 GB: npm's own output reaches the terminal, and each
    package ends with a line of the megabytes it added and the seconds it took."""
    from clients import install

    npm = tmp_path / "bin" / "npm"
    npm.parent.mkdir()
    npm.write_text(f"#!{sys.executable}\n{FAKE_NPM}")
    npm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{npm.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(install, "INSTALL_DIR", tmp_path / "install")
    monkeypatch.setattr(install, "NPM_BIN", tmp_path / "install" / "node_modules" / ".bin")
    assert install.npm_client("codex") == install.NPM_BIN / "codex"
    out = capfd.readouterr().out
    spec = install.npm_spec("@openai/codex")
    assert f"installing {spec} into " in out and "fake npm: added 1 package" in out
    assert re.search(rf"installed {re.escape(spec)}: 3 MB in \d+ s", out), out


def test_a_stop_while_the_client_starts_still_stops_it(tmp_path: Path) -> None:
    """SIGTERM delivered inside Popen, after the client forked but before run_task holds its pid
    (what a busy machine made of the test above once): the client still dies with the harness."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from pathlib import Path
        from clients.common import run_task
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        real = subprocess.Popen

        class StoppedWhileStarting(real):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                while not Path({str(pid_file)!r}).exists():
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler runs here, inside Popen, unless it is held

        subprocess.Popen = StoppedWhileStarting
        run_task({_client_that_spawns(pid_file)!r}, dict(os.environ), Path({str(tmp_path)!r}),
                 Path({str(tmp_path / "task")!r}), timeout_s=600)
    """)
    harness = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert harness.wait(timeout=30) == 143
    assert _dies(_wait_for(pid_file))
