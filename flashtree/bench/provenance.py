"""Which code a benchmark result came from: the commit, and a digest of the package's sources;
and the card, in the result file's name (device_slug).

The device machine runs a copy of the working tree whose .git can be stale (then every run
records the same old HEAD), and a run is often made from uncommitted changes. So a
result records the commit as the run was told it (FLASHTREE_COMMIT, e.g. `FLASHTREE_COMMIT=$(git
rev-parse HEAD)` put into the command line where it is written) or as .git says, and beside it
`source_digest`, a hash of every .py file of the flashtree package: the same digest means the
same engine code, whatever .git said. `python -m flashtree.bench.provenance` prints both for a
checkout, e.g. after `git checkout <commit>`."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

PACKAGE = Path(__file__).resolve().parents[1]


def commit(repo: Path = PACKAGE.parent) -> str:
    """FLASHTREE_COMMIT if set, else the checkout's HEAD read from .git without running git (the
    device's copy has no git), else "unknown"."""
    told = os.environ.get("FLASHTREE_COMMIT")
    if told:
        return told
    git = repo / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"


def source_digest(package: Path = PACKAGE) -> str:
    """sha256 (first 16 hex digits) over the package's .py files: each relative path, then its
    bytes, in path order."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def provenance() -> dict:
    """The fields a result file records: commit and source_digest, and the FLASHTREE_* settings
    of the environment that change how the code runs (`settings`, e.g. an A/B of a launch's
    FLASHTREE_L2_PREFETCH_MB), where any is set."""
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLASHTREE_") and k != "FLASHTREE_COMMIT"}
    return {"commit": commit(), "source_digest": source_digest(), **({"settings": settings} if settings else {})}


def device_slug(name: Optional[str] = None) -> str:
    """The GPU's model as the short name a result file carries (`quant_gemv_h200.json`): its
    name (`name`, else CUDA device 0's) without the vendor words and from its memory size on,
    lowercased, other characters as dashes. "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200"
    -> "h200", "NVIDIA GeForce RTX 4090" -> "rtx-4090": the file says which card made it, in the
    same words whichever benchmark wrote it."""
    if name is None:
        import torch

        name = torch.cuda.get_device_name()
    words = []
    for word in name.split():
        if re.fullmatch(r"\d+GB", word, re.IGNORECASE):
            break
        if word.lower() not in ("nvidia", "geforce"):
            words.append(word)
    return re.sub(r"[^a-z0-9]+", "-", " ".join(words).lower()).strip("-") or "gpu"


if __name__ == "__main__":
    print(provenance())
