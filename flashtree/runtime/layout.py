"""The sizes of one engine configuration, derived once from the configs: what the engine allocates
and builds (cache rows, the draft block, the tree's per-node scratch, the verify sizes it
captures) and the bytes the memory plan counts for them (KV, recurrent states, their checkpoints,
RoPE tables). The memory plan computes it (memory_plan.make_plan) and the engine builds from the
plan's own, so what is allocated is what was counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import ceil
from typing import Optional

import torch

from ..config import EngineConfig
from ..models.dflash import DraftConfig
from ..kernels.kv_storage import PAGE_ROWS
from ..models.kv_cache import pages_for
from ..models.registry import StateShape, TargetConfig, architecture_of
from .byte_counts import DTYPE_BYTES, kv_value_bytes

# the fewest scratch rows past the context: a step's tree, draft block or warm-up writes there
MIN_SCRATCH_ROWS = 64
# prompt tokens a prefill forward takes where --prefill-ubatch is not given and the memory plan
# chooses none (the CPU; memory_plan.auto_settings chooses on a GPU)
PREFILL_UBATCH = 512


def kv_bytes(layers: int, rows: int, heads: int, head_dim: int, per_value: tuple[Fraction, Fraction]) -> int:
    """Bytes of a KV cache: K and V of `rows` rows in every layer, at their bytes per value."""
    values = layers * rows * heads * head_dim
    return sum(ceil(values * b) for b in per_value)


@dataclass(frozen=True)
class Layout:
    """The sizes of one configuration, each derived here alone: a new buffer that both the
    engine and the plan size gets a field here, not a second formula. The KV byte counts are the
    pools' (models/kv_cache.py: pool_rows and the sink page), the other byte counts one
    sequence's: each of the `sequences` live sequences has its own."""

    rows: int                       # rows a sequence's caches map and of the RoPE tables: the context plus one
                                    # step's scratch, whole KV pages
    sequences: int                  # live sequences, each with its own page tables and states (--max-sequences)
    pool_rows: int                  # rows of the KV page pools the sequences share (the sink page not counted)
    speculative: bool               # a draft proposes (its cache, block and verify trees exist)
    block_size: int                 # the draft's block (--block-size, else the draft's; 1 without one)
    tree_rows: int                  # rows of the largest verify tree (budget + 1; 1 without a draft)
    node_rows: int                  # tree nodes a recurrent state keeps inputs for: a tree or a block
    verify_sizes: tuple[int, ...]   # the target forwards the runner captures (1: AR and its warm-up)
    recurrent: bool                 # the target's state holds the whole sequence (models/registry.py)
    state: StateShape               # the target's per-sequence state per layer
    target_kv_bytes: int            # the target's KV pool, every sequence's rows
    draft_kv_bytes: int             # the draft's KV pool (0 without a draft)
    rope_bytes: int                 # the target's and the draft's float32 cos and sin tables
    state_bytes: int                # one copy of the recurrent states and conv windows (0: none)
    node_bytes: int                 # one tree node's delta-rule inputs and conv windows
    checkpoint_bytes: int           # --state-checkpoints copies of the states
    prefill_ubatch: int             # prompt tokens a prefill forward takes (--prefill-ubatch or
                                    # memory_plan.auto_settings' choice, else PREFILL_UBATCH)

    @classmethod
    def of(cls, cfg: EngineConfig, lm: TargetConfig, draft: Optional[DraftConfig], dtype: torch.dtype) -> "Layout":
        """The layout of `cfg` over these models in `dtype`. A tree has budget + 1 rows (the
        root); a chain verifies a block. The caches keep at least MIN_SCRATCH_ROWS past the
        context, so every step's scratch fits; the recurrent states keep per-node inputs for
        whichever of a tree and a block is larger."""
        arch = architecture_of(lm)
        state = arch.shape(lm)
        size = DTYPE_BYTES[dtype]
        rows = pages_for(cfg.max_ctx + max(cfg.budget + 1, MIN_SCRATCH_ROWS)) * PAGE_ROWS
        sequences = cfg.max_sequences or 1
        pool = max(rows, pages_for(cfg.kv_pool_tokens) * PAGE_ROWS) if cfg.kv_pool_tokens else sequences * rows
        pool_kv = pool + PAGE_ROWS  # and the sink page
        block = cfg.block_size or (draft.block_size if draft is not None else 1)
        speculative = draft is not None
        verify = {1, cfg.budget + 1 if cfg.mode == "ddtree" else block} if speculative else {1}
        k_bytes = kv_value_bytes(cfg.kv_type, dtype)
        v_bytes = kv_value_bytes(cfg.v_type or cfg.kv_type, dtype)
        window = state.window_values * size
        states = state.recurrent_layers * (state.state_floats * 4 + window)
        rope = 2 * rows * lm.rotary_dim * 4
        draft_kv = 0
        if draft is not None:
            per_value = kv_value_bytes(cfg.draft_kv_type, dtype)
            draft_kv = kv_bytes(draft.num_layers, pool_kv, draft.num_kv_heads, draft.head_dim, (per_value, per_value))
            rope += 2 * rows * draft.rotary_dim * 4
        return cls(rows=rows, sequences=sequences, pool_rows=pool, speculative=speculative, block_size=block,
                   tree_rows=cfg.budget + 1 if speculative else 1, node_rows=max(cfg.budget + 1, block),
                   verify_sizes=tuple(sorted(verify)), recurrent=arch.recurrent, state=state,
                   target_kv_bytes=kv_bytes(state.attention_layers, pool_kv, lm.num_kv_heads, lm.head_dim,
                                            (k_bytes, v_bytes)),
                   draft_kv_bytes=draft_kv, rope_bytes=rope, state_bytes=states,
                   node_bytes=state.recurrent_layers * (window + state.node_floats * 4),
                   checkpoint_bytes=cfg.state_checkpoints * states,
                   prefill_ubatch=cfg.prefill_ubatch or PREFILL_UBATCH)
