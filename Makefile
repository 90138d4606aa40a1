# Real agent clients end to end (docs/CLIENTS.md): installs hermes-agent (PyPI, own venv) and
# Codex CLI, Claude Code, OpenCode (npm, about 1 GB) into clients/.install, then runs each on its
# tasks against `flashtree serve` on the embedded model; results land in clients/.runs/DATE.
PYTHON ?= python3
# Claude Code offers only these built-in tools (a ~6K-token prompt instead of ~27K, which the
# embedded model does not answer within; docs/CLIENTS.md); `make clients CLIENTS_FLAGS=` runs all.
# Every client gets ten held-out tasks of the agent stage, checked by file content or output.
CLIENTS_FLAGS ?= --claude-tools Bash,Read,Write,Edit,Glob,Grep --task-timeout 300 --heldout-tasks 10

# the reference loop's injected out-of-memory failure: the first prefill chunk of hermes' sixth
# request and the engine's own retry of it (docs/CLIENTS.md), so that hermes meets one 503
OOM_FAULTS ?= prefill:oom:36,prefill:oom:37

.PHONY: clients clients-install clients-heldout clients-reference clients-reference-oom

clients-install:
	$(PYTHON) -m clients.install

# everything issue 16 asks of a run: the held-out tasks of all four clients, then hermes' ten-task
# loop, then the same loop with one injected OOM; each step stops `make` when it fails
clients: clients-heldout clients-reference clients-reference-oom

clients-heldout: clients-install
	$(PYTHON) -m clients.run $(CLIENTS_FLAGS)

# hermes' ten-task reference loop (its answers checked); also tests/test_hermes_agent.py (slow)
clients-reference: clients-install
	$(PYTHON) -m clients.run --clients hermes --task-timeout 300

clients-reference-oom: clients-install
	$(PYTHON) -m clients.run --clients hermes --task-timeout 300 --faults $(OOM_FAULTS)
