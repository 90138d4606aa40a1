"""flashtree: batch-1 LLM inference with DFlash drafting and DDTree verification."""

from .runtime.engine import Engine, GenerationResult, GenerationStats, GenerationStream
from .runtime.sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "GenerationStats", "GenerationStream", "SamplingParams"]
__version__ = "0.1.0"
