"""Claude Code (npm `@anthropic-ai/claude-code`): Anthropic Messages, run one-shot with `claude -p`.

Configuration is the environment: ANTHROPIC_BASE_URL (the server root; Claude Code appends
/v1/messages), ANTHROPIC_API_KEY (sent as x-api-key), and the model names it would otherwise
take from Anthropic's catalogue, main and small alike, set to the served model. Its
non-essential traffic stays on (no CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC): that is what sends
the session-title request beside the first turn of the main loop, as a user's Claude Code does,
so that the run serves two of its requests at once; telemetry, error reports and the
auto-updater, which would go to Anthropic's hosts, are off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import install
from .common import AgentClient, Endpoint, file_tasks

TASKS = file_tasks("claude")
ALLOWED_TOOLS = "Bash,Read,Write,Edit,Glob,Grep,LS"


class Claude(AgentClient):
    """`max_output_tokens` caps each answer (CLAUDE_CODE_MAX_OUTPUT_TOKENS; None = its default);
    `tools` restricts the built-in tools offered (claude --tools; None = all of them, a prompt
    of about 27K tokens, most of it tool schemas)."""

    def __init__(self, max_output_tokens: Optional[int] = None, timeout_s: float = 900,
                 tools: Optional[str] = None):
        super().__init__("claude", list(TASKS), timeout_s)
        self.max_output_tokens = max_output_tokens
        self.tools = tools

    def executable(self) -> Path:
        return install.npm_client("claude")

    def configure(self, home: Path, endpoint: Endpoint) -> dict[str, str]:
        cap = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_output_tokens)} if self.max_output_tokens else {}
        return {**cap, "ANTHROPIC_BASE_URL": endpoint.url, "ANTHROPIC_API_KEY": endpoint.api_key,
                "ANTHROPIC_MODEL": endpoint.model, "ANTHROPIC_SMALL_FAST_MODEL": endpoint.model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": endpoint.model,
                "ANTHROPIC_DEFAULT_SONNET_MODEL": endpoint.model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": endpoint.model,
                "DISABLE_AUTOUPDATER": "1",
                "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}

    def argv(self, task: str, workdir: Path) -> list[str]:
        # the task right after -p: --allowedTools takes every word after it
        offered = ["--tools", self.tools] if self.tools else []
        return [str(self.executable()), "-p", task, "--output-format", "json", *offered,
                "--permission-mode", "acceptEdits", "--allowedTools", ALLOWED_TOOLS]
