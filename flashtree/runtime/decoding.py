"""The decode step shared by ar, chain and ddtree: draft -> build -> verify -> accept -> commit.

All three modes are one loop over trees: ar verifies a root-only tree, chain a linear tree of the
draft's top-1 tokens, ddtree a best-first tree. The root is the pending "bonus" token (emitted,
not yet in the KV cache). Acceptance is sample-and-match: the target draws its own token at every
node from its processed distribution and the walk descends while the draw is a child, so every
emitted token is a target sample and the output distribution is exactly autoregressive decoding's.

A step is launched, then read (`launch`, `read`; `step` is both). A chain or ddtree step without
a grammar is a device step (device_step.py): its tree, walk and commit stay on the device and
the host reads the result once, after the commit is queued. So the engine can queue the next
step's draft (`draft_ahead`) before reading this step: the GPU drafts while the host streams
the tokens. It does so only while the next step's depth cap is certain to be the full block
(whatever this step accepts, the room left holds a whole block), so every tree, draw and token
is the one the step would give unqueued; the last steps of a request, and every step that
follows a host step, draft after the read.

Host steps keep the synchronous path: ar (a root-only tree; its walk is a read of its draw), a
step whose depth cap is 0 (root only), and a grammar's step (its admit and masks need the tree
on the host, and its next tree needs the grammar advanced by this step's tokens).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Union

import torch

from ..models.dflash import DFlashDraft
from ..errors import KVPagesExhausted, NonFiniteLogits
from ..models.dflash2 import DFlash2Draft, check_dflash2_tree
from ..kernels.gated_delta import TreeIndex
from ..kernels.quant import GEMM_MAX_ROWS
from ..kernels.tree import draft_top_k
from ..models.qwen3 import CausalLM
from . import faults
from .ddtree import Tree, build_tree, chain_tree, root_only
from .device_step import DeviceSteps, Drafted, Launched, StepResult
from .grammar import GrammarConstraint, apply_mask
from .graphs import ModelRunner
from .sampling import Sampler, SamplingParams
from .sequence import SequenceState

__all__ = ["Decoder", "Drafted", "Launched", "PlannedTree", "StepResult", "TreeRows", "warm_up_lengths"]


class PlannedTree(NamedTuple):
    """A host step's tree, the draft's top-1 per depth (traces), and a grammar's masks per node."""
    tree: Tree
    draft_top1: Optional[list[int]]
    masks: Optional[torch.Tensor]


class TreeRows(NamedTuple):
    """The verify rows of a host tree: ids [N], positions [N], ancestor mask [N, N] (None: a
    chain, causal) and a hybrid's tree index."""
    ids: torch.Tensor
    positions: torch.Tensor
    mask: Optional[torch.Tensor]
    index: Optional[TreeIndex]


def warm_up_lengths(chunk: int) -> list[int]:
    """The prefill chunk lengths a CUDA engine runs at start-up so that no request compiles a
    kernel: a full chunk and one row less (Triton specializes integer arguments divisible by 16),
    and every length up to GEMM_MAX_ROWS. Below that a chunk goes through the small-M GEMM and a
    decode-sized attention launch, whose compiled variants follow its row count; a chunk of 27
    rows not warmed up would compile two kernels mid-conversation, seconds of that turn.
    Those short chunks are common: an agent's short turn, the rows before a hybrid's state
    checkpoint, the prompt's last token."""
    return [n for n in dict.fromkeys([chunk, chunk - 1, *range(min(GEMM_MAX_ROWS, chunk), 0, -1)]) if n > 0]


class Decoder:
    """One decode step (and one prefill chunk) over the sequence state, through the runner.

    Each call is a transaction on the state: it commits its tokens at the end, after every cache
    has its rows, and an exception before that leaves the state as it was. Out-of-memory errors
    leave as EngineOutOfMemory naming the site (prefill, draft, verify, sample). A step whose
    path drew from logits that were not finite raises NonFiniteLogits: a host step before its
    commit, a device step (committed on the device) at its read, which empties the state."""

    def __init__(self, target: CausalLM, draft: Optional[DFlashDraft], state: SequenceState,
                 runner: ModelRunner, mode: str, budget: int, block_size: int, chain_seed: bool,
                 dflash2_tree: str = "topk"):
        if (mode == "ar") != (draft is None):
            raise ValueError(f"mode {mode!r} with{'out' if draft is None else ''} a draft")
        check_dflash2_tree(dflash2_tree, mode, draft.config if draft is not None else None)
        self.dflash2_tree = dflash2_tree
        self.target, self.draft, self.state, self.runner = target, draft, state, runner
        self.mode = mode
        self.budget = budget
        self.block_size = block_size
        self.chain_seed = chain_seed
        self.mask_token = draft.config.mask_token_id if draft is not None else 0
        self.device = state.length_dev.device
        self._device_steps: Optional[DeviceSteps] = None

    @property
    def step_rows(self) -> int:
        """The most rows one step writes past the sequence's length (its tree's, or a draft
        block's): the pages a step reserves before it runs."""
        return max(self.budget + 1, self.block_size)

    def _commit(self, start: int, tokens: list[int], ids: torch.Tensor, features: Optional[torch.Tensor],
                keep: Optional[torch.Tensor]) -> None:
        """The forward's scratch holds the target's rows for `tokens` (`ids` on the device; at
        offsets `keep`, or all in order): write the draft's rows, then keep the target's (and
        adopt a hybrid's recurrent states), then commit. The live state changes only in the
        last two, which allocate nothing, so an out-of-memory anywhere before leaves it as it
        was."""
        if self.draft is not None and features is not None:
            self.runner.append_context(features, ids)
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
            self._commit(start, ids, t, feats, None)
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
        rows = min(prompt_rows, self.state.capacity - 3 * self.step_rows)
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

    # ---- a decode step -----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, bonus: int, sampler: Sampler, max_emit: int, want_trace: bool = False,
             grammar: Optional[GrammarConstraint] = None) -> StepResult:
        """One decode step emitting between 1 and `max_emit` tokens; under a `grammar`, the tree
        loses the nodes it forbids and every node's draw is masked by the grammar after its path."""
        return self.read(self.launch(bonus, sampler, max_emit, want_trace, grammar))

    @torch.inference_mode()
    def launch(self, bonus: int, sampler: Sampler, max_emit: int, want_trace: bool = False,
               grammar: Optional[GrammarConstraint] = None, ahead: Optional[Drafted] = None) -> Launched:
        """Queue a step (a host step runs whole); `read` gives its result. `ahead`: this step's
        draft, queued by `draft_ahead` before the previous step was read (its root the bonus the
        device holds; `bonus` is then not used). Its launch error, if it had one, is raised here:
        where the step that needs it starts, after the previous step's tokens went out."""
        depth_cap = min(self.block_size - 1, max_emit - 1)
        if self.draft is None or depth_cap <= 0 or grammar is not None:
            return Launched(result=self._host_step(bonus, sampler, depth_cap, want_trace, grammar))
        steps = self.device_steps()
        if ahead is not None and ahead.error is not None:
            raise ahead.error
        if ahead is None or ahead.cap != depth_cap:  # (draft_ahead's rule makes the caps equal)
            ahead = steps.draft(depth_cap, bonus)
        return steps.verify(ahead, sampler, want_trace)

    @torch.inference_mode()
    def draft_ahead(self, launched: Launched, max_emit: int,
                    grammar: Optional[GrammarConstraint] = None) -> Optional[Drafted]:
        """Queue the next step's draft behind the `launched` device step (`max_emit`: the room
        the launched step had), before its result is read; None where the next step drafts after
        the read. Only where the next depth cap is certain: after this step's most tokens the
        room left still holds a whole block, so the cap is the block's, as the step would see
        it unqueued. A failure to launch comes back as the Drafted's error, so that the
        launched step is still read and its tokens still stream; but no KV page for the draft is
        no failure yet: the next step drafts after its own reservation, which may preempt another
        sequence for a page (here, with steps in flight, none can be)."""
        if grammar is not None or not self.next_block_certain(launched, max_emit):
            return None
        try:
            return self.device_steps().draft(self.block_size - 1, None)
        except KVPagesExhausted:
            return None
        except Exception as e:  # noqa: BLE001 (raised at the next launch, if there is one)
            return Drafted(error=e)

    def next_block_certain(self, launched: Launched, max_emit: int) -> bool:
        """Whether the step after `launched` (which had `max_emit` of room) drafts a whole block
        whatever this one emits: a device step with a draft, whose most tokens leave room for a
        block. Only then may its draft be queued before this step is read."""
        return (launched.result is None and self.draft is not None
                and max_emit - launched.most >= self.block_size)

    def read(self, launched: Launched) -> StepResult:
        """A launched step's result; the host's tokens catch up with the device's commit."""
        if launched.result is not None:
            return launched.result
        assert launched.steps is not None
        with torch.inference_mode():
            return launched.steps.read(launched)

    def device_steps(self) -> DeviceSteps:
        """The device steps at the current budget (the benchmark changes it between runs)."""
        s = self._device_steps
        if s is None or s.name[:3] != (self.mode, self.budget, self.chain_seed):
            s = self._device_steps = DeviceSteps(self)
        return s

    def _host_step(self, bonus: int, sampler: Sampler, depth_cap: int, want_trace: bool,
                   grammar: Optional[GrammarConstraint]) -> StepResult:
        """A step whose tree is built on the host: root only (ar, or no room for a draft), or a
        grammar's (its admit reads the tree built so far)."""
        return self.verify_tree(self.plan_tree(bonus, depth_cap, grammar), sampler, want_trace)

    def verify_tree(self, plan: PlannedTree, sampler: Sampler, want_trace: bool = False) -> StepResult:
        """One target forward over a host tree (through the runner: its graph where one holds
        it), then `accept`."""
        self.state.settled("a host step")
        start = self.state.length
        with faults.site("verify"):
            rows = self.tree_rows(plan.tree)
            hidden, feats = self.runner.target_forward(rows.ids, rows.positions, rows.mask, rows.index)
        return self.accept(plan, sampler, rows, hidden, feats, start, want_trace)

    def plan_tree(self, bonus: int, depth_cap: int, grammar: Optional[GrammarConstraint] = None) -> PlannedTree:
        """Draft (on the host path) and build the step's tree under `depth_cap`: root only
        without a draft or room; a chain of the draft's top-1; a best-first ddtree of the draft's
        candidates (_draft_candidates), which under a `grammar` admits only what it allows (and
        gets the grammar's masks per node)."""
        draft_top1: Optional[list[int]] = None
        if self.draft is None or depth_cap <= 0:
            tree = root_only(bonus)
        elif self.mode == "chain":
            with faults.site("draft"):
                top1 = self._draft_chain(bonus).tolist()
            draft_top1 = top1
            tree = chain_tree(bonus, top1[:depth_cap])
        else:
            with faults.site("draft"):
                vals, ids = self._draft_candidates(bonus)
            vals, ids = vals.cpu(), ids.cpu()
            draft_top1 = ids[:, 0].tolist()
            admit = grammar.admits if grammar is not None else None
            tree = build_tree(bonus, vals, ids, self.budget, self.chain_seed, depth_cap, admit)
        masks = None
        if grammar is not None:
            tree, masks = grammar.tree_masks(tree)
        return PlannedTree(tree, draft_top1, masks)

    def tree_rows(self, tree: Tree) -> TreeRows:
        """The verify forward's rows of a host tree after the committed length: its tokens at
        length + depth, its ancestor mask (None for a chain: causal), a hybrid's tree index."""
        start = self.state.length
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=self.device)
        depths = torch.tensor(tree.depths, dtype=torch.long, device=self.device)
        mask = None if tree.is_chain() else tree.ancestor_mask(self.device)
        index = (TreeIndex.build(tree.parents, self.target.config.conv_kernel, self.device)
                 if self.state.recurrent else None)
        return TreeRows(ids, depths + start, mask, index)

    def accept(self, plan: PlannedTree, sampler: Sampler, rows: TreeRows, hidden: torch.Tensor,
               feats: Optional[torch.Tensor], start: int, want_trace: bool) -> StepResult:
        """From the verify's hidden states of a host tree: the draws, the accept walk and the
        commit of the path. The row of path node k is the distribution of emitted token k (the
        last one's, of the new bonus): their logprobs are computed, when asked for, from those
        rows only (under a grammar's `masks`, of the constrained distribution). Only path rows
        must be finite: a row off the path emits nothing."""
        tree = plan.tree
        with faults.site("verify", inject=False):
            logits = apply_mask(self.target.logits(hidden), plan.masks)
        with faults.site("sample"):
            ancestors = None
            if sampler.p.has_penalties:  # per-node history only matters for penalties
                ancestors = rows.mask if rows.mask is not None else torch.ones(
                    tree.size, tree.size, dtype=torch.bool, device=self.device).tril()
            adjusted = sampler.adjust(logits, rows.ids, ancestors)
            drawn, finite = sampler.draw(adjusted).read()
        path, nxt = tree.walk(drawn)
        bad = next((k for k, node in enumerate(path) if not finite[node]), None)
        if bad is not None:  # path node k's row draws the token at position start + k + 1
            raise NonFiniteLogits(start + bad + 1)
        committed = [tree.tokens[n] for n in path]
        logprobs = None
        with faults.site("verify", inject=False):
            keep = torch.tensor(path, dtype=torch.long, device=self.device)
            if sampler.p.logprobs is not None:
                logprobs = sampler.token_logprobs(adjusted.index_select(0, keep), committed[1:] + [nxt])
            self._commit(start, committed, rows.ids.index_select(0, keep),
                         feats.index_select(0, keep) if feats is not None else None, keep)
        trace = None
        if want_trace:
            trace = {"draft_tokens": plan.draft_top1 or [], "tree_tokens": list(tree.tokens),
                     "tree_parents": list(tree.parents), "accepted": path}
        return StepResult(tokens=committed[1:] + [nxt], committed=committed, trace=trace, logprobs=logprobs)

    def _draft_logprobs(self, bonus: Optional[Union[int, torch.Tensor]] = None, direct: bool = False
                        ) -> torch.Tensor:
        """Draft log-probs [block_size-1, V] for the positions after the bonus: `bonus` goes to
        the runner's bonus buffer first (None: it holds the root already). `direct`: inside a
        captured phase."""
        return torch.log_softmax(self._draft_logits(bonus, direct)[1], dim=-1)

    def _draft_chain(self, bonus: Optional[Union[int, torch.Tensor]] = None, direct: bool = False) -> torch.Tensor:
        """The chain mode's tokens [block_size-1] after the bonus: each position's most likely
        token, or a DFlash2 draft's greedy path through its candidate selector (the reference's
        proposal). An instance's own _draft_logprobs (a test's oracle) is followed by argmax."""
        if "_draft_logprobs" in vars(self):
            return self._logprobs(bonus, direct).argmax(-1)
        hidden, logits = self._draft_logits(bonus, direct)
        if isinstance(self.draft, DFlash2Draft):
            return self.draft.select_chain(hidden, logits, self.runner.bonus)
        return logits.argmax(-1)  # log_softmax keeps each row's order

    def tree_width(self) -> int:
        """K, the candidates per position a ddtree's build takes: the top `budget` of the
        draft's log-probs, or the selector's top_k (at most `budget`) for a DFlash2 draft's
        selector tree (a node has at most `budget` children either way)."""
        if self.dflash2_tree == "selector" and isinstance(self.draft, DFlash2Draft):
            return min(self.budget, self.draft.config.selector_top_k)
        return min(self.budget, self.target.config.vocab_size)

    def _draft_candidates(self, bonus: Optional[Union[int, torch.Tensor]] = None, direct: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a ddtree is built from, host or device path: each position's K = tree_width()
        candidates after the bonus, best first, as log-probs and tokens [block_size-1, K]. The
        top K of the draft's log-probs; with `--dflash2-tree selector`, a DFlash2 draft's
        selector candidates, ranked and weighed by its scores given its greedy path
        (CandidateSelector.candidates). An instance's own _draft_logprobs (a test's oracle)
        gives its top K."""
        k = self.tree_width()
        if "_draft_logprobs" in vars(self):
            vals, ids = self._logprobs(bonus, direct).topk(k, dim=-1)
            return vals, ids
        hidden, logits = self._draft_logits(bonus, direct)
        if self.dflash2_tree == "selector":
            assert isinstance(self.draft, DFlash2Draft)
            logp, ids = self.draft.select_candidates(hidden, logits, self.runner.bonus)
            return logp[:, :k], ids[:, :k]
        return draft_top_k(logits, k)

    def _logprobs(self, bonus: Optional[Union[int, torch.Tensor]], direct: bool) -> torch.Tensor:
        """_draft_logprobs, `direct` passed only where it is set: an instance's own (a test's
        oracle) takes the bonus alone, and runs only eagerly and unshared."""
        return self._draft_logprobs(bonus, True) if direct else self._draft_logprobs(bonus)

    def _draft_logits(self, bonus: Optional[Union[int, torch.Tensor]], direct: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's final hidden [block_size-1, H] and logits [block_size-1, V] (float32) of
        the positions after the bonus (see _draft_logprobs); a DFlash2 draft's logits are
        scaled and soft-capped as its config says."""
        if isinstance(bonus, torch.Tensor):
            self.runner.bonus.copy_(bonus.reshape(1))
        elif bonus is not None:
            self.runner.bonus.fill_(bonus)
        hidden, logits = self.runner.draft_forward(direct)
        if logits is None:
            logits = self.target.logits(hidden)
        if isinstance(self.draft, DFlash2Draft):
            logits = self.draft.proposal_logits(logits)
        return hidden, logits

