"""hermes-agent (PyPI `hermes-agent`): Chat Completions with tools, run one-shot with `hermes -z`.

Configuration: `$HERMES_HOME/config.yaml` with a `custom` provider pointing at the server's /v1.
hermes reads the context length from the server (/props, /v1/models) and refuses less than 64K,
so the server must run with `--max-ctx 65536` or more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from . import install
from .common import AgentClient, Endpoint, Task

# The reference validation: ten small tasks in a row against one server. They stay within what
# the embedded model was trained on (facts, arithmetic, words, greetings), so that a run on a CPU
# measures the server, not a tiny model's rambling.
TASKS = [
    Task("Hello, who are you?"),
    Task("What is the capital of Norway?", answer="Oslo"),
    Task("What is 72 * 81?", answer="5832"),
    Task("Spell the word \"light\" backwards.", answer="thgil"),
    Task("How many vowels does \"bridge\" contain?", answer="2"),
    Task("Tell me the capital of Brazil.", answer="Brasilia"),
    Task("Add 2030 and 5367.", answer="7397"),
    Task("What is a dolphin?", answer="mammal"),
    Task("Sort these numbers from smallest to largest: 10, 42, 17, 61.", answer="10, 17, 42, 61"),
    Task("What is 2291 - 642?", answer="1649"),
]


class Hermes(AgentClient):
    """`toolsets` restricts the tools offered (None = hermes' defaults for the CLI);
    `max_tokens` caps each completion (None = hermes' default)."""

    def __init__(self, toolsets: Optional[str] = None, max_tokens: Optional[int] = None,
                 timeout_s: float = 900):
        super().__init__("hermes", list(TASKS), timeout_s)
        self.toolsets = toolsets
        self.max_tokens = max_tokens

    def executable(self) -> Path:
        return install.hermes()

    def configure(self, home: Path, endpoint: Endpoint) -> dict[str, str]:
        hermes_home = home / ".hermes"
        hermes_home.mkdir(parents=True, exist_ok=True)
        model = {"provider": "custom", "default": endpoint.model, "base_url": endpoint.url + "/v1",
                 "api_key": endpoint.api_key}
        if self.max_tokens:
            model["max_tokens"] = self.max_tokens
        # JSON is YAML: no YAML writer needed for a config this small
        (hermes_home / "config.yaml").write_text(json.dumps({"model": model}, indent=2) + "\n")
        return {"HERMES_HOME": str(hermes_home)}

    def argv(self, task: str, workdir: Path) -> list[str]:
        argv = [str(self.executable()), "--ignore-rules"]
        if self.toolsets:
            argv += ["-t", self.toolsets]
        return argv + ["-z", task]
