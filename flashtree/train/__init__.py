"""Training recipe of the embedded model pair, and DFlash draft training for any target (docs/TRAINING.md)."""
