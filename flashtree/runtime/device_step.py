"""A decode step that keeps its tree, its walk and its commit on the device (ddtree and chain
without a grammar), in two phases, so that the next step can be queued before the host reads
this one.

Phase A, `draft`: the draft's block [bonus, MASK...] (the bonus read from the device), its
log-probs, the top-k (chain: the argmax) and the tree with its ancestor masks, into the
runner's static tree buffers. It reads the committed state and writes only scratch rows, so a
phase A queued ahead and then not wanted (the host stops) changes nothing.

Phase B, `verify`: the target over the tree, the draws, the accept walk (kernels/tree.py) and
the commit, with no host value that depends on this step's result: the path is padded to a
fixed length P with its last node, the caches keep P rows at the device's length (rows past the
accepted count are scratch the next forward overwrites), a hybrid's fold takes the padding steps
as identities, the draft's context gets P rows, the device's length grows by the accepted count
and the new bonus goes to the runner's buffer. The step's result (count, bonus, how far the path's
logits were finite, path, tokens, and the tree for traces) is packed into one buffer and copied
to pinned host memory behind an event: `read` waits for that event only, not for work queued
after it (and fails a step whose path drew from logits that were not: NonFiniteLogits).

Under CUDA graphs each phase is one replay: phase A always, phase B for plain greedy requests
(argmax in the graph). A request with a temperature, a logit bias or penalties draws outside the
graph (the sampler's generator and its per-request tensors are not static); its verify is still
the verify graph's replay and its walk and commit run eagerly after the draws, still without a
read. Logprobs are computed at `read`, from the kept draws' rows: their own read of the device.

A hybrid target's recurrent scan follows an index of the tree (TreeIndex), made on the device
from the tree's parents, so a hybrid's step reads the device once too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

import torch

from ..errors import NonFiniteLogits
from ..kernels.gated_delta import TreeIndex
from ..kernels.tree import accept, ancestor_masks, build_trees, tree_size
from ..models.kv_cache import keep_paths
from . import faults
from .graphs import TreeBuffers
from .sampling import Draws, Sampler, TokenLogprob, argmax_draws

if TYPE_CHECKING:
    from .decoding import Decoder


# the packed result's first values: the accepted count, the next token and how many of the path's
# rows, from the root, had finite logits; then the padded path, its tokens and the tree (read's layout)
HEAD = 3


@dataclass
class StepResult:
    tokens: list[int]                 # emitted: accepted node tokens after the root, then the new bonus
    committed: list[int]              # tokens whose KV rows this step committed (root + accepted)
    trace: Optional[dict[str, Any]] = None
    logprobs: Optional[list[TokenLogprob]] = None  # per emitted token, when the request asks


@dataclass
class Drafted:
    """A phase A in the queue: the tree it builds (its depth cap, node count, and whether it is
    a chain by construction, which verifies causally), or the error that launching it raised
    (raised by the step that would have used it)."""
    cap: int = 0
    n: int = 0
    chain: bool = False
    error: Optional[BaseException] = None


# A draft's proposal for one block, as a tree is built from it: a chain's tokens [bs-1], or a
# ddtree's candidates (log-probs and tokens [bs-1, K])
Proposal = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class Walk(NamedTuple):
    """A tree's accept walk on the device: the padded path [P], its real length [1] and the next
    token [1] (the bonus of the step after)."""
    path: torch.Tensor
    count: torch.Tensor
    nxt: torch.Tensor


@dataclass
class Launched:
    """A step whose commit is queued. A host step's result is already known (`result`); a
    device step's is read by `read`."""
    result: Optional[StepResult] = None
    steps: Optional["DeviceSteps"] = None
    n: int = 0                                 # tree rows
    rows: int = 0                              # rows of the padded path (P)
    most: int = 0                              # the most rows the commit can hold
    want_trace: bool = False
    sampler: Optional[Sampler] = None
    adjusted: Optional[torch.Tensor] = None    # the draws' rows, kept for logprobs
    path: Optional[torch.Tensor] = None        # the padded path on the device (logprobs)


class DeviceSteps:
    """Phases A and B of one decoder's device steps at its current mode, budget and chain seed
    (the benchmark changes a decoder's budget between runs: a new set of buffers and graphs)."""

    def __init__(self, dec: "Decoder"):
        self.dec = dec
        self.chain_mode = dec.mode == "chain"
        self.depth = dec.block_size - 1
        self.k = 1 if self.chain_mode else dec.tree_width()
        self.rows = dec.block_size if self.chain_mode else dec.budget + 1  # N: the verify size
        self.name = (dec.mode, dec.budget, dec.chain_seed, id(dec))
        width = HEAD + 2 * min(self.rows, dec.block_size) + 2 * self.rows + self.depth
        self.result = torch.zeros(width, dtype=torch.long, device=dec.device)
        self.host: Optional[torch.Tensor] = None
        self.event: Optional[torch.cuda.Event] = None
        if dec.device.type == "cuda":
            self.host = torch.empty(width, dtype=torch.long, pin_memory=True)
            self.event = torch.cuda.Event()
        self.chain_index: dict[int, TreeIndex] = {}

    @property
    def buf(self) -> TreeBuffers:
        return self.dec.runner.tree_buffers(self.name, self.rows, self.depth)

    def size(self, cap: int) -> int:
        """The tree's node count at depth cap `cap`, known on the host without reading it."""
        return cap + 1 if self.chain_mode else tree_size(self.dec.budget, self.k, cap)

    def is_chain(self, cap: int) -> bool:
        """Chains by construction verify causally, as the host path's chains do."""
        d = self.dec
        return self.chain_mode or self.k == 1 or (d.chain_seed and d.budget <= cap)

    # ---- phase A ---------------------------------------------------------------------------
    def draft(self, cap: int, bonus: Optional[int]) -> Drafted:
        """Queue the draft and the tree build at depth cap `cap` (>= 1); `bonus` None: the
        device's bonus buffer holds the root (the previous device step wrote it)."""
        d = self.dec
        runner = d.runner
        with faults.site("draft"):
            if bonus is not None:
                runner.bonus.fill_(bonus)
            self.buf.set_cap(cap)
            graphed = (runner.draft_run is not None and "_draft_logprobs" not in vars(d)
                       and d.state.reserve(d.block_size))
            if graphed:  # an instance's own _draft_logprobs (a test's oracle) runs eagerly
                runner.graph(("draft", *self.name), lambda: self._build(True))()
            else:
                self._build(False)
        return Drafted(cap, self.size(cap), self.is_chain(cap))

    def _build(self, direct: bool, proposal: Optional[Proposal] = None) -> None:
        """The tree from the draft's proposal into the tree buffers: `proposal` where a shared
        draft phase made it (a chain's tokens [bs-1], or a ddtree's candidates: log-probs and
        tokens [bs-1, K]), else from the draft's forward run here."""
        d, buf = self.dec, self.buf
        bonus = d.runner.bonus
        if self.chain_mode:  # the host chain's own choice (topk's ties may differ from argmax)
            top1 = proposal if proposal is not None else d._draft_chain(None, direct)
            at = torch.arange(self.rows, device=bonus.device)
            cap = buf.cap.long()
            real = at <= cap
            tokens = torch.where(real, torch.cat([bonus, top1]), bonus)
            parents, depths = torch.where(real, at - 1, -1), torch.where(real, at, 0)
            n_nodes = (cap + 1).clamp(max=self.rows).int()
        else:
            vals, top = proposal if proposal is not None else d._draft_candidates(None, direct)  # the host path's
            trees = build_trees(vals.float()[None], top[None], bonus, d.budget, d.chain_seed, buf.cap)
            tokens, parents, depths, n_nodes = trees.tokens[0], trees.parents[0], trees.depths[0], trees.n_nodes
            top1 = top[:, 0]
        self._store(tokens, parents, depths, n_nodes, top1)

    def _store(self, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n_nodes: torch.Tensor,
               top1: torch.Tensor, ancestors: Optional[torch.Tensor] = None) -> None:
        """A built tree into the buffers the verify reads; its ancestor mask from its parents
        unless given (one mask made for several trees)."""
        buf = self.buf
        buf.ids.copy_(tokens)
        buf.parents.copy_(parents)
        buf.depths.copy_(depths)
        buf.n_nodes.copy_(n_nodes)
        buf.ancestors.copy_(ancestors if ancestors is not None else ancestor_masks(buf.parents[None], buf.n_nodes)[0])
        buf.top1.copy_(top1)

    @staticmethod
    def build_together(steps: list["DeviceSteps"], proposals: list[Proposal]) -> None:
        """Each step's tree from its proposal (`_build`'s): ddtrees in one best-first build and
        one ancestor mask for all (a shared draft phase's, whose trees would otherwise each take
        the build's kernels), a tree its own row of the build whatever trees are built with it;
        chains each their own (no build to share)."""
        first = _alike(steps)
        if first.chain_mode:
            for s, proposal in zip(steps, proposals):
                s._build(True, proposal)
            return
        top = torch.stack([t for _, t in proposals])
        trees = build_trees(torch.stack([v for v, _ in proposals]).float(), top,
                            torch.cat([s.dec.runner.bonus for s in steps]), first.dec.budget, first.dec.chain_seed,
                            torch.cat([s.buf.cap for s in steps]))
        ancestors = ancestor_masks(trees.parents, trees.n_nodes)
        for i, s in enumerate(steps):
            s._store(trees.tokens[i], trees.parents[i], trees.depths[i], trees.n_nodes[i:i + 1], top[i, :, 0],
                     ancestors[i])

    # ---- phase B ---------------------------------------------------------------------------
    def stage(self, drafted: Drafted, sampler: Optional[Sampler]) -> bool:
        """Check the room and, where the step's verify will run over the static buffers of its
        size (for a step alone: a plain greedy request, whose draws its greedy phase makes
        itself; `sampler` None: any request, a shared step's), stage a hybrid's tree index
        there; True then. A shared step (batch_step.py) stages each sequence's, runs one phase
        for all, then `launch`es each."""
        d = self.dec
        d.state.settled("a device step")
        d.state.check_room(max(self.rows, d.block_size))
        if not ((sampler is None or sampler.plain_greedy) and d.runner.verify_rows(self.rows) == self.rows):
            return False
        d.runner.stage_tree(self.rows, self._tree_index(drafted.n, drafted.chain))
        return True

    def verify(self, drafted: Drafted, sampler: Sampler, want_trace: bool) -> Launched:
        """Queue the verify, the draws, the walk and the commit of a drafted tree; nothing is
        read here."""
        d = self.dec
        state, runner, n = d.state, d.runner, drafted.n
        with faults.site("verify"):
            graphed = self.stage(drafted, sampler)
            if not graphed:
                buf = self.buf
                anc = buf.ancestors[:n, :n]
                hidden, feats = runner.target_forward(buf.ids[:n], buf.depths[:n] + state.length_dev,
                                                      None if drafted.chain else anc,
                                                      self._tree_index(n, drafted.chain))
                logits = d.target.logits(hidden)
        if not graphed:
            return self.draw_and_commit(drafted, sampler, want_trace, logits, feats)
        with faults.site("sample"):
            runner.graph(("verify", *self.name), self.greedy_phase, state.preserved)()
        return self.launched(drafted, sampler, want_trace, True)

    def draw_and_commit(self, drafted: Drafted, sampler: Sampler, want_trace: bool, logits: torch.Tensor,
                        feats: Optional[torch.Tensor]) -> Launched:
        """The sampler's draws from the logits of the tree's n rows (a temperature, a logit bias,
        penalties or logprobs: not a graph's), the walk and the commit, eagerly and still
        without a read: the step alone's, or a shared verify's for a request it did not draw."""
        n, buf = drafted.n, self.buf
        with faults.site("sample"):
            adjusted = sampler.adjust(logits, buf.ids[:n], buf.ancestors[:n, :n] if sampler.p.has_penalties else None)
            path = self._walk_and_commit(sampler.draw(adjusted), feats, n, direct=False)
        return self.launched(drafted, sampler, want_trace, False, adjusted, path)

    def launched(self, drafted: Drafted, sampler: Sampler, want_trace: bool, graphed: bool,
                 adjusted: Optional[torch.Tensor] = None, path: Optional[torch.Tensor] = None) -> Launched:
        """The step's commit is queued (its phase ran or was replayed): queue the copy of its
        result to the host and say so to the sequence state."""
        d = self.dec
        if self.event is not None and self.host is not None:
            self.host.copy_(self.result, non_blocking=True)
            self.event.record()
        most = min(drafted.n, drafted.cap + 1)
        d.state.launched(most)
        rows = self.rows if graphed else drafted.n
        return Launched(None, self, drafted.n, min(rows, d.block_size), most, want_trace, sampler,
                        adjusted if sampler.p.logprobs is not None else None, path)

    def _tree_index(self, n: int, chain: bool) -> Optional[TreeIndex]:
        """A hybrid target's scan index: a chain's is known on the host (built once a length);
        a tree's is made on the device from its parents, with nothing read."""
        d = self.dec
        if not d.state.recurrent:
            return None
        if chain:
            if n not in self.chain_index:
                self.chain_index[n] = TreeIndex.build(list(range(-1, n - 1)), d.target.config.conv_kernel, d.device)
            return self.chain_index[n]
        return TreeIndex.from_parents(self.buf.parents[:n], self.buf.n_nodes, d.target.config.conv_kernel)

    def greedy_phase(self) -> None:
        """Phase B of a plain greedy request over all N rows: the verify through its static
        buffers, the head, argmax (and which rows were finite), walk and commit (one graph).
        Padding rows draw anything: the walk never enters them."""
        hidden, feats = self.dec.runner.verify_direct(*self.static_rows())
        self._walk_and_commit(argmax_draws(self.dec.target.logits(hidden)), feats, self.rows, direct=True)

    def static_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree's N rows as the verify takes them: ids, positions after the device's
        length, the ancestor mask."""
        buf = self.buf
        return buf.ids, buf.depths + self.dec.state.length_dev, buf.ancestors

    def _walk_and_commit(self, drawn: Draws, feats: Optional[torch.Tensor], n: int,
                         direct: bool) -> torch.Tensor:
        """The accept walk over the first n rows, the draft's context rows of its padded path,
        and the path's commit (a shared verify phase runs each of walk, the append and commit for
        every sequence before the next, so that one draft forward appends every path)."""
        walk = self.walk(drawn, n)
        if feats is not None and self.dec.draft is not None:
            with faults.site("verify", inject=False):
                self.dec.runner.append_context(*self.context_rows(walk, feats), direct)
        self.commit(walk)
        return walk.path

    def walk(self, drawn: Draws, n: Optional[int] = None) -> Walk:
        """The accept walk over the tree's first n rows (default: all N) given each row's draw,
        its result packed into `result` before any live state is written (the pack allocates;
        the commit's writes after the fold's gathers do not), so an out-of-memory leaves the
        state as it was."""
        buf = self.buf
        n = self.rows if n is None else n
        with faults.site("verify", inject=False):
            path, count, nxt = accept(buf.ids[None, :n], buf.parents[None, :n], buf.n_nodes, drawn.tokens[None],
                                      buf.ancestors[None, :n, :n])
            return self._packed(path[0], count, nxt, drawn.finite)

    @staticmethod
    def walk_together(steps: list["DeviceSteps"], draws: list[Draws]) -> list[Walk]:
        """Each step's walk over all its rows given its draws (`walk`'s), in one accept over the
        trees stacked (a shared verify phase's, whose 8 trees would otherwise walk in 8 runs of
        the same small kernels): the walk is a tree's own, row by row, whatever trees are stacked
        with it."""
        _alike(steps)
        bufs = [s.buf for s in steps]
        with faults.site("verify", inject=False):
            paths, counts, nxts = accept(torch.stack([b.ids for b in bufs]), torch.stack([b.parents for b in bufs]),
                                         torch.cat([b.n_nodes for b in bufs]), torch.stack([d.tokens for d in draws]),
                                         torch.stack([b.ancestors for b in bufs]))
            return [s._packed(paths[i], counts[i:i + 1], nxts[i:i + 1], draws[i].finite) for i, s in enumerate(steps)]

    def _packed(self, path: torch.Tensor, count: torch.Tensor, nxt: torch.Tensor, finite: torch.Tensor) -> Walk:
        """The walk of one tree (its padded path [N], length [1] and next token [1]) cut to the
        block and packed into `result` before any live state is written, with how many of its
        rows, from the root, had finite logits (`finite`: per tree row): the index of the first
        that had not, or P."""
        buf = self.buf
        path = path[:min(path.shape[0], self.dec.block_size)]  # a path holds at most depth cap + 1 <= bs nodes
        finite_lead = finite.gather(0, path).long().cumprod(0).sum().reshape(1)
        packed = torch.cat([count, nxt, finite_lead, path, buf.ids.gather(0, path), buf.ids, buf.parents, buf.top1])
        self.result[:packed.numel()].copy_(packed)
        return Walk(path, count, nxt)

    def context_rows(self, walk: Walk, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the draft's context takes of a walked path: its rows' target features and tokens."""
        return feats.index_select(0, walk.path), self.buf.ids.gather(0, walk.path)

    def commit(self, walk: Walk) -> None:
        """Keep the walked path's rows and states, move the device length on, and leave its next
        token as the bonus: the step's only writes to live state."""
        DeviceSteps.commit_together([self], [walk])

    @staticmethod
    def commit_together(steps: list["DeviceSteps"], walks: list[Walk]) -> None:
        """Each step's commit (`commit`'s) given its walk, the KV rows of every path moved in one
        gather and scatter a pool tensor (kv_cache.keep_paths: a shared verify phase's 8
        sequences would otherwise move theirs in 8 runs of the same small launches); the
        recurrent folds, lengths and bonuses each sequence's own."""
        states = [s.dec.state for s in steps]
        with faults.site("verify", inject=False):
            keep_paths([state.kv_caches()[0] for state in states], [state.length_dev for state in states],
                       [w.path for w in walks])
            for step, state, walk in zip(steps, states, walks):
                state.target.fold_path(walk.path, walk.count)
                state.commit_on_device(walk.count)
                step.dec.runner.bonus.copy_(walk.nxt)

    # ---- the read --------------------------------------------------------------------------
    def read(self, launched: Launched) -> StepResult:
        """Wait for the step's result (its event: not for work queued after it), bring the
        host's tokens up to the device, and compute logprobs where asked. Where a path row's
        logits were not finite the state, which the device committed the step to, is emptied
        (a hybrid need have no checkpoint before the step) and NonFiniteLogits raised."""
        if self.event is not None and self.host is not None:
            self.event.synchronize()
            values = self.host.tolist()
        else:
            values = self.result.tolist()
        n, p = launched.n, launched.rows
        m, nxt, finite_lead = values[:HEAD]
        nodes, committed = values[HEAD:HEAD + m], values[HEAD + p:HEAD + p + m]
        state = self.dec.state
        state.settle(committed)
        if finite_lead < m:  # path node k's row draws the token at position start + k + 1
            position = state.length - m + finite_lead + 1
            state.truncate(0)
            raise NonFiniteLogits(position)
        logprobs = None
        if launched.adjusted is not None and launched.path is not None and launched.sampler is not None:
            with faults.site("verify", inject=False):
                logprobs = launched.sampler.token_logprobs(launched.adjusted.index_select(0, launched.path[:m]),
                                                           committed[1:] + [nxt])
        trace = None
        if launched.want_trace:
            rest = values[HEAD + 2 * p:]
            trace = {"draft_tokens": rest[2 * self.rows:2 * self.rows + self.depth], "tree_tokens": rest[:n],
                     "tree_parents": rest[self.rows:self.rows + n], "accepted": nodes}
        return StepResult(tokens=committed[1:] + [nxt], committed=committed, trace=trace, logprobs=logprobs)


def _alike(steps: list[DeviceSteps]) -> DeviceSteps:
    """The first of steps that share one phase, which are one engine's sequences: one mode,
    budget and chain seeding, so their trees have one size and build and walk alike."""
    if len({s.name[:3] for s in steps}) > 1:
        raise ValueError("steps built or walked together need one decode mode, budget and chain seeding")
    return steps[0]
