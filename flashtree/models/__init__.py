"""Pure-PyTorch model definitions (no serving logic): dense causal LMs and the DFlash draft."""
