"""Codex CLI (npm `@openai/codex`): the Responses API only, run one-shot with `codex exec`.

Configuration: `$CODEX_HOME/config.toml` with a custom model provider whose `wire_api` is
"responses" and whose key comes from an environment variable.
"""

from __future__ import annotations

from pathlib import Path

from . import install
from .common import AgentClient, Endpoint, file_tasks

TASKS = file_tasks("codex")
KEY_VAR = "FLASHTREE_API_KEY"


class Codex(AgentClient):
    def __init__(self, timeout_s: float = 900):
        super().__init__("codex", list(TASKS), timeout_s)

    def executable(self) -> Path:
        return install.npm_client("codex")

    def configure(self, home: Path, endpoint: Endpoint) -> dict[str, str]:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{endpoint.model}"\n'
            'model_provider = "flashtree"\n'
            'approval_policy = "never"\n'
            'sandbox_mode = "workspace-write"\n'
            "\n[model_providers.flashtree]\n"
            'name = "flashtree"\n'
            f'base_url = "{endpoint.url}/v1"\n'
            'wire_api = "responses"\n'
            f'env_key = "{KEY_VAR}"\n')
        return {"CODEX_HOME": str(codex_home), KEY_VAR: endpoint.api_key}

    def argv(self, task: str, workdir: Path) -> list[str]:
        return [str(self.executable()), "exec", "--skip-git-repo-check", "--color", "never",
                "-C", str(workdir), task]
