"""Install the agent clients the way their users do, into clients/.install (git-ignored).

hermes-agent comes from PyPI into its own virtual environment: it pins its dependencies exactly
(openai among them), which must not replace the versions flashtree is tested with. Codex,
Claude Code and OpenCode come from the npm registry (about 1 GB together). Nothing is installed
twice: an existing install of the pinned version is used as it is; one of another version is
replaced.

The versions are pinned (VERSIONS) so that a run measures the server, not a client's release of
the week: clients change their prompts, tools and wire details often. docs/CLIENTS.md says how to
move a pin.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
NPM_PACKAGES = tuple(f"{name}@{VERSIONS[name]}" for name in NPM_COMMANDS.values())


class InstallError(RuntimeError):
    """A client could not be installed (no registry, no npm, a failing build)."""


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise InstallError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def hermes() -> Path:
    """The `hermes` executable, installing hermes-agent into its own venv when missing."""
    exe = VENV_DIR / "bin" / "hermes"
    if exe.is_file() and installed_version(PIP_PACKAGE) == VERSIONS[PIP_PACKAGE]:
        return exe
    if sys.version_info < (3, 11):
        raise InstallError("hermes-agent needs Python >= 3.11")
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
    spec = f"{PIP_PACKAGE}=={VERSIONS[PIP_PACKAGE]}"
    _run([str(VENV_DIR / "bin" / "python"), "-m", "pip", "install", "-q", spec], f"pip install {spec}")
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
    """The executable of an npm client (codex, claude, opencode), installing all three when one
    is missing."""
    exe = NPM_BIN / command
    if exe.exists() and installed_version(NPM_COMMANDS[command]) == VERSIONS[NPM_COMMANDS[command]]:
        return exe
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    try:
        _run(["npm", "install", "--save-exact", "--no-audit", "--no-fund", "--prefix", str(INSTALL_DIR), *NPM_PACKAGES],
             "npm install")
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
