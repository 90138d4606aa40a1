"""The engine: owns the models, the KV state of the live sequence, and the request loop.

One sequence at a time. The KV of the last request stays ("live sequence"), and a new request
reuses its longest common prefix with it without any copy. Validation happens when a request is
made, before any work, so a caller (the server) can map errors to responses before streaming.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import fields
from typing import Any, Callable, Iterator, Optional

import torch

from ..checkpoint import load_tokenizer, resolve_model, resolve_model_dir
from ..checkpoint.resolve import EMBEDDED as ASSETS, model_refs  # noqa: F401  (ASSETS: benchmarks, tests)
from ..checkpoint.weights import pick_dtype
from ..config import EngineConfig
from ..errors import ConfigError, ContextLengthError, EngineOutOfMemory
from ..models.dflash import DFlashDraft
from ..models.loader import fingerprint, load_draft, load_target, read_configs
from . import faults
from .compute import check_kv_types, pick_device, set_threads
from .decoding import Decoder, Drafted, warm_up_lengths
from .generation import GenerationResult, GenerationStats, GenerationStream
from .grammar import GrammarCompiler, GrammarConstraint, apply_mask
from .graphs import ModelRunner, can_capture
from .layout import Layout
from .memory_plan import (allocator_counts, available_memory, cap_process, cuda_mark, fit_outside_allocator,
                          outside_allocator, plan_memory)
from .prefix_cache import CacheFileError, PrefixCache, pin_in_threads
from .sampling import Sampler, SamplingParams
from .sequence import SequenceState

log = logging.getLogger("flashtree.engine")


def decode_mode(requested: str, draft_ref: Optional[str]) -> str:
    """The one place the decode mode is decided: `ar` loads no draft; a speculative mode
    without a draft falls back to `ar` with a warning."""
    if requested != "ar" and draft_ref is None:
        log.warning("no draft model given: decoding autoregressively (mode ar)")
        return "ar"
    return requested


def snapshot_identity(layout: Any, config: EngineConfig) -> Any:
    """What, besides the checkpoint files, makes a snapshot's rows what they are: the KV layout and
    the weights' quantization (the draft's too: its KV rows are its projections). Not max_ctx:
    rows are rows. A dense pair's identity is its layout alone, as before quantization existed.
    (The KV types are the layout's: SequenceState.layout names every cache's storage kinds.)"""
    if config.quantize is None and config.quantize_draft is None:
        return layout
    if config.quantize_draft is None:
        return layout, config.quantize
    return layout, config.quantize, config.quantize_draft


class Engine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = pick_device(config.device)
        set_threads(config.threads, self.device)
        check_kv_types(self.device, config.kv_type, config.v_type, config.draft_kv_type)
        target_ref, draft_ref = model_refs(config.target, config.draft)
        self.max_ctx = config.max_ctx
        target_dir = resolve_model(target_ref, config.offline)  # a directory or a .gguf file
        self.mode = decode_mode(config.mode, draft_ref)
        draft_dir = resolve_model_dir(draft_ref, config.offline) if self.mode != "ar" else None
        raw_cfg, lm_cfg, draft_cfg = read_configs(target_dir, draft_dir)
        self.dtype = pick_dtype(config.dtype, raw_cfg, self.device)
        self.memory_plan = plan_memory(config, lm_cfg, draft_cfg, self.dtype, self.device,
                                       available_memory(self.device, config.gpu_memory),
                                       target_dir if target_dir.is_file() else None)  # a GGUF file
        log.info("memory plan:\n%s", self.memory_plan.describe())
        self.layout: Layout = self.memory_plan.layout  # what is allocated below is what the plan counted
        max_pos = self.layout.rows
        cap_process(self.device, config.gpu_memory)
        start = cuda_mark(self.device)
        self.tokenizer = load_tokenizer(target_dir, raw_cfg)
        self.target = load_target(target_dir, lm_cfg, self.dtype, self.device, max_pos, config.quantize)
        self.draft: Optional[DFlashDraft] = None
        if draft_dir is not None and draft_cfg is not None:
            self.draft = load_draft(draft_dir, draft_cfg, self.dtype, self.device, max_pos, config.quantize_draft)
            self.draft.check_fits(lm_cfg)
        # the draft's cache takes its own type: a few layers, but at long contexts as large as
        # the target's quantized one (`python benchmarks/quality.py` measures its cost in acceptance)
        draft_kv = self.draft.new_cache(max_pos, self.dtype, self.device, config.draft_kv_type) if self.draft else None
        self.state = SequenceState(self.target.new_cache(max_pos, self.dtype, self.device, self.layout.node_rows,
                                                         config.kv_type, config.v_type),
                                   draft_kv,
                                   self.device, config.state_checkpoints)
        feature_layers = tuple(self.draft.config.target_layer_ids) if self.draft is not None else ()
        self.runner = ModelRunner(self.target, self.draft, self.state, feature_layers,
                                  self.layout.verify_sizes, self.block_size,
                                  capture=can_capture(self.device, self.dtype,
                                                      config.cuda_graphs and self.target.capturable))
        self.decoder = Decoder(self.target, self.draft, self.state, self.runner, self.mode,
                               config.budget, self.block_size, config.chain_seed)
        if self.device.type == "cuda":
            pin_in_threads()
            self.decoder.warm_up_prefill(warm_up_lengths(min(config.prefill_ubatch, self.max_ctx // 2)))
            self.decoder.warm_up_decode()
        device_tier = fit_outside_allocator(self.device, config.gpu_memory, outside_allocator(self.device, start),
                                            self.memory_plan.prefix_cache_bytes)
        self.cache = PrefixCache(
            self.device, config.prefix_cache_slots, device_tier, config.host_cache_bytes,
            config.cache_dir, config.disk_cache_bytes,
            fingerprint([target_dir, draft_dir], snapshot_identity(self.state.layout(), config)))
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.on_progress: Callable[[], None] = lambda: None  # after each prefill chunk (the worker's heartbeat)
        self._grammars: Optional[GrammarCompiler] = None  # built at the first structured request
        self.model_dir = target_dir
        self.model_path = str(target_dir)
        self.model_id = target_dir.name if config.target else "flashtree-tiny"

    @property
    def block_size(self) -> int:
        """The draft's block, as the layout sizes it."""
        return self.layout.block_size

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        return cls(config)

    @classmethod
    def from_pretrained(cls, target: Optional[str] = None, draft: Optional[str] = None, *,
                        device: Optional[str] = None, dtype: Optional[str] = None,
                        max_ctx: int = 4096, mode: str = "ddtree", budget: int = 22,
                        block_size: Optional[int] = None, chain_seed: bool = True,
                        prefill_ubatch: int = 512, **options: Any) -> "Engine":
        """`options`: any other EngineConfig field (prefix_cache_slots, cache_dir, ...)."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(EngineConfig(target=target, draft=draft, device=device, dtype=dtype,
                                max_ctx=max_ctx, mode=mode, budget=budget, block_size=block_size,
                                chain_seed=chain_seed, prefill_ubatch=prefill_ubatch, **options))

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
                 trace: bool = False, grammar: Optional[str] = None) -> GenerationResult:
        stream = self.stream(prompt_ids, sampling, max_tokens, stop_token_ids, trace, grammar)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt_ids: list[int], sampling: Optional[SamplingParams] = None,
               max_tokens: int = 256, stop_token_ids: Optional[list[int]] = None,
               trace: bool = False, grammar: Optional[str] = None) -> GenerationStream:
        """`grammar`: an llguidance grammar (JSON text) the output must follow; once complete it
        ends at one of the stop tokens or the model's EOS tokens (which end it even when
        `stop_token_ids` leaves them out)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_prompt(prompt_ids)
        sampling = (sampling or SamplingParams()).validate(self.target.config.vocab_size)
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        stops = set(self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
        constraint = None
        if grammar is not None:
            stops = stops | set(self.tokenizer.eos_token_ids)  # a complete output must end
            constraint = self._grammar_compiler().constraint(grammar, stops, self.device)
        return GenerationStream(lambda s: self._run(s, prompt_ids, sampling, max_tokens, stops, trace,
                                                    constraint))

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size)
        return self._grammars

    # ---- events --------------------------------------------------------------------------
    def _emit(self, kind: str, **data: Any) -> None:
        for listener in self.listeners:
            listener(kind, data)

    def cache_stats(self) -> dict[str, Any]:
        return {"live_tokens": self.state.length, "tiers": self.cache.stats()}

    def clear_caches(self, reason: str = "request") -> int:
        """Drop every snapshot of every tier (and the live sequence's reuse)."""
        dropped = self.cache.clear_all()
        self.state.truncate(0)
        self._emit("cache_cleared", reason=reason, dropped=dropped)
        return dropped

    def close(self) -> None:
        """Release the CUDA graphs now (an engine about to be replaced in the same process)."""
        self.runner.close()

    def _recover_from_oom(self, site: str) -> None:
        """No snapshot stays in device memory (those the host budget takes move there), the
        allocator's cache is returned, and listeners hear of it. The live KV is preallocated
        and stays valid: it is not part of what an OOM can free."""
        dropped = self.cache.drop_device_tier(spill=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("out of memory during %s: %d device snapshots dropped", site, dropped)
        self._emit("cache_cleared", reason="oom", site=site, dropped=dropped)

    # ---- prefix reuse and prefill ----------------------------------------------------------
    def _prepare_prefix(self, prompt_ids: list[int], stats: GenerationStats) -> int:
        """Make the caches hold the longest reusable prefix of the prompt; return its length.

        The live sequence is kept if it serves best (no copy). If the prompt diverges from it,
        the live state is snapshotted first when `worth_snapshot`, and a snapshot sharing a longer
        prefix is restored (their seconds: stats.snapshot_s). At least one prompt token is always
        left to prefill: its logits give the first completion token."""
        limit = len(prompt_ids) - 1
        state = self.state
        live = state.reusable(prompt_ids, limit)
        t0 = time.perf_counter()
        try:
            if self.worth_snapshot(state.length - live):
                try:
                    self.cache.save(state)
                except Exception as e:  # a snapshot is an optimisation: lose it, not the request
                    if not faults.is_oom(e):
                        raise
                    self._recover_from_oom("snapshot_save")
            entry, usable = self.cache.best(prompt_ids)
            usable = min(usable, limit)
            if entry is not None and usable > live:
                try:
                    return self.cache.restore(entry, usable, state)
                except CacheFileError as e:
                    log.warning("%s", e)
                except Exception as e:
                    if not faults.is_oom(e):
                        raise
                    self._recover_from_oom("snapshot_restore")
        finally:
            stats.snapshot_s = time.perf_counter() - t0
        return state.keep_prefix_of(prompt_ids, limit)

    def worth_snapshot(self, lost: int) -> bool:
        """Snapshot the live state before a request drops its last `lost` tokens only if they are
        at least cache_min_tokens and cache_min_fraction of it: the copy is of every row, for those
        tokens alone (an agent's next turn drops the last answer: 3.8 GB at 62K on a 27B hybrid,
        seconds a turn, for 65 tokens; docs/CACHE.md)."""
        floor = max(self.config.cache_min_tokens, self.config.cache_min_fraction * self.state.length)
        return lost >= floor

    def _prefill(self, prompt_ids: list[int], stats: GenerationStats) -> torch.Tensor:
        """Prefill the rest of the prompt in ubatch chunks; on OOM clear the device tier and retry
        once with half the ubatch (not below the floor). Returns the last position's logits."""
        ubatch, retried = self.config.prefill_ubatch, False
        interval = self.config.state_checkpoint_interval
        logits = None
        while self.state.length < len(prompt_ids):
            start = self.state.length
            end = start + ubatch
            if self.state.recurrent:  # hybrids: chunks end where recurrent states are kept
                end = min(end, (start // interval + 1) * interval)
                if start < len(prompt_ids) - 1:
                    end = min(end, len(prompt_ids) - 1)
            chunk = prompt_ids[start:end]
            try:
                c0 = time.perf_counter()
                logits = self.decoder.prefill_chunk(chunk)
                stats.prefill_chunks += 1
                stats.slowest_chunk_s = max(stats.slowest_chunk_s, time.perf_counter() - c0)
                self.on_progress()
            except EngineOutOfMemory:
                self._recover_from_oom("prefill")
                if retried or ubatch <= self.config.prefill_ubatch_floor:
                    raise EngineOutOfMemory("prefill", f"a {len(chunk)}-token chunk did not fit "
                                            "even after the caches were cleared") from None
                retried, ubatch = True, max(self.config.prefill_ubatch_floor, ubatch // 2)
                log.warning("retrying prefill with ubatch %d", ubatch)
                continue
            if self.state.recurrent and (self.state.length % interval == 0
                                         or self.state.length == len(prompt_ids) - 1):
                # where a later request can resume: the prompt but its last token (the most an
                # identical prompt may reuse), and every interval
                self.state.checkpoint()
        assert logits is not None
        return logits

    def _run(self, stream: GenerationStream, prompt_ids: list[int], sampling: SamplingParams,
             max_tokens: int, stops: set[int], want_trace: bool,
             grammar: Optional[GrammarConstraint]) -> Iterator[list[int]]:
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        out: list[int] = []
        traces: Optional[list[dict]] = [] if want_trace else None
        stream.traces = traces
        finish = "length"
        counts = allocator_counts(self.device)
        try:
            t0 = time.perf_counter()
            stats.cached_tokens = self._prepare_prefix(prompt_ids, stats)
            sampler = Sampler(sampling, self.target.config.vocab_size, self.device, prompt_ids)
            logits = self._prefill(prompt_ids, stats)
            with faults.site("sample"):
                allowed = grammar.root_mask() if grammar is not None else None
                adjusted = sampler.adjust(apply_mask(logits, allowed))
                emitted = [int(sampler.pick(adjusted)[0])]
                logprobs = sampler.token_logprobs(adjusted, emitted) if sampling.logprobs is not None else None
            stream.logprobs = [] if logprobs is not None else None
            stats.prefill_s = time.perf_counter() - t0
            log.info("prompt %d tokens (%d cached): prefill %.3f s in %d forwards (slowest %.3f s), snapshots "
                     "%.3f s", len(prompt_ids), stats.cached_tokens, stats.prefill_s, stats.prefill_chunks,
                     stats.slowest_chunk_s, stats.snapshot_s)
            t1 = time.perf_counter()
            ahead: Optional[Drafted] = None  # the next step's draft, queued before this step's read
            while True:
                cut, finish = self._cut(emitted, stops, max_tokens - len(out), len(prompt_ids) + len(out))
                out.extend(cut)
                if stream.logprobs is not None:
                    stream.logprobs.extend((logprobs or [])[:len(cut)])
                with faults.site("sample", inject=False):
                    sampler.observe(cut)
                if grammar is not None and not finish:
                    grammar.advance(cut)
                if cut:
                    yield cut
                if finish:  # a draft queued ahead only wrote scratch rows: it is dropped
                    break
                if stream.cancelled:
                    finish = "cancelled"
                    break
                room = min(max_tokens - len(out), self.max_ctx - len(prompt_ids) - len(out))
                t_step = time.perf_counter()
                stats.drafted_ahead += ahead is not None and ahead.error is None
                launched = self.decoder.launch(out[-1], sampler, room, want_trace, grammar, ahead)
                try:  # the GPU drafts the next step while the host reads this one and streams it
                    ahead = self.decoder.draft_ahead(launched, room, grammar)
                finally:  # a launched step is always read: its commit is already queued
                    res = self.decoder.read(launched)
                stats.step_s += time.perf_counter() - t_step
                stats.steps += 1
                stats.accept_lengths.append(len(res.tokens))
                if traces is not None and res.trace is not None:
                    traces.append(res.trace)
                emitted, logprobs = res.tokens, res.logprobs
            stats.decode_s = time.perf_counter() - t1
        except EngineOutOfMemory as e:
            if e.site != "prefill":  # a failed prefill has recovered already
                self._recover_from_oom(e.site)
            raise
        stats.completion_tokens = len(out)
        after = allocator_counts(self.device)
        for name, before in counts.items():
            setattr(stats, name, after[name] - before)
        stream.result = GenerationResult(out, finish, stats, traces, stream.logprobs)

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
