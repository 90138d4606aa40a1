"""Reading a checkpoint's small JSON files (config, tokenizer config, shard index).

Every reader of a checkpoint goes through here so that a missing or broken file is always a
CheckpointError naming the file, never a bare OSError or JSONDecodeError from deep in a loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ..errors import CheckpointError


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a missing or unreadable file is a CheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def read_optional_json(path: Path) -> Optional[dict[str, Any]]:
    """Like read_json, for the files a checkpoint may leave out (generation_config.json,
    tokenizer_config.json): None when absent, still an error when present but broken."""
    return read_json(path) if path.is_file() else None
