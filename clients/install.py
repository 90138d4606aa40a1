"""Install the agent clients the way their users do, into clients/.install (git-ignored).

hermes-agent comes from PyPI into its own virtual environment: it pins its dependencies exactly
(openai among them), which must not replace the versions flashtree is tested with. Codex,
Claude Code and OpenCode come from the npm registry (about 1 GB together), one package at a time.
Nothing is installed twice: an existing install of the pinned version is used as it is; one of
another version is replaced. pip's and npm's own output goes to the terminal as they run (a first
install downloads for minutes), and each package ends with a line of the megabytes it added and
the seconds it took.

The versions are pinned (VERSIONS) so that a run measures the server, not a client's release of
the week: clients change their prompts, tools and wire details often. docs/CLIENTS.md says how to
move a pin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

INSTALL_DIR = Path(__file__).resolve().parent / ".install"
VENV_DIR = INSTALL_DIR / "venv"
NPM_BIN = INSTALL_DIR / "node_modules" / ".bin"
PIP_PACKAGE = "hermes-agent"
NPM_COMMANDS = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code", "opencode": "opencode-ai"}
# the releases the recorded runs (docs/CLIENTS.md) and the recorded formats
# (flashtree/train/assets/client_tools) come from
VERSIONS = {PIP_PACKAGE: "0.19.0", "@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.197",
            "opencode-ai": "1.18.33"}


class InstallError(RuntimeError):
    """A client could not be installed (no registry, no npm, a failing build)."""


def npm_spec(package: str) -> str:
    """An npm package at its pinned version, as `npm install` takes it."""
    return f"{package}@{VERSIONS[package]}"


def disk_bytes(root: Path) -> int:
    """Bytes of the files under `root` (links not followed; 0 when it does not exist)."""
    return sum((Path(d) / name).lstat().st_size for d, _, names in os.walk(root) for name in names)


def _run(cmd: list[str], what: str, into: Path) -> None:
    """Run an installer with its output on the terminal, then say what it added to `into` and in
    how long: a download of hundreds of megabytes must not look like a hang."""
    print(f"installing {what} into {into} ...", flush=True)
    before, start = disk_bytes(into), time.monotonic()
    returncode = subprocess.run(cmd).returncode
    if returncode != 0:
        raise InstallError(f"{what} failed (exit {returncode}, its output is above): {' '.join(cmd)}")
    print(f"installed {what}: {(disk_bytes(into) - before) / 1e6:,.0f} MB in {time.monotonic() - start:.0f} s",
          flush=True)


def hermes() -> Path:
    """The `hermes` executable, installing hermes-agent into its own venv when missing."""
    exe = VENV_DIR / "bin" / "hermes"
    if exe.is_file() and installed_version(PIP_PACKAGE) == VERSIONS[PIP_PACKAGE]:
        return exe
    if sys.version_info < (3, 11):
        raise InstallError("hermes-agent needs Python >= 3.11")
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
    spec = f"{PIP_PACKAGE}=={VERSIONS[PIP_PACKAGE]}"
    _run([str(VENV_DIR / "bin" / "python"), "-m", "pip", "install", spec], spec, VENV_DIR)
    if not exe.is_file():
        raise InstallError(f"{PIP_PACKAGE} installed but {exe} is missing")
    return exe


def installed_version(package: str) -> str | None:
    """The version of `package` installed under INSTALL_DIR (None when it is not there)."""
    if package == PIP_PACKAGE:
        found = sorted(VENV_DIR.glob("lib/python*/site-packages/hermes_agent-*.dist-info"))
        return found[-1].name.removesuffix(".dist-info").split("-", 1)[1] if found else None
    manifest = INSTALL_DIR / "node_modules" / package / "package.json"
    try:
        return json.loads(manifest.read_text()).get("version")
    except (OSError, json.JSONDecodeError):
        return None


def npm_client(command: str) -> Path:
    """The executable of an npm client (codex, claude, opencode), installing its package when it
    is missing or not the pinned version."""
    package = NPM_COMMANDS[command]
    exe = NPM_BIN / command
    if exe.exists() and installed_version(package) == VERSIONS[package]:
        return exe
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    try:
        _run(["npm", "install", "--save-exact", "--no-audit", "--no-fund", "--prefix", str(INSTALL_DIR),
              npm_spec(package)], npm_spec(package), INSTALL_DIR / "node_modules")
    except FileNotFoundError:
        raise InstallError("npm is not installed (Node.js >= 18 is needed for the npm clients)") from None
    if not exe.exists():
        raise InstallError(f"npm installed {NPM_COMMANDS[command]} but {exe} is missing")
    return exe


def main() -> int:
    """`python -m clients.install`: install every client, print where each one is."""
    try:
        print(f"hermes   {VERSIONS[PIP_PACKAGE]:8s}", hermes())
        for command, package in NPM_COMMANDS.items():
            print(f"{command:8s} {VERSIONS[package]:8s}", npm_client(command))
    except InstallError as e:
        print(f"clients.install: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
