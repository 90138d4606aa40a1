"""OpenCode (npm `opencode-ai`): Chat Completions through an OpenAI-compatible provider, run
one-shot with `opencode run`.

Configuration: `$XDG_CONFIG_HOME/opencode/opencode.json` declaring a provider built on
`@ai-sdk/openai-compatible` with the server's /v1 as baseURL and the served model with its
context and output limits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from . import install
from .common import AgentClient, Endpoint, file_tasks
from .server import AGENT_MAX_CTX

TASKS = file_tasks("opencode")
OUTPUT_LIMIT = 4096


class OpenCode(AgentClient):
    """`max_output_tokens` is the model's output limit in the config (None = OUTPUT_LIMIT)."""

    def __init__(self, max_output_tokens: Optional[int] = None, timeout_s: float = 900):
        super().__init__("opencode", list(TASKS), timeout_s)
        self.output_limit = max_output_tokens or OUTPUT_LIMIT
        self.model_ref = ""

    def executable(self) -> Path:
        return install.npm_client("opencode")

    def configure(self, home: Path, endpoint: Endpoint) -> dict[str, str]:
        config_dir = home / ".config" / "opencode"
        config_dir.mkdir(parents=True, exist_ok=True)
        self.model_ref = f"flashtree/{endpoint.model}"
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"flashtree": {
                "npm": "@ai-sdk/openai-compatible", "name": "flashtree",
                "options": {"baseURL": endpoint.url + "/v1", "apiKey": endpoint.api_key},
                "models": {endpoint.model: {"name": endpoint.model, "tool_call": True,
                                            "limit": {"context": AGENT_MAX_CTX, "output": self.output_limit}}}}},
            "model": self.model_ref,
            "autoupdate": False,
            "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow"},
        }
        (config_dir / "opencode.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}

    def argv(self, task: str, workdir: Path) -> list[str]:
        return [str(self.executable()), "run", "--model", self.model_ref, "--dir", str(workdir), task]
