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

# The share of its tasks each client should pass, reported with its score (clients.run
# --threshold), not a failure of `make`: 9 of 10 is the least the recorded runs of the shipped
# pair and of the round it averages scored (docs/CLIENTS.md: held-out 10 / 9 / 10 / 9 of 10,
# hermes' loop 9 of 10).
CLIENTS_THRESHOLD ?= 0.9

# each step's clients.run flags
HELDOUT = $(CLIENTS_FLAGS) --threshold $(CLIENTS_THRESHOLD)
REFERENCE = --clients hermes --task-timeout 300 --threshold $(CLIENTS_THRESHOLD)
REFERENCE_OOM = $(REFERENCE) --faults $(OOM_FAULTS)

.PHONY: clients clients-install clients-heldout clients-reference clients-reference-oom

clients-install:
	$(PYTHON) -m clients.install

# a whole run: the held-out tasks of all four clients, then hermes' ten-task
# loop, then the same loop with one injected OOM. Every step runs, whatever the one before scored;
# the summary at the end lists each step's scores against its threshold. `make` fails only when a
# step could not run or met an error of ours (clients.steps), not on a score below its threshold.
clients: clients-install
	$(PYTHON) -m clients.steps heldout="$(HELDOUT)" reference="$(REFERENCE)" reference-oom="$(REFERENCE_OOM)"

clients-heldout: clients-install
	$(PYTHON) -m clients.run $(HELDOUT)

# hermes' ten-task reference loop (its answers checked); also tests/test_hermes_agent.py (slow)
clients-reference: clients-install
	$(PYTHON) -m clients.run $(REFERENCE)

clients-reference-oom: clients-install
	$(PYTHON) -m clients.run $(REFERENCE_OOM)
