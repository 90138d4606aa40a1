"""Real agent clients (hermes-agent, Codex CLI, Claude Code, OpenCode) run against flashtree serve;
see docs/CLIENTS.md and `python -m clients.run --help`."""
