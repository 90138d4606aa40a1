# Real agent clients end to end (docs/CLIENTS.md): installs hermes-agent (PyPI, own venv) and
# Codex CLI, Claude Code, OpenCode (npm, about 1 GB) into clients/.install, then runs each on its
# tasks against `flashtree serve` on the embedded model; results land in clients/.runs/DATE.
PYTHON ?= python3

.PHONY: clients clients-install

clients-install:
	$(PYTHON) -m clients.install

clients: clients-install
	$(PYTHON) -m clients.run
