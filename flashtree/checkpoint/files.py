"""Reading a checkpoint's small files (config, tokenizer config, shard index, tokenizer, template).

Every reader of a checkpoint goes through here so that a missing or broken file is always a
CheckpointError naming the file, never a bare OSError or JSONDecodeError from deep in a loader.
A checkpoint is downloaded data: a file may be a symlink to /dev/zero, a FIFO, or gigabytes of
text. So a file must be a regular file, and no more than a cap of it is ever read: a hostile
file is refused in one line instead of filling memory until the OOM killer ends the process.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

from ..errors import CheckpointError

MIB = 1 << 20
# config.json, tokenizer_config.json, generation_config.json, model.safetensors.index.json and
# chat_template.jinja: the largest published ones (the shard index of a model with ~100k tensors,
# a tokenizer_config.json listing ~250k added tokens) are under 10 MiB, and 32 MiB of JSON parses
# into at most a few hundred MB of Python objects.
SMALL_FILE_LIMIT = 32 * MIB
# tokenizer.json holds the whole vocabulary and merges: a 262k-token vocabulary takes ~35 MB.
TOKENIZER_FILE_LIMIT = 256 * MIB
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
              float: "a number", bool: "a boolean", type(None): "null"}


def read_bytes(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, refused (CheckpointError naming it) when missing, not
    a regular file, or larger than `limit`: at most limit + 1 bytes are read, so a file that grows
    while it is read is refused too. It is opened without blocking, so that a FIFO is refused
    instead of waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory itself
        os.close(fd)
        raise CheckpointError(f"cannot read {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    if len(data) > limit:
        raise CheckpointError(f"cannot read {path}: larger than its limit of {limit // MIB} MiB")
    return data


def read_text(path: Path, limit: int = SMALL_FILE_LIMIT) -> str:
    """The UTF-8 text of `path` (read_bytes' checks and cap); other bytes are a CheckpointError."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`. A missing, unreadable or oversized file, malformed JSON, JSON
    nested deeper than the parser's recursion allows or holding an integer of more digits than
    int() converts, or a value that is not an object (every
    checkpoint JSON file is one, and its readers call .get on it) is a CheckpointError naming it."""
    text = read_text(path)
    try:
        value = json.loads(text)
    except ValueError as e:  # malformed (JSONDecodeError), or an integer of more digits than int() takes
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: nested too deeply") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {JSON_TYPES[type(value)]}")
    return value


def read_optional_json(path: Path) -> Optional[dict[str, Any]]:
    """Like read_json, for the files a checkpoint may leave out (generation_config.json,
    tokenizer_config.json): None when absent, still an error when present but broken (a dangling
    symlink, a directory or a device among them: none of them is a file left out)."""
    return read_json(path) if os.path.lexists(path) else None
