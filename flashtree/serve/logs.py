"""The log format of `flashtree serve`, for both of its processes: the HTTP process and the
engine worker (a spawned process starts with no logging set up, so without this the engine's
INFO lines, such as its memory plan, would never be printed)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Print flashtree's records from `level` up on stderr, replacing any earlier set-up (the
    `flashtree` command's own one-line format is for one-shot commands)."""
    logging.basicConfig(format=FORMAT, force=True)
    logging.getLogger("flashtree").setLevel(level.upper())
