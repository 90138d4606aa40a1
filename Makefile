# Real agent clients end to end (docs/CLIENTS.md): installs hermes-agent (PyPI, own venv) and
# Codex CLI, Claude Code, OpenCode (npm, about 1 GB) into clients/.install, then runs each on its
# tasks against `flashtree serve` on the embedded model; results land in clients/.runs/DATE.
PYTHON ?= python3
# Claude Code offers only these built-in tools (a ~6K-token prompt instead of ~27K, which the
# embedded model does not answer within; docs/CLIENTS.md); `make clients CLIENTS_FLAGS=` runs all.
# Every client gets ten held-out tasks of the agent stage, checked by file content or output.
CLIENTS_FLAGS ?= --claude-tools Bash,Read,Write,Edit,Glob,Grep --task-timeout 300 --heldout-tasks 10

.PHONY: clients clients-install clients-reference

clients-install:
	$(PYTHON) -m clients.install

clients: clients-install
	$(PYTHON) -m clients.run $(CLIENTS_FLAGS)

# hermes' ten-task reference loop (its answers checked); with one injected OOM: tests/test_hermes_agent.py
clients-reference: clients-install
	$(PYTHON) -m clients.run --clients hermes --task-timeout 300
