"""The engine: owns the models, the KV state of the live sequence, and the request loop.

One sequence at a time. The KV of the last request stays ("live sequence"), and a new request
reuses its longest common prefix with it without any copy. Validation happens when a request is
made, before any work, so a caller (the server) can map errors to responses before streaming.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ..checkpoint import (build_module, load_tokenizer, pick_dtype, read_json, read_state_dict,
                          resolve_model_dir)
from ..config import EngineConfig
from ..errors import CheckpointError, ConfigError, ContextLengthError
from ..models.common import RotaryTable
from ..models.dflash import DFlashDraft, DraftConfig
from ..models.qwen3 import CausalLM, LMConfig
from .decoding import Decoder
from .sampling import Sampler, SamplingParams

log = logging.getLogger("flashtree.engine")
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

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


class GenerationStream:
    """Iterate for the token ids of each step; `cancel()` stops at the next step boundary;
    `result` holds the GenerationResult once the iteration has ended."""

    def __init__(self, body: Callable[["GenerationStream"], Iterator[list[int]]]):
        self.cancelled = False
        self.result: Optional[GenerationResult] = None
        self._it = body(self)

    def __iter__(self) -> Iterator[list[int]]:
        return self._it

    def cancel(self) -> None:
        self.cancelled = True


def load_target(ref: str, device: torch.device, dtype: Optional[str], max_pos: int):
    model_dir = resolve_model_dir(ref)
    cfg = read_json(model_dir / "config.json")
    lm_cfg = LMConfig.from_hf(cfg)
    torch_dtype = pick_dtype(dtype, cfg, device)
    state = read_state_dict(model_dir, torch_dtype, device)
    optional = ("lm_head.weight",) if lm_cfg.tie_word_embeddings else ()
    model = build_module(lambda: CausalLM(lm_cfg, max_pos), state, str(model_dir), optional)
    if lm_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = RotaryTable(lm_cfg.head_dim, lm_cfg.rope, max_pos).to(device)
    return model.eval(), load_tokenizer(model_dir, cfg), model_dir, torch_dtype


def load_draft(ref: str, device: torch.device, dtype: torch.dtype, max_pos: int) -> DFlashDraft:
    model_dir = resolve_model_dir(ref)
    dcfg = DraftConfig.from_hf(read_json(model_dir / "config.json"))
    state = read_state_dict(model_dir, dtype, device)
    draft = build_module(lambda: DFlashDraft(dcfg, max_pos), state, str(model_dir))
    draft.rope = RotaryTable(dcfg.head_dim, dcfg.rope, max_pos).to(device)
    return draft.eval()


class Engine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        target_ref, draft_ref = config.target, config.draft
        if target_ref is None:
            target_ref = str(ASSETS / "target")
            draft_ref = draft_ref or (str(ASSETS / "draft") if (ASSETS / "draft").is_dir() else None)
            if not (ASSETS / "target").is_dir():
                raise CheckpointError("no embedded model in this install; pass --target DIR")
        self.max_ctx = config.max_ctx
        scratch = max(config.budget + 1, 64)
        max_pos = self.max_ctx + scratch
        self.target, self.tokenizer, self.model_dir, self.dtype = load_target(
            target_ref, self.device, config.dtype, max_pos)
        self.draft: Optional[DFlashDraft] = None
        mode = config.mode
        if draft_ref is not None:
            self.draft = load_draft(draft_ref, self.device, self.dtype, max_pos)
            self.draft.check_fits(self.target.config)
        elif mode != "ar":
            log.warning("no draft model given: decoding autoregressively (mode ar)")
            mode = "ar"
        self.mode = mode
        self.block_size = config.block_size or (self.draft.config.block_size if self.draft else 1)
        self.tcache = self.target.new_cache(max_pos, self.dtype, self.device)
        self.dcache = self.draft.new_cache(max_pos, self.dtype, self.device) if self.draft else None
        self.decoder = Decoder(self.target, self.draft, self.tcache, self.dcache, mode,
                               config.budget, self.block_size, config.chain_seed)
        self.seq_tokens: list[int] = []  # tokens whose KV rows are committed (the live sequence)
        self.model_path = str(self.model_dir)
        self.model_id = Path(self.model_dir).name if config.target else "flashtree-tiny"

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        return cls(config)

    @classmethod
    def from_pretrained(cls, target: Optional[str] = None, draft: Optional[str] = None, *,
                        device: Optional[str] = None, dtype: Optional[str] = None,
                        max_ctx: int = 4096, mode: str = "ddtree", budget: int = 22,
                        block_size: Optional[int] = None, chain_seed: bool = True,
                        prefill_ubatch: int = 512) -> "Engine":
        return cls(EngineConfig(target=target, draft=draft, device=device, dtype=dtype,
                                max_ctx=max_ctx, mode=mode, budget=budget, block_size=block_size,
                                chain_seed=chain_seed, prefill_ubatch=prefill_ubatch))

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ConfigError("prompt must contain at least one token")
        if len(prompt_ids) >= self.max_ctx:
            raise ContextLengthError(len(prompt_ids), self.max_ctx)
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def generate(self, prompt_ids: list[int], sampling: Optional[SamplingParams] = None,
                 max_tokens: int = 256, stop_token_ids: Optional[list[int]] = None,
                 trace: bool = False) -> GenerationResult:
        stream = self.stream(prompt_ids, sampling, max_tokens, stop_token_ids, trace)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt_ids: list[int], sampling: Optional[SamplingParams] = None,
               max_tokens: int = 256, stop_token_ids: Optional[list[int]] = None,
               trace: bool = False) -> GenerationStream:
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_prompt(prompt_ids)
        sampling = (sampling or SamplingParams()).validate()
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        stops = set(self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
        return GenerationStream(lambda s: self._run(s, prompt_ids, sampling, max_tokens, stops, trace))

    def _reuse_prefix(self, prompt_ids: list[int]) -> int:
        """Keep the live sequence's longest common prefix (at least one prompt token is re-run:
        its logits give the first completion token)."""
        n = 0
        limit = min(len(self.seq_tokens), len(prompt_ids) - 1)
        while n < limit and self.seq_tokens[n] == prompt_ids[n]:
            n += 1
        self.decoder.truncate(n)
        del self.seq_tokens[n:]
        return n

    def _resync(self) -> None:
        """After an exception mid-step, make the token list and both caches agree again."""
        n = min(self.tcache.length, self.dcache.length if self.dcache else self.tcache.length,
                len(self.seq_tokens))
        self.decoder.truncate(n)
        del self.seq_tokens[n:]

    def _run(self, stream: GenerationStream, prompt_ids: list[int], sampling: SamplingParams,
             max_tokens: int, stops: set[int], want_trace: bool) -> Iterator[list[int]]:
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        out: list[int] = []
        traces: list[dict] = [] if want_trace else None  # type: ignore[assignment]
        finish = "length"
        try:
            t0 = time.perf_counter()
            stats.cached_tokens = self._reuse_prefix(prompt_ids)
            sampler = Sampler(sampling, self.target.config.vocab_size, self.device, prompt_ids)
            rest = prompt_ids[stats.cached_tokens:]
            ubatch = self.config.prefill_ubatch
            for i in range(0, len(rest), ubatch):
                chunk = rest[i:i + ubatch]
                logits = self.decoder.prefill_chunk(chunk)
                self.seq_tokens.extend(chunk)
            bonus = int(sampler.draw(logits)[0])
            stats.prefill_s = time.perf_counter() - t0
            emitted = [bonus]
            t1 = time.perf_counter()
            while True:
                cut, finish = self._cut(emitted, stops, max_tokens - len(out), len(prompt_ids) + len(out))
                out.extend(cut)
                sampler.observe(cut)
                if cut:
                    yield cut
                if finish:
                    break
                if stream.cancelled:
                    finish = "cancelled"
                    break
                room = min(max_tokens - len(out), self.max_ctx - len(prompt_ids) - len(out))
                res = self.decoder.step(out[-1], sampler, room, want_trace)
                self.seq_tokens.extend(res.committed)
                stats.steps += 1
                stats.accept_lengths.append(len(res.tokens))
                if traces is not None and res.trace is not None:
                    traces.append(res.trace)
                emitted = res.tokens
            stats.decode_s = time.perf_counter() - t1
        except BaseException:
            self._resync()
            raise
        stats.completion_tokens = len(out)
        stream.result = GenerationResult(out, finish, stats, traces)

    def _cut(self, emitted: list[int], stops: set[int], allowed: int, total: int) -> tuple[list[int], str]:
        """Apply stop tokens, max_tokens and the context limit to a step's tokens."""
        for i, tok in enumerate(emitted[:allowed]):
            if tok in stops:
                return emitted[:i], "stop"
        cut = emitted[:allowed]
        if len(cut) >= allowed:
            return cut, "length"
        if total + len(cut) >= self.max_ctx:
            return cut, "length"
        return cut, ""
