"""The start-up memory plan: every large buffer's bytes, computed from the configs before anything
is allocated, against the memory the device has (or --gpu-memory says it has). A configuration
that cannot fit is refused in one line with the knobs that would make it fit, instead of failing
later mid-request; `flashtree plan` prints the same plan without loading any weight.

The sizes it counts (cache rows, KV, recurrent-state, checkpoint and RoPE bytes, tree and block
rows) are the configuration's Layout (runtime/layout.py), which the engine then allocates.

The KV cache, the RoPE tables and (on the CPU) the attention scores grow with the context, the
rest does not, so the largest --max-ctx that fits is found by bisection on the plan itself. The
prefix cache's device tier is the one item that adapts: it gets what the rest leaves, at most
its --prefix-cache-bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import AUTO_SEQUENCES, EngineConfig
from ..errors import ConfigError
from ..models.dflash import DraftConfig
from ..models.dflash2 import new_draft
from ..models.mtp import MTPConfig
from ..models.registry import TargetConfig, architecture_of
from ..kernels import deterministic_scratch_bytes
from ..kernels.reference import dequant_scratch_bytes
from ..models.quant import QUANT_BITS
from .byte_counts import DTYPE_BYTES, dtype_name, gguf_weight_bytes, planned_weight_bytes
from .layout import Layout

log = logging.getLogger("flashtree.memory")
GiB = 1024 ** 3
MiB = 1024 ** 2
# cuBLAS/Triton workspaces and allocator slack on CUDA, besides the graphs' own pool
WORKSPACE_MARGIN = 256 * MiB
# what the CUDA context takes on a card before the allocator gets anything (`flashtree plan`
# estimates it; the engine measures it)
CUDA_CONTEXT_ESTIMATE = 512 * MiB


def _on_meta(build: Any) -> Any:
    with torch.device("meta"):
        return build()


def target_weights(lm: TargetConfig, dtype: torch.dtype, quantize: Optional[str],
                   gguf: Optional[Path] = None) -> dict[str, int]:
    """The target's weight bytes per storage type: from the GGUF header, or counted on a meta
    instance (with --quantize's linears, embedding and lm_head at their quantized size)."""
    if gguf is not None:
        return gguf_weight_bytes(gguf, dtype, lm.num_layers, QUANT_BITS[quantize] if quantize else None)
    model = _on_meta(lambda: architecture_of(lm).model(lm, 1))
    return planned_weight_bytes(model, quantize, dtype)


def weight_items(lm: TargetConfig, draft: Optional[DraftConfig], dtype: torch.dtype, quantize: Optional[str],
                 gguf: Optional[Path] = None, quantize_draft: Optional[str] = None,
                 draft_gguf: Optional[Path] = None) -> list[tuple[str, int]]:
    """The plan's weight rows, target then draft (its linears quantized by --quantize-draft; a
    GGUF draft's counted from its header, as the loader keeps them, like a GGUF target's)."""
    items = [(f"target weights, {kind}", b) for kind, b in target_weights(lm, dtype, quantize, gguf).items()]
    if draft is not None:
        if draft_gguf is not None:  # an MTP draft's file is the target's: its block after the target's layers
            mtp = isinstance(draft, MTPConfig)
            held = gguf_weight_bytes(draft_gguf, dtype, lm.num_layers if mtp else draft.num_layers,
                                     QUANT_BITS[quantize_draft] if quantize_draft else None, mtp)
        else:
            held = planned_weight_bytes(_on_meta(lambda: new_draft(draft, 1)), quantize_draft, dtype)
        items += [(f"draft weights, {kind}", b) for kind, b in held.items()]
    return items


@dataclass
class MemoryPlan:
    items: list[tuple[str, int]]   # the prefix cache's device tier last
    available: Optional[int]       # None: unknown, nothing is checked
    layout: Layout                 # the sizes counted, which the engine then allocates
    prefix_cache_wanted: int = 0   # --prefix-cache-bytes, before any shrinking

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)

    @property
    def required(self) -> int:
        """Everything but the prefix cache's device tier, which takes what is left."""
        return self.total - self.prefix_cache_bytes

    @property
    def prefix_cache_bytes(self) -> int:
        return self.items[-1][1]

    @property
    def fits(self) -> bool:
        return self.available is None or self.required <= self.available

    def describe(self) -> str:
        rows = [*self.items, ("total", self.total)]
        if self.available is not None:
            rows += [("available", self.available), ("free after the plan", self.available - self.total)]
        return "\n".join(table_row(name, b) for name, b in rows)

    def to_json(self) -> dict[str, Any]:
        return {"items": [{"name": n, "bytes": b} for n, b in self.items], "total": self.total,
                "available": self.available,
                "free": None if self.available is None else self.available - self.total,
                "fits": self.fits}


def table_row(name: str, nbytes: int) -> str:
    return f"  {name:<46} {nbytes:>16,} B {nbytes / GiB:9.3f} GiB"


def make_plan(cfg: EngineConfig, layout: Layout, lm: TargetConfig, dtype: torch.dtype, device_type: str,
              weights: list[tuple[str, int]], available: Optional[int]) -> MemoryPlan:
    """The plan for `cfg`'s context, budget, ubatch and KV types, whose sizes are `layout`'s.
    `weights`: weight_items()."""
    rows, n = layout.rows, layout.sequences
    each = f"{n} x " if n > 1 else ""  # per-sequence items, once per live sequence
    kv_label = f"K {cfg.kv_type}, V {cfg.v_type or cfg.kv_type}"
    items = list(weights)
    pool = f"{layout.pool_rows} rows" + (f", {n} sequences of {rows}" if n > 1 else "")
    items.append((f"target KV pool, {kv_label} ({pool})", layout.target_kv_bytes))
    if layout.recurrent:  # float32 recurrent state + conv window per DeltaNet layer, per copy of them
        items += [(f"{each}recurrent states (live + pending)", n * 2 * layout.state_bytes),
                  (f"{each}tree nodes' delta-rule inputs ({layout.node_rows})", n * layout.node_rows * layout.node_bytes),
                  (f"{each}recurrent state checkpoints ({cfg.state_checkpoints})", n * layout.checkpoint_bytes)]
    if layout.speculative:
        label = dtype_name(dtype) if cfg.draft_kv_type == "auto" else cfg.draft_kv_type
        items.append((f"draft KV pool, {label} ({layout.pool_rows} rows)", layout.draft_kv_bytes))
    items.append((f"RoPE tables ({rows} rows, float32)", layout.rope_bytes))
    quantized = any(name.startswith(("target weights, int", "draft weights, int")) for name, _ in weights)
    items += activations(cfg, layout, lm, DTYPE_BYTES[dtype], device_type, quantized)
    wanted = min(cfg.prefix_cache_bytes, device_tier_bytes(cfg, layout, lm, DTYPE_BYTES[dtype]))
    plan = MemoryPlan(items + [("prefix cache, device tier", wanted)], available, layout, wanted)
    if available is not None and plan.total > available:  # the cache's device tier takes what is left
        plan.items[-1] = ("prefix cache, device tier (shrunk to fit)", max(0, min(wanted, available - plan.required)))
    return plan


def device_tier_bytes(cfg: EngineConfig, layout: Layout, lm: TargetConfig, size: int) -> int:
    """What the prefix cache's device tier can use: its snapshots hold their KV rows in the
    pool's pages and copy only the recurrent states, each checkpoint's too, and an MTP draft's
    carried hidden state (counted for every hybrid: a hidden vector a copy). Nothing for a
    target without recurrent states."""
    if not layout.recurrent:
        return 0
    return cfg.prefix_cache_slots * (1 + cfg.state_checkpoints) * (layout.state_bytes + lm.hidden_size * size)


def activations(cfg: EngineConfig, layout: Layout, lm: TargetConfig, size: int, device_type: str,
                quantized: bool) -> list[tuple[str, int]]:
    """Scratch of the largest forwards: the verify tree and a prefill ubatch, the logits of both,
    with quantized weights the chunk of a weight a prefill dequantizes, and on CUDA the graphs'
    pool (its own copy of the decode forwards' activations). An architecture's own activations
    per token (a hybrid's DeltaNet projections and delta-rule inputs, routed experts) are its
    StateShape's scratch."""
    per_token = lm.hidden_size * 6 + lm.intermediate_size * 3 + lm.num_heads * lm.head_dim * 3
    per_token += layout.state.scratch_values + layout.state.scratch_floats * 4 // size
    tree = layout.tree_rows
    verify = tree * (per_token * size + lm.vocab_size * 8) + (layout.block_size * lm.vocab_size * 8
                                                              if layout.speculative else 0)
    ubatch = layout.prefill_ubatch
    scratch = ubatch * per_token * size + lm.vocab_size * 4
    if quantized:
        scratch += dequant_scratch_bytes()
    if device_type == "cpu":  # the math attention path materialises scores for a chunk
        scratch += lm.num_heads * ubatch * layout.rows * 4
    items = [(f"verify buffers ({tree} nodes)", verify), (f"prefill scratch (ubatch {ubatch})", scratch)]
    if cfg.deterministic:  # the fixed launches' split-K partials (kernels.deterministic_splits)
        h, inter, q_out = lm.hidden_size, lm.intermediate_size, lm.num_heads * lm.head_dim
        items.append(("deterministic kernels' partials", deterministic_scratch_bytes(
            [(h, q_out + 2 * lm.num_kv_heads * lm.head_dim), (q_out, h), (h, 2 * inter), (inter, h)])))
    if device_type == "cuda":
        capturable = cfg.cuda_graphs and size == 2 and not getattr(lm, "num_experts", 0)  # graphs.py, moe.py
        # each sequence's graphs have their own pool; several sequences' shared steps (batch_step.py)
        # another, holding up to every sequence's tree at once
        n = layout.sequences
        graphs = verify * (2 * n if n > 1 else 1) if capturable else 0
        items.append(("CUDA graph pool + workspaces (margin)", graphs + WORKSPACE_MARGIN))
    return items


def largest_max_ctx(cfg: EngineConfig, plan_for: Callable[[EngineConfig], MemoryPlan], ceiling: int) -> Optional[int]:
    """The largest --max-ctx (<= ceiling) whose plan fits, by bisection; None if not even 16."""
    def fits(n: int) -> bool:
        return plan_for(replace(cfg, max_ctx=n)).fits

    if not fits(16):
        return None
    lo, hi = 16, ceiling
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def available_memory(device: torch.device, gpu_memory: Optional[int]) -> Optional[int]:
    """What the plan may use: the device's free memory, or with --gpu-memory what a card of that
    size would leave this process after its CUDA context (CUDA_CONTEXT_ESTIMATE) and what its
    allocator already holds; on the CPU the host's available memory, or --gpu-memory if smaller.
    Other processes on the device are not counted against --gpu-memory (they would not be on
    the card it stands for), only against the device's free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if gpu_memory is None:
            return free
        mine = CUDA_CONTEXT_ESTIMATE + torch.cuda.memory_reserved(device)
        return max(0, min(free, gpu_memory - mine))
    host = host_available()
    if gpu_memory is None:
        return host
    return gpu_memory if host is None else min(host, gpu_memory)


def host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cap_process(device: torch.device, gpu_memory: Optional[int], outside: int = 0) -> None:
    """Cap the CUDA caching allocator so the process (its context estimated, and `outside`
    bytes it took besides: outside_allocator) stays within --gpu-memory, as on a card of that
    size. Nothing to cap on the CPU."""
    if gpu_memory is None or device.type != "cuda":
        return
    _, total = torch.cuda.mem_get_info(device)
    allowed = gpu_memory - CUDA_CONTEXT_ESTIMATE - outside
    if allowed >= total:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has none
    torch.cuda.set_per_process_memory_fraction(max(allowed, 0) / total, index)
    log.info("--gpu-memory: the allocator may hold %.3f GiB of the device's %.3f GiB", allowed / GiB, total / GiB)


def cuda_mark(device: torch.device) -> tuple[int, int]:
    """The device's free bytes and what this process's allocator holds, now (outside_allocator's
    starting point; (0, 0) off CUDA)."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


def outside_allocator(device: torch.device, since: tuple[int, int]) -> int:
    """Device bytes taken since `since` (cuda_mark) that the caching allocator does not hold: the
    CUDA graphs' executable images, loaded kernel modules, library handles. The plan cannot
    count them (they depend on the driver and on how many kernels the warm-ups load), so the
    engine measures them once its graphs are captured. Another process allocating meanwhile
    would be counted too, which errs on the safe side."""
    if device.type != "cuda":
        return 0
    free, reserved = cuda_mark(device)
    return max(0, (since[0] - free) - (reserved - since[1]))


def fit_outside_allocator(device: torch.device, gpu_memory: Optional[int], outside: int, tier: int) -> int:
    """Under --gpu-memory, make room for `outside` bytes (outside_allocator): the allocator's cap
    comes down by them, and so does the prefix cache's device tier `tier`, the plan's one elastic
    item. Returns the tier's new size. (Without it a card filled to its --gpu-memory goes past
    it by what lies outside the allocator: `python benchmarks/card_24g.py --max-ctx 131072`
    samples the process's memory.)"""
    if gpu_memory is None or device.type != "cuda" or not outside:
        return tier
    cap_process(device, gpu_memory, outside)
    log.info("CUDA memory outside the allocator since start-up: %.3f GiB (graphs, kernel modules); the "
             "allocator's cap and the prefix cache's device tier come down by it", outside / GiB)
    if outside > tier:
        log.warning("--gpu-memory: the process needs %.3f GiB more than the plan has left; requests may "
                    "run out of memory (try a smaller --max-ctx)", (outside - tier) / GiB)
    return max(0, tier - outside)


# GenerationStats field -> torch's allocator counter (torch.cuda.memory_stats)
ALLOCATOR_COUNTERS = {"alloc_retries": "num_alloc_retries", "device_mallocs": "num_device_alloc",
                      "device_frees": "num_device_free"}


def allocator_counts(device: torch.device) -> dict[str, int]:
    """torch's CUDA allocator counters (all 0 on the CPU), by GenerationStats field:
    - alloc_retries: how often it found no free block, returned its whole cache to the driver
      and tried again; each time costs a device synchronization and every block after it a
      fresh cudaMalloc, the sign of a process at its memory cap;
    - device_mallocs, device_frees: its cudaMalloc and cudaFree calls. Steady decoding reuses
      cached blocks and makes none; a process near its cap may free and allocate every step
      (a cudaFree synchronizes the device)."""
    if device.type != "cuda":
        return dict.fromkeys(ALLOCATOR_COUNTERS, 0)
    stats = torch.cuda.memory_stats(device)
    return {field: int(stats.get(key, 0)) for field, key in ALLOCATOR_COUNTERS.items()}


def check_plan(plan: MemoryPlan, cfg: EngineConfig, max_ctx_fit: Optional[int]) -> None:
    """Refuse a plan that does not fit, in one line: the need, the biggest items, what to change."""
    assert plan.available is not None and not plan.fits
    big = sorted(plan.items[:-1], key=lambda item: -item[1])[:3]
    where = f" (--gpu-memory {cfg.gpu_memory / GiB:.3g}G)" if cfg.gpu_memory else ""
    fixes = [f"--max-ctx {max_ctx_fit} (the largest that fits; now {cfg.max_ctx})" if max_ctx_fit
             else f"a smaller --max-ctx (now {cfg.max_ctx}; even 16 does not fit)"] + smaller_settings(plan, cfg)
    raise ConfigError(
        f"this configuration does not fit in memory: it needs {plan.required / GiB:.3f} GiB, "
        f"{plan.available / GiB:.3f} GiB is available{where} (largest: "
        + ", ".join(f"{n} {b / GiB:.3f} GiB" for n, b in big) + "); try " + ", ".join(fixes))


def smaller_settings(plan: MemoryPlan, cfg: EngineConfig) -> list[str]:
    """The flags, other than --max-ctx, that would make `plan` smaller, as advice."""
    fixes = []
    if (cfg.max_sequences or 1) > 1:
        fixes.append(f"fewer --max-sequences (now {cfg.max_sequences}: each has its own recurrent states, "
                     "checkpoints and graphs)" if plan.layout.recurrent else
                     f"fewer --max-sequences (now {cfg.max_sequences})")
    if "q4_0" not in (cfg.kv_type, cfg.v_type or cfg.kv_type):
        fixes.append("--kv-type q4_0")
    if cfg.quantize != "int4":
        fixes.append("--quantize int4")
    if any(n.startswith("draft weights") for n, _ in plan.items):
        if cfg.quantize_draft != "int4":
            fixes.append("--quantize-draft int4")
        if cfg.draft_kv_type in ("auto", "bf16"):  # fp8 is already smaller than q8_0
            fixes.append("--draft-kv-type q8_0")
    if plan.layout.recurrent and cfg.state_checkpoints > 1:
        fixes.append(f"fewer --state-checkpoints (now {cfg.state_checkpoints})")
    fixes.append(f"a smaller --prefill-ubatch (now {plan.layout.prefill_ubatch}) or --budget (now {cfg.budget})")
    return fixes


def planner(lm: TargetConfig, draft: Optional[DraftConfig], dtype: torch.dtype, device_type: str,
            quantize: Optional[str], available: Optional[int],
            gguf: Optional[Path] = None, quantize_draft: Optional[str] = None,
            draft_gguf: Optional[Path] = None) -> Callable[[EngineConfig], MemoryPlan]:
    """make_plan for any EngineConfig over fixed models (their weights counted once)."""
    weights = weight_items(lm, draft, dtype, quantize, gguf, quantize_draft, draft_gguf)
    return lambda cfg: make_plan(cfg, Layout.of(cfg, lm, draft, dtype), lm, dtype, device_type, weights, available)


def plan_memory(cfg: EngineConfig, lm: TargetConfig, draft: Optional[DraftConfig], dtype: torch.dtype,
                device: torch.device, available: Optional[int], gguf: Optional[Path] = None,
                draft_gguf: Optional[Path] = None) -> MemoryPlan:
    """The engine's plan for `cfg`, refused (check_plan) when it does not fit `available`, with
    what auto_settings chooses where --max-sequences or --prefill-ubatch is not given."""
    plan_for = planner(lm, draft, dtype, device.type, cfg.quantize, available, gguf, cfg.quantize_draft, draft_gguf)
    cfg = auto_settings(cfg, plan_for, device.type)
    plan = plan_for(cfg)
    if not plan.fits:
        check_plan(plan, cfg, largest_max_ctx(cfg, plan_for, cfg.max_ctx))
    if plan.prefix_cache_bytes < plan.prefix_cache_wanted:
        log.warning("the prefix cache's device tier gets %.3f GiB of the %.3f GiB it wants, "
                    "what the rest of the plan leaves", plan.prefix_cache_bytes / GiB, plan.prefix_cache_wanted / GiB)
    return plan


def auto_sequences(cfg: EngineConfig, plan_for: Callable[[EngineConfig], MemoryPlan]) -> int:
    """The live sequences a plan without --max-sequences keeps: the most, up to AUTO_SEQUENCES,
    whose plan still leaves the prefix cache's device tier all it wants (device_tier_bytes; a
    second sequence is worth less than the snapshots that spare re-prefilling); at least one.
    One where the memory is not known."""
    return max([n for n in range(1, AUTO_SEQUENCES + 1) if unshrunk(plan_for(replace(cfg, max_sequences=n)))],
               default=1)


# the prefill ubatches auto_settings tries on a GPU, largest first; layout.PREFILL_UBATCH otherwise
AUTO_UBATCHES = (2048, 1024)


def auto_settings(cfg: EngineConfig, plan_for: Callable[[EngineConfig], MemoryPlan], device_type: str) -> EngineConfig:
    """`cfg` with what its plan chooses where the flags leave it open: the live sequences
    (auto_sequences), then on a GPU the prefill ubatch, the largest of AUTO_UBATCHES whose plan
    still leaves the prefix cache's device tier all it wants (else layout.PREFILL_UBATCH). A
    long prompt's prefill is bound by reading and dequantizing every weight once a chunk, so
    larger chunks prefill it faster (`flashtree bench --prefill 52224 --prefill-ubatch
    512,2048`), for scratch that grows with them; the sequences come first, since a session
    evicted by another costs a whole prefill."""
    if cfg.max_sequences is None:
        cfg = replace(cfg, max_sequences=auto_sequences(cfg, plan_for))
    if cfg.prefill_ubatch is None and device_type == "cuda":
        fitting = (n for n in AUTO_UBATCHES if unshrunk(plan_for(replace(cfg, prefill_ubatch=n))))
        cfg = replace(cfg, prefill_ubatch=next(fitting, None))
    return cfg


def unshrunk(plan: MemoryPlan) -> bool:
    """Whether `plan` is known to fit with the prefix cache's device tier at all it wants."""
    return plan.available is not None and plan.fits and plan.prefix_cache_bytes == plan.prefix_cache_wanted
