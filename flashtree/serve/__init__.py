"""The HTTP serving layer: OpenAI-compatible routes in this process, the engine in a worker.

Import the submodules directly (`flashtree.serve.chat`, `flashtree.serve.cli`, ...); nothing is
re-exported here so that importing the chat renderer does not pull in the web stack.
"""
