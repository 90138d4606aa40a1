"""flashtree: batch-1 LLM inference with DFlash drafting and DDTree verification.

The public names are imported on first use (PEP 562), not by `import flashtree`: the HTTP
process, the CLI and the training-data tools import submodules of this package and must not pay
for torch (seconds) or need a GPU stack just because the package root names the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "Engine": "flashtree.runtime.engine",
    "GenerationResult": "flashtree.runtime.generation",
    "GenerationStats": "flashtree.runtime.generation",
    "GenerationStream": "flashtree.runtime.generation",
    "SamplingParams": "flashtree.sampling_params",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ provides these
    from .runtime.engine import Engine
    from .runtime.generation import GenerationResult, GenerationStats, GenerationStream
    from .sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashtree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
