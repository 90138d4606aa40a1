"""Batch-1 runtime: KV cache, sampling, tree building, the decode loops and the engine."""
