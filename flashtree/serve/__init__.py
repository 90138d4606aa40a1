"""The HTTP serving layer: OpenAI-compatible routes in this process, the engine in a worker.

Import the submodules directly (`flashtree.serve.chat`, `flashtree.serve.cli`, ...); nothing is
re-exported here so that importing the detokenizer or the parsers does not pull in the web stack.
No module here imports torch (tests/test_layers.py checks): the worker's process entry function
imports the engine inside that process.
"""
