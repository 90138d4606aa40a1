# Real agent clients end to end (docs/CLIENTS.md): installs hermes-agent (PyPI, own venv) and
# Codex CLI, Claude Code, OpenCode (npm, about 1 GB) into clients/.install, then runs each on its
# tasks against `flashtree serve` on the embedded model; results land in clients/.runs/DATE.
PYTHON ?= python3
# Claude Code offers only these built-in tools (a ~6K-token prompt instead of ~27K, which the
# embedded model does not answer within; docs/CLIENTS.md); `make clients CLIENTS_FLAGS=` runs all.
CLIENTS_FLAGS ?= --claude-tools Bash,Read,Write,Edit,Glob,Grep --task-timeout 300

.PHONY: clients clients-install

clients-install:
	$(PYTHON) -m clients.install

clients: clients-install
	$(PYTHON) -m clients.run $(CLIENTS_FLAGS)
