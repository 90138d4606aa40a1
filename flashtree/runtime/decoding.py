"""The decode step shared by ar, chain and ddtree: draft -> build -> verify -> accept -> commit.

All three modes are one loop over trees: ar verifies a root-only tree, chain a linear tree of the
draft's top-1 tokens, ddtree a best-first tree. The root is the pending "bonus" token (emitted,
not yet in the KV cache). Acceptance is sample-and-match: the target draws its own token at every
node from its processed distribution and the walk descends while the draw is a child, so every
emitted token is a target sample and the output distribution is exactly autoregressive decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..models.dflash import DFlashDraft
from ..models.qwen3 import CausalLM
from .cuda_graphs import GraphRunner
from . import faults
from .ddtree import Tree, build_tree, chain_tree, root_only
from .kv_cache import KVCache
from .sampling import Sampler


@dataclass
class StepResult:
    tokens: list[int]                 # emitted: accepted node tokens after the root, then the new bonus
    committed: list[int]              # tokens whose KV rows this step committed (root + accepted)
    trace: Optional[dict[str, Any]] = None


class Decoder:
    """Owns the per-sequence model state (target and draft KV caches, kept the same length)."""

    def __init__(self, target: CausalLM, draft: Optional[DFlashDraft], target_cache: KVCache,
                 draft_cache: Optional[KVCache], mode: str, budget: int, block_size: int,
                 chain_seed: bool):
        self.target = target
        self.draft = draft if mode != "ar" else None
        self.tcache = target_cache
        self.dcache = draft_cache
        self.mode = mode if draft is not None else "ar"
        self.budget = budget
        self.block_size = block_size
        self.chain_seed = chain_seed
        self.feature_layers = tuple(draft.config.target_layer_ids) if self.draft is not None else ()
        self.mask_token = draft.config.mask_token_id if draft is not None else 0
        self.device = target.lm_head.weight.device
        self.phase = "prefill"  # the site being run, for naming an out-of-memory error
        self.runner: Optional[GraphRunner] = None  # the CUDA path, set by the engine

    @property
    def length(self) -> int:
        return self.tcache.length

    def truncate(self, n: int) -> None:
        self.tcache.truncate(n)
        if self.dcache is not None:
            self.dcache.truncate(min(n, self.dcache.length))

    def _commit_context(self, features: Optional[torch.Tensor], positions: torch.Tensor) -> None:
        if self.draft is not None and features is not None:
            if self.runner is not None:
                self.runner.append_context(features)
            else:
                self.draft.append_context(features, positions, self.dcache)

    def _target_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                        mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.runner is not None:
            return self.runner.target_forward(ids, positions, mask)
        return self.target(ids, positions, self.tcache, mask, self.feature_layers)

    @torch.inference_mode()
    def prefill_chunk(self, ids: list[int]) -> torch.Tensor:
        """Commit `ids` after the current state; return the last position's logits [V]."""
        self.phase = "prefill"
        faults.hit("prefill")
        start = self.tcache.length
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        hidden, feats = self._target_forward(t, positions, None)
        self.tcache.advance(len(ids))
        self._commit_context(feats, positions)
        return self.target.logits(hidden[-1:])

    @torch.inference_mode()
    def step(self, bonus: int, sampler: Sampler, max_emit: int, want_trace: bool = False) -> StepResult:
        """One decode step emitting between 1 and `max_emit` tokens."""
        start = self.tcache.length
        depth_cap = min(self.block_size - 1, max_emit - 1)
        draft_top1: Optional[list[int]] = None
        if self.draft is None or depth_cap <= 0:
            tree = root_only(bonus)
        else:
            logp = self._draft_logprobs(bonus, start)
            if self.mode == "chain":
                top1 = logp.argmax(-1).tolist()
                draft_top1 = top1
                tree = chain_tree(bonus, top1[:depth_cap])
            else:
                k = min(self.budget, logp.shape[-1])
                vals, ids = logp.topk(k, dim=-1)
                vals, ids = vals.cpu(), ids.cpu()
                draft_top1 = ids[:, 0].tolist()
                tree = build_tree(bonus, vals, ids, self.budget, self.chain_seed, depth_cap)
        path, nxt = self._verify(tree, start, sampler)
        committed = [tree.tokens[n] for n in path]
        trace = None
        if want_trace:
            trace = {"draft_tokens": draft_top1 or [], "tree_tokens": list(tree.tokens),
                     "tree_parents": list(tree.parents), "accepted": path}
        return StepResult(tokens=committed[1:] + [nxt], committed=committed, trace=trace)

    def _draft_logprobs(self, bonus: int, start: int) -> torch.Tensor:
        """Draft log-probs [block_size-1, V] for the positions after the bonus."""
        self.phase = "draft"
        faults.hit("draft")
        bs = self.block_size
        block = torch.full((bs,), self.mask_token, dtype=torch.long, device=self.device)
        block[0] = bonus
        positions = torch.arange(start, start + bs, device=self.device)
        if self.runner is not None:
            hidden = self.runner.draft_forward(block)
        else:
            hidden = self.draft(self.target.embed(block), positions, self.dcache)
        return torch.log_softmax(self.target.logits(hidden[1:]), dim=-1)

    def _verify(self, tree: Tree, start: int, sampler: Sampler) -> tuple[list[int], int]:
        """One target forward over the tree, the accept walk, and the commit of the path."""
        self.phase = "verify"
        faults.hit("verify")
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
        depths = torch.tensor(tree.depths, dtype=torch.long, device=self.device)
        positions = depths + start
        chain = tree.is_chain()
        mask = None if chain else tree.ancestor_mask(self.device)
        hidden, feats = self._target_forward(ids, positions, mask)
        logits = self.target.logits(hidden)
        ancestors = None
        if sampler.p.has_penalties:  # per-node history only matters for penalties
            ancestors = mask if mask is not None else torch.ones(
                tree.size, tree.size, dtype=torch.bool, device=self.device).tril()
        self.phase = "sample"
        drawn = sampler.draw(logits, ids, ancestors).tolist()
        path, nxt = tree.walk(drawn)
        keep = torch.tensor(path, dtype=torch.long, device=self.device)
        self.tcache.compact(keep)
        self._commit_context(feats.index_select(0, keep) if feats is not None else None,
                             positions.index_select(0, keep))
        return path, nxt
