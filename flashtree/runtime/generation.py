"""What a generation hands back: its stats, its result, and the stream that yields its tokens
step by step (the engine's `_run` fills them; the server and the CLI read them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

from .sampling import TokenLogprob


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    snapshot_s: float = 0.0  # of prefill_s: saving the live state, restoring a snapshot
    prefill_chunks: int = 0
    slowest_chunk_s: float = 0.0  # the longest prefill forward's wall time (a JIT compile shows here)
    step_s: float = 0.0  # of decode_s: inside the decode steps (the rest streamed their tokens out)
    drafted_ahead: int = 0  # steps whose draft was queued before the host read the step before
    shared_steps: int = 0  # steps whose verify forward also held other sequences' trees (batch_step.py)
    preemptions: int = 0  # times its rows were taken for another sequence's pages, then restored
    alloc_retries: int = 0  # CUDA allocations that had to free the allocator's cache and retry
    device_mallocs: int = 0  # the allocator's cudaMalloc calls (memory_plan.allocator_counts)
    device_frees: int = 0  # and its cudaFree calls, each a device synchronization

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        decoded = sum(self.accept_lengths)
        return decoded / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accept_length"] = round(self.mean_accept_length, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: GenerationStats
    trace: Optional[list[dict]] = None
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, when the sampling asked


class GenerationStream:
    """Iterate for the token ids of each step; `cancel()` stops at the next step boundary;
    `result` holds the GenerationResult once the iteration has ended. When the sampling asks for
    logprobs, `logprobs` holds one per token id yielded so far (else it stays None); when the
    generation was asked for a trace, `traces` holds one per decode step read so far (the ids
    the first yield carries come from the prefill, each later yield's from the step traced last),
    so that a caller can send each step's tree with its tokens."""

    def __init__(self, body: Callable[["GenerationStream"], Iterator[list[int]]]):
        self.cancelled = False
        self.result: Optional[GenerationResult] = None
        self.logprobs: Optional[list[TokenLogprob]] = None
        self.traces: Optional[list[dict]] = None
        self._it = body(self)

    def __iter__(self) -> Iterator[list[int]]:
        return self._it

    def cancel(self) -> None:
        self.cancelled = True
