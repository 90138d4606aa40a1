"""The decode step shared by ar, chain and ddtree: draft -> build -> verify -> accept -> commit.

All three modes are one loop over trees: ar verifies a root-only tree, chain a linear tree of the
draft's top-1 tokens, ddtree a best-first tree. The root is the pending "bonus" token (emitted,
not yet in the KV cache). Acceptance is sample-and-match: the target draws its own token at every
node from its processed distribution and the walk descends while the draw is a child, so every
emitted token is a target sample and the output distribution is exactly autoregressive decoding's.

A ddtree step without a grammar keeps its tree on the device (kernels/tree.py): the draft's
top-k is not read, the tree is built, masked, verified and walked there, and the host reads the
accepted path, its tokens and the next bonus in one transfer after the draws (a hybrid target
also reads the tree's parents before the verify: its recurrent scan's index is built on the
host). The tree's size is known on the host without reading it (tree_size). A grammar's step,
and ar's and chain's, build the tree on the host: the grammar's admit and masks need it there,
and ar's and chain's walks are a read of their draws.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch

from ..models.dflash import DFlashDraft
from ..kernels.gated_delta import TreeIndex
from ..kernels.quant import GEMM_MAX_ROWS
from ..kernels.tree import accept, ancestor_masks, build_trees, tree_positions, tree_size
from ..models.qwen3 import CausalLM
from . import faults
from .ddtree import Tree, build_tree, chain_tree, root_only
from .grammar import GrammarConstraint, apply_mask
from .graphs import ModelRunner
from .sampling import Sampler, SamplingParams, TokenLogprob
from .sequence import SequenceState


def warm_up_lengths(chunk: int) -> list[int]:
    """The prefill chunk lengths a CUDA engine runs at start-up so that no request compiles a
    kernel: a full chunk and one row less (Triton specializes integer arguments divisible by 16),
    and every length up to GEMM_MAX_ROWS. Below that a chunk goes through the small-M GEMM and a
    decode-sized attention launch, whose compiled variants follow its row count; a chunk of 27
    rows not warmed up would compile two kernels mid-conversation, seconds of that turn.
    Those short chunks are common: an agent's short turn, the rows before a hybrid's state
    checkpoint, the prompt's last token."""
    return [n for n in dict.fromkeys([chunk, chunk - 1, *range(min(GEMM_MAX_ROWS, chunk), 0, -1)]) if n > 0]


@dataclass
class StepResult:
    tokens: list[int]                 # emitted: accepted node tokens after the root, then the new bonus
    committed: list[int]              # tokens whose KV rows this step committed (root + accepted)
    trace: Optional[dict[str, Any]] = None
    logprobs: Optional[list[TokenLogprob]] = None  # per emitted token, when the request asks


class Decoder:
    """One decode step (and one prefill chunk) over the sequence state, through the runner.

    Each call is a transaction on the state: it commits its tokens at the end, after every cache
    has its rows, and an exception before that leaves the state as it was. Out-of-memory errors
    leave as EngineOutOfMemory naming the site (prefill, draft, verify, sample)."""

    def __init__(self, target: CausalLM, draft: Optional[DFlashDraft], state: SequenceState,
                 runner: ModelRunner, mode: str, budget: int, block_size: int, chain_seed: bool):
        if (mode == "ar") != (draft is None):
            raise ValueError(f"mode {mode!r} with{'out' if draft is None else ''} a draft")
        self.target, self.draft, self.state, self.runner = target, draft, state, runner
        self.mode = mode
        self.budget = budget
        self.block_size = block_size
        self.chain_seed = chain_seed
        self.mask_token = draft.config.mask_token_id if draft is not None else 0
        self.device = state.length_dev.device

    def _commit(self, start: int, tokens: list[int], features: Optional[torch.Tensor],
                keep: Optional[torch.Tensor]) -> None:
        """The forward's scratch holds the target's rows for `tokens` (at offsets `keep`, or all
        in order): write the draft's rows, then keep the target's (and adopt a hybrid's
        recurrent states), then commit. The live state changes only in the last two, which
        allocate nothing, so an out-of-memory anywhere before leaves it as it was."""
        if self.draft is not None and features is not None:
            self.runner.append_context(features)
        self.state.target.keep_rows(start, keep)
        self.state.commit(tokens)

    @torch.inference_mode()
    def prefill_chunk(self, ids: list[int]) -> torch.Tensor:
        """Commit `ids` after the current state; return the last position's logits [V]."""
        with faults.site("prefill"):
            start = self.state.length
            t = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.arange(start, start + len(ids), device=self.device)
            hidden, feats = self.runner.target_forward(t, positions, None, None)
            logits = self.target.logits(hidden[-1:])
            self._commit(start, ids, feats, None)
        return logits

    @torch.inference_mode()
    def warm_up_prefill(self, lengths: list[int]) -> None:
        """Prefill dummy chunks of these lengths over an empty state, then empty it again: the
        kernels a prefill compiles (Triton's, once per shape class) compile here, at start-up, not
        in the first request (a 27B's prefill compiles some 20, which would make the first
        request's forwards take seconds). The chunks follow one another, and the state starts
        again from empty where the next would not fit. Nothing stays: no row is committed past the
        truncation and a hybrid's recurrent states go back to zero."""
        if any(not 0 < n <= self.state.capacity for n in lengths):
            raise ValueError(f"warm-up chunks must hold 1 to {self.state.capacity} rows, got {lengths}")
        with self._from_empty("warm_up_prefill"):
            for n in lengths:
                if self.state.length + n > self.state.capacity:
                    self.state.truncate(0)
                self.prefill_chunk([0] * n)

    @torch.inference_mode()
    def warm_up_decode(self, prompt_rows: int = 16) -> None:
        """A dummy prompt of `prompt_rows` rows, then decode steps over it (one that emits a single
        token, then two full ones), then the state empty again: what a step runs outside its
        captured graphs compiles here, not in the first request (the lm_head over the draft
        block's and the tree's rows, the fold of an accepted path into a hybrid's recurrent
        states, whose one compile serves paths of any length; compiled in the first answer
        instead, they slow its steps). Greedy, so nothing here draws from a request's
        generator; nothing stays, as with warm_up_prefill."""
        rows = min(prompt_rows, self.state.capacity - 3 * max(self.budget + 1, self.block_size))
        if rows < 1:  # three steps' trees past the prompt, each inside the state (so in its graph)
            raise ValueError(f"the state ({self.state.capacity} rows) is too short to warm a decode step up")
        sampler = Sampler(SamplingParams(), self.target.config.vocab_size, self.device, [])
        with self._from_empty("warm_up_decode"):
            self.prefill_chunk([0] * rows)
            bonus = 0
            for max_emit in (1, self.block_size, self.block_size):
                bonus = self.step(bonus, sampler, max_emit).tokens[-1]

    @contextmanager
    def _from_empty(self, what: str) -> Iterator[None]:
        """Run a warm-up over the empty state and leave it empty again, whatever happens."""
        if self.state.length:
            raise RuntimeError(f"{what} needs an empty state")
        try:
            yield
        finally:
            self.state.truncate(0)

    @torch.inference_mode()
    def step(self, bonus: int, sampler: Sampler, max_emit: int, want_trace: bool = False,
             grammar: Optional[GrammarConstraint] = None) -> StepResult:
        """One decode step emitting between 1 and `max_emit` tokens; under a `grammar`, the tree
        loses the nodes it forbids and every node's draw is masked by the grammar after its path."""
        depth_cap = min(self.block_size - 1, max_emit - 1)
        draft_top1: Optional[list[int]] = None
        if self.draft is None or depth_cap <= 0:
            tree = root_only(bonus)
        else:
            logp = self._draft_logprobs(bonus)
            if self.mode == "chain":
                top1 = logp.argmax(-1).tolist()
                draft_top1 = top1
                tree = chain_tree(bonus, top1[:depth_cap])
            elif grammar is None:
                return self._device_tree_step(bonus, logp, depth_cap, sampler, want_trace)
            else:  # the grammar's admit reads the tree built so far: built on the host
                k = min(self.budget, logp.shape[-1])
                vals, ids = logp.topk(k, dim=-1)
                vals, ids = vals.cpu(), ids.cpu()
                draft_top1 = ids[:, 0].tolist()
                tree = build_tree(bonus, vals, ids, self.budget, self.chain_seed, depth_cap, grammar.admits)
        masks = None
        if grammar is not None:
            tree, masks = grammar.tree_masks(tree)
        path, nxt, logprobs = self._verify(tree, sampler, masks)
        committed = [tree.tokens[n] for n in path]
        trace = None
        if want_trace:
            trace = {"draft_tokens": draft_top1 or [], "tree_tokens": list(tree.tokens),
                     "tree_parents": list(tree.parents), "accepted": path}
        return StepResult(tokens=committed[1:] + [nxt], committed=committed, trace=trace, logprobs=logprobs)

    def _draft_logprobs(self, bonus: int) -> torch.Tensor:
        """Draft log-probs [block_size-1, V] for the positions after the bonus."""
        with faults.site("draft"):
            block = torch.full((self.block_size,), self.mask_token, dtype=torch.long, device=self.device)
            block[:1].fill_(bonus)  # a fill kernel: an indexed store would copy from the host and wait
            hidden = self.runner.draft_forward(block)
            return torch.log_softmax(self.target.logits(hidden[1:]), dim=-1)

    def _verify(self, tree: Tree, sampler: Sampler, masks: Optional[torch.Tensor] = None
                ) -> tuple[list[int], int, Optional[list[TokenLogprob]]]:
        """One target forward over the tree, the accept walk, and the commit of the path.
        `masks` [N, V]: the tokens each node's draw may take (a grammar's), or None for all. The
        row of path node k is the distribution of emitted token k (the last one's, of the new
        bonus): their logprobs are computed, when asked for, from those rows only (masked: under
        a grammar they are the constrained distribution's)."""
        start = self.state.length
        with faults.site("verify"):
            ids = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
            depths = torch.tensor(tree.depths, dtype=torch.long, device=self.device)
            positions = depths + start
            mask = None if tree.is_chain() else tree.ancestor_mask(self.device)
            index = (TreeIndex.build(tree.parents, self.target.config.conv_kernel, self.device)
                     if self.state.recurrent else None)
            hidden, feats = self.runner.target_forward(ids, positions, mask, index)
            logits = apply_mask(self.target.logits(hidden), masks)
        with faults.site("sample"):
            ancestors = None
            if sampler.p.has_penalties:  # per-node history only matters for penalties
                ancestors = mask if mask is not None else torch.ones(
                    tree.size, tree.size, dtype=torch.bool, device=self.device).tril()
            adjusted = sampler.adjust(logits, ids, ancestors)
            drawn = sampler.pick(adjusted).tolist()
        path, nxt = tree.walk(drawn)
        logprobs = self._finish(start, path, [tree.tokens[n] for n in path], nxt, adjusted, feats, sampler)
        return path, nxt, logprobs

    def _device_tree_step(self, bonus: int, logp: torch.Tensor, depth_cap: int, sampler: Sampler,
                          want_trace: bool) -> StepResult:
        """A ddtree step (no grammar) whose tree stays on the device: top-k, build, mask and
        positions, verify, draws and accept walk all run there, and the host reads the walk's
        result once, after the draws (with the tree and the draft's top-1 when tracing). The tree
        is build_tree's node for node, so the verify sees what the host path would give it."""
        start, dev = self.state.length, self.device
        k = min(self.budget, logp.shape[-1])
        n = tree_size(self.budget, k, depth_cap)
        # trees that are chains by construction verify causally, as the host path's chains do
        chain = k == 1 or (self.chain_seed and self.budget <= depth_cap)
        with faults.site("verify"):
            vals, top = logp.topk(k, dim=-1)
            trees = build_trees(vals.float()[None], top[None], torch.full((1,), bonus, dtype=torch.long, device=dev),
                                self.budget, self.chain_seed,
                                torch.full((1,), depth_cap, dtype=torch.int32, device=dev))
            ids, parents = trees.tokens[0, :n], trees.parents[0, :n]
            positions = tree_positions(trees.depths[0, :n], start)
            ancestors = ancestor_masks(trees.parents[:, :n], trees.n_nodes)
            index = None
            if self.state.recurrent:  # the scan's index is built on the host: the parents are read here
                host_parents = list(range(-1, n - 1)) if chain else parents.tolist()
                index = TreeIndex.build(host_parents, self.target.config.conv_kernel, dev)
            hidden, feats = self.runner.target_forward(ids, positions, None if chain else ancestors[0], index)
            logits = self.target.logits(hidden)
        with faults.site("sample"):
            adjusted = sampler.adjust(logits, ids, ancestors[0] if sampler.p.has_penalties else None)
            drawn = sampler.pick(adjusted)
            path, length, nxt = accept(ids[None], parents[None], trees.n_nodes, drawn[None], ancestors)
            parts = [length, nxt, path[0], ids.gather(0, path[0])]
            if want_trace:
                parts += [ids, parents, top[:, 0]]
            host = torch.cat(parts).tolist()  # the step's one read of the device
        m, nxt_host = host[0], host[1]
        nodes, committed = host[2:2 + m], host[2 + n:2 + n + m]
        logprobs = self._finish(start, path[0, :m], committed, nxt_host, adjusted, feats, sampler)
        trace = None
        if want_trace:
            rest = host[2 + 2 * n:]
            trace = {"draft_tokens": rest[2 * n:], "tree_tokens": rest[:n], "tree_parents": rest[n:2 * n],
                     "accepted": nodes}
        return StepResult(tokens=committed[1:] + [nxt_host], committed=committed, trace=trace, logprobs=logprobs)

    def _finish(self, start: int, keep: Union[list[int], torch.Tensor], committed: list[int], nxt: int,
                adjusted: torch.Tensor, feats: Optional[torch.Tensor], sampler: Sampler
                ) -> Optional[list[TokenLogprob]]:
        """The accepted path's logprobs, when asked for, and its commit. `keep`: the path's nodes
        (a host list, or already on the device); `committed`: their tokens; `nxt`: the new bonus.
        The row of path node k is the distribution of emitted token k (the last one's, of the new
        bonus)."""
        logprobs = None
        with faults.site("verify", inject=False):
            if not isinstance(keep, torch.Tensor):
                keep = torch.tensor(keep, dtype=torch.long, device=self.device)
            if sampler.p.logprobs is not None:
                logprobs = sampler.token_logprobs(adjusted.index_select(0, keep), committed[1:] + [nxt])
            self._commit(start, committed, feats.index_select(0, keep) if feats is not None else None, keep)
        return logprobs
