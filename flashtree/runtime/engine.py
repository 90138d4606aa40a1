"""The engine: owns the models, the live sequences' states, the prefix cache and the request loop.

Each of the --max-sequences live sequences (runtime/sequences.py) keeps the KV of its last
request, and a new request takes the idle one that serves it best and reuses its longest common
prefix there without any copy (or copies it from another live sequence, or restores it from a
snapshot). Generations are generators (generation_loop.py) that yield after each prefill chunk
and each decode step, so a caller (the worker) runs several side by side by advancing each in
turn, and the running generations' steps are shared (batch_step.py). Validation happens when a
request is made, before any work, so a caller (the server) can map errors to responses before
streaming.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import fields, replace
from typing import Any, Callable, Iterator, Optional

import torch

from ..checkpoint import load_tokenizer, resolve_model
from ..checkpoint.resolve import EMBEDDED as ASSETS, model_refs  # noqa: F401  (ASSETS: benchmarks, tests)
from ..checkpoint.weights import pick_dtype
from ..config import MTP_DRAFT, EngineConfig
from ..errors import ConfigError, ContextLengthError
from ..kernels.attention import deterministic_chunk
from ..models.checks import check_tokenizer, positions_past_training
from ..models.deterministic import make_deterministic
from ..models.dflash import DFlashDraft
from ..models.loader import fingerprint, load_draft, load_target, read_configs
from . import faults
from .compute import check_kv_types, pick_device, set_threads
from ..models.dflash2 import check_dflash2_tree
from .decoding import Decoder, warm_up_lengths
from .generation import GenerationResult, GenerationStats, GenerationStream
from .generation_loop import generate
from .grammar import GrammarCompiler, GrammarConstraint
from .graphs import ModelRunner, can_capture
from .layout import Layout
from .memory_plan import (available_memory, cap_process, cuda_mark, fit_outside_allocator, outside_allocator,
                          plan_memory)
from .prefix_cache import CacheFileError, PrefixCache, Snapshot, pin_in_threads
from .sampling import SamplingParams
from .sequence import SequenceState
from .batch_step import SharedSteps
from .preemption import Preemption
from .sequences import LiveSequence, choose, donor, fits_beside_running

log = logging.getLogger("flashtree.engine")


def decode_mode(requested: str, draft_ref: Optional[str]) -> str:
    """The one place the decode mode is decided: `ar` loads no draft; a speculative mode
    without a draft falls back to `ar` with a warning."""
    if requested != "ar" and draft_ref is None:
        log.warning("no draft model given: decoding autoregressively (mode ar)")
        return "ar"
    return requested


def snapshot_identity(layout: Any, config: EngineConfig, cache_rows: int) -> Any:
    """What, besides the checkpoint files, makes a snapshot's rows what they are: the KV layout and
    the weights' quantization (the draft's too: its KV rows are its projections). Not max_ctx:
    rows are rows. A dense pair's identity is its layout alone, as before quantization existed.
    (The KV types are the layout's: SequenceState.layout names every cache's storage kinds.)
    The deterministic mode's rows are its kernels' (the attention's splits, fixed by the
    `cache_rows` of a sequence's cache, included): a snapshot of the other mode, or of other
    splits, would not give them."""
    if config.quantize is None and config.quantize_draft is None:
        identity = layout
    elif config.quantize_draft is None:
        identity = layout, config.quantize
    else:
        identity = layout, config.quantize, config.quantize_draft
    if config.deterministic:
        return identity, "deterministic", deterministic_chunk(cache_rows)
    return identity


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
        mtp = self.mode != "ar" and draft_ref == MTP_DRAFT  # the draft is the target checkpoint's MTP layer
        draft_dir = (target_dir if mtp else resolve_model(draft_ref, config.offline)) if self.mode != "ar" else None
        raw_cfg, lm_cfg, draft_cfg = read_configs(target_dir, draft_dir, mtp)
        past = positions_past_training(lm_cfg, config.max_ctx)
        if past:
            log.warning("%s", past)
        check_dflash2_tree(config.dflash2_tree, self.mode, draft_cfg)  # before any weight loads
        self.dtype = pick_dtype(config.dtype, raw_cfg, self.device)
        self.memory_plan = plan_memory(config, lm_cfg, draft_cfg, self.dtype, self.device,
                                       available_memory(self.device, config.gpu_memory),
                                       target_dir if target_dir.is_file() else None,  # a GGUF file
                                       draft_dir if draft_dir is not None and draft_dir.is_file() else None)
        log.info("memory plan:\n%s", self.memory_plan.describe())
        self.layout: Layout = self.memory_plan.layout  # what is allocated below is what the plan counted
        self.config = config = replace(config, prefill_ubatch=self.layout.prefill_ubatch)  # the plan's choice
        max_pos = self.layout.rows
        cap_process(self.device, config.gpu_memory)
        start = cuda_mark(self.device)
        self.tokenizer = load_tokenizer(target_dir, raw_cfg)
        check_tokenizer(self.tokenizer, lm_cfg.vocab_size, target_dir)  # before any weight loads
        self.target = load_target(target_dir, lm_cfg, self.dtype, self.device, max_pos, config.quantize)
        changed = make_deterministic(self.target, self.device, self.dtype, config.deterministic)
        if config.deterministic:
            log.info("deterministic: %d dense linears and every kernel of the target in one reduction order", changed)
        self.draft: Optional[DFlashDraft] = None
        if draft_dir is not None and draft_cfg is not None:
            self.draft = load_draft(draft_dir, draft_cfg, self.dtype, self.device, max_pos, config.quantize_draft)
            if mtp:
                log.info("draft: the target's MTP layer, a chain of %d tokens a step%s", self.layout.block_size - 1,
                         "" if self.target.capturable else " (eager: this target's MoE runs without CUDA graphs)")
        self.sequences: list[LiveSequence] = []
        for i in range(self.layout.sequences):
            self.sequences.append(self._new_sequence(i, max_pos))
        if self.device.type == "cuda":
            pin_in_threads()  # kernels compile once; each sequence's decode graphs are its own
            self.decoder.warm_up_prefill(warm_up_lengths(min(config.prefill_ubatch, self.max_ctx // 2)))
            for seq in self.sequences:
                seq.decoder.warm_up_decode()
        device_tier = fit_outside_allocator(self.device, config.gpu_memory, outside_allocator(self.device, start),
                                            self.memory_plan.prefix_cache_bytes)
        self.cache = PrefixCache(
            self.device, config.prefix_cache_slots, device_tier, config.host_cache_bytes,
            config.cache_dir, config.disk_cache_bytes,
            fingerprint([target_dir, draft_dir], snapshot_identity(self.state.layout(), config, max_pos)))
        log.info("%d live sequence(s) of %d tokens each", len(self.sequences), self.max_ctx)
        self.shared_steps = SharedSteps()
        self.preemption = Preemption(self)
        for cache in self.state.kv_caches():  # the pools every sequence's caches share
            cache.pool.reclaim = self.preemption.reclaim
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.on_progress: Callable[[], None] = lambda: None  # after each prefill chunk (the worker's heartbeat)
        self._grammars: Optional[GrammarCompiler] = None  # built at the first structured request
        self.model_dir = target_dir
        self.model_path = str(target_dir)
        self.model_id = target_dir.name if config.target else "flashtree-tiny"

    def _new_sequence(self, index: int, max_pos: int) -> LiveSequence:
        """A live sequence's caches (page tables of the layout's rows over the pools the first
        sequence's caches made, of the layout's pool rows), and the runner and decoder over them."""
        config = self.config
        first = self.sequences[0].state if self.sequences else None
        pools = first.kv_caches() if first is not None else []
        target_pool = pools[0].pool if pools else self.layout.pool_rows
        draft_pool = pools[1].pool if len(pools) > 1 else self.layout.pool_rows
        # the draft's cache takes its own type: a few layers, but at long contexts as large as
        # the target's quantized one (`python benchmarks/quality.py` measures its cost in acceptance)
        draft_kv = (self.draft.new_cache(max_pos, self.dtype, self.device, config.draft_kv_type, pool=draft_pool)
                    if self.draft else None)
        state = SequenceState(self.target.new_cache(max_pos, self.dtype, self.device, self.layout.node_rows,
                                                    config.kv_type, config.v_type, pool=target_pool),
                              draft_kv, self.device, config.state_checkpoints)
        feature_layers = tuple(self.draft.config.target_layer_ids) if self.draft is not None else ()
        runner = ModelRunner(self.target, self.draft, state, feature_layers, self.layout.verify_sizes,
                             self.block_size, capture=can_capture(self.device, self.dtype,
                                                                  config.cuda_graphs and self.target.capturable))
        decoder = Decoder(self.target, self.draft, state, runner, self.mode, config.budget, self.block_size,
                          config.chain_seed, config.dflash2_tree)
        return LiveSequence(index, state, runner, decoder)

    # the first live sequence's parts (the only one under --max-sequences 1): what the benchmarks
    # and the tests that drive one sequence's steps directly use
    @property
    def state(self) -> SequenceState:
        return self.sequences[0].state

    @property
    def runner(self) -> ModelRunner:
        return self.sequences[0].runner

    @property
    def decoder(self) -> Decoder:
        return self.sequences[0].decoder

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
                        prefill_ubatch: Optional[int] = None, **options: Any) -> "Engine":
        """`options`: any other EngineConfig field (prefix_cache_slots, cache_dir, ...)."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(EngineConfig(target=target, draft=draft, device=device, dtype=dtype,
                                max_ctx=max_ctx, mode=mode, budget=budget, block_size=block_size,
                                chain_seed=chain_seed, prefill_ubatch=prefill_ubatch, **options))

    def can_admit(self, running: int, prompt_ids: list[int]) -> bool:
        """Whether a request for `prompt_ids` may start beside `running` generations: a live
        sequence is free for it, no running generation waits, preempted, for its rows, and the
        prompt and its first step fit in the KV pages beside the running sequences' rows, prompts
        and next steps (sequences.fits_beside_running; a prefix it will share with one of them,
        as prepare_prefix chooses, counted once). Admitted with less, its prefix restore and prefill would preempt a
        running sequence (the latest request's rows go first), which would preempt it back at
        its next step, and a preempted one would wait behind every new request."""
        if running >= len(self.sequences) or any(s.paused is not None for s in self.sequences):
            return False
        lender, shared = donor(self.sequences, None, prompt_ids, len(prompt_ids) - 1)
        if lender is None or not lender.busy or shared < self.cache.best(prompt_ids)[1]:
            shared = 0  # it restores a snapshot, or shares an idle sequence's pages: all count
        return fits_beside_running(self.sequences, len(prompt_ids), shared)

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
               trace: bool = False, grammar: Optional[str] = None, request_id: str = "") -> GenerationStream:
        """`grammar`: an llguidance grammar (JSON text) the output must follow; once complete it
        ends at one of the stop tokens or the model's EOS tokens (which end it even when
        `stop_token_ids` leaves them out). The generation takes a live sequence when its
        iteration starts and gives it back when it ends; `request_id` names it there (/sequences).
        Several streams may be iterated in turn, as many at once as there are live sequences."""
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
        return GenerationStream(lambda s: self._run(s, request_id, prompt_ids, sampling, max_tokens, stops,
                                                    trace, constraint))

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size)
        return self._grammars

    # ---- events --------------------------------------------------------------------------
    def emit(self, kind: str, **data: Any) -> None:
        for listener in self.listeners:
            listener(kind, data)

    def cache_stats(self) -> dict[str, Any]:
        pool = self.state.kv_caches()[0].pool  # the target's: the draft's pages follow the same rows
        return {"live_tokens": sum(seq.state.length for seq in self.sequences),
                "sequences": [seq.describe() for seq in self.sequences], "tiers": self.cache.stats(),
                "kv_pages": pool.counts()}

    def clear_caches(self, reason: str = "request") -> int:
        """Drop every snapshot of every tier, and what the idle live sequences hold."""
        dropped = self.cache.clear_all()
        for seq in self.sequences:
            if not seq.busy:
                seq.state.truncate(0)
        self.emit("cache_cleared", reason=reason, dropped=dropped)
        return dropped

    def close(self) -> None:
        """Release the CUDA graphs now (an engine about to be replaced in the same process)."""
        self.shared_steps.close()
        for seq in self.sequences:
            seq.runner.close()

    def recover_from_oom(self, site: str) -> None:
        """No snapshot stays in device memory (those the host budget takes move there), the
        allocator's cache is returned, and listeners hear of it. The live KV is preallocated
        and stays valid: it is not part of what an OOM can free."""
        dropped = self.cache.drop_device_tier(spill=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("out of memory during %s: %d device snapshots dropped", site, dropped)
        self.emit("cache_cleared", reason="oom", site=site, dropped=dropped)

    # ---- prefix reuse -------------------------------------------------------------------
    def prepare_prefix(self, seq: LiveSequence, prompt_ids: list[int], stats: GenerationStats) -> int:
        """Make `seq`'s caches hold the longest reusable prefix of the prompt; return its length.

        Its own rows are kept if they serve best (no copy). If the prompt diverges from them, they
        are snapshotted first when `worth_snapshot`; then another live sequence sharing a longer
        prefix lends its rows (its KV pages, by reference), or a snapshot sharing a longer one is
        restored (their seconds: stats.snapshot_s). At least one prompt token is always left to
        prefill: its logits give the first completion token."""
        limit = len(prompt_ids) - 1
        state = seq.state
        live = state.reusable(prompt_ids, limit)
        t0 = time.perf_counter()
        try:
            if self.worth_snapshot(state, state.length - live):
                try:
                    self.cache.save(state)
                except Exception as e:  # a snapshot is an optimisation: lose it, not the request
                    if not faults.is_oom(e):
                        raise
                    self.recover_from_oom("snapshot_save")
            lender, shared = donor(self.sequences, seq, prompt_ids, limit)
            entry, usable = self.cache.best(prompt_ids)
            usable = min(usable, limit)
            if lender is not None and shared > live and shared >= usable:
                return state.share_prefix(lender.state, shared)
            if entry is not None and usable > live:
                restored = self.restore_snapshot(entry, usable, state)
                if restored is not None:
                    return restored
        finally:
            stats.snapshot_s = time.perf_counter() - t0
        return state.keep_prefix_of(prompt_ids, limit)

    def restore_snapshot(self, entry: Snapshot, n: int, state: SequenceState) -> Optional[int]:
        """Make `state` hold the entry's first n tokens (PrefixCache.restore); the length, or None
        where it failed: the entry was dropped (damaged, logged), or its copy found no memory (the
        device tier is cleared, recover_from_oom). The state then holds a consistent prefix, maybe
        none, and the caller prefills the rest. No KV page free is the caller's to handle."""
        try:
            return self.cache.restore(entry, n, state)
        except CacheFileError as e:
            log.warning("%s", e)
        except Exception as e:
            if not faults.is_oom(e):
                raise
            self.recover_from_oom("snapshot_restore")
        return None

    def worth_snapshot(self, state: SequenceState, lost: int) -> bool:
        """Snapshot a live state before a request drops its last `lost` tokens only if they are
        at least cache_min_tokens and cache_min_fraction of it: the copy is of every row, for those
        tokens alone (an agent's next turn drops the last answer: 3.8 GB at 62K on a 27B hybrid,
        seconds a turn, for 65 tokens; docs/CACHE.md)."""
        floor = max(self.config.cache_min_tokens, self.config.cache_min_fraction * state.length)
        return lost >= floor

    def _run(self, stream: GenerationStream, request: str, prompt_ids: list[int], sampling: SamplingParams,
             max_tokens: int, stops: set[int], want_trace: bool,
             grammar: Optional[GrammarConstraint]) -> Iterator[list[int]]:
        """The generation's body: take the idle live sequence that serves the prompt best
        (sequences.choose), generate in it, give it back however the generation ends."""
        seq = choose(self.sequences, prompt_ids, len(prompt_ids) - 1)
        if seq is None:
            raise RuntimeError(f"all {len(self.sequences)} live sequences are busy")
        seq.acquire(request or f"generation-{id(stream):x}")
        seq.prompt_rows = len(prompt_ids)
        try:
            yield from generate(self, seq, stream, prompt_ids, sampling, max_tokens, stops, want_trace, grammar)
        finally:
            seq.release()
