"""The model runner: every forward the decoder makes, and on CUDA the graphs that replay them.

At batch 1 a decode step is a few hundred small launches around a read of every weight; issued
one by one from Python they cost more than the read. On CUDA (bf16/fp16, Triton present) each
per-step forward is captured once and then replayed: the target over N tokens (N = 1 for AR,
N = budget + 1 for a tree, padded), the draft block, and the draft's context append. A graph
reads its token ids, positions and tree mask from static buffers and the committed length from
the sequence state's device tensor (one ForwardInput over them, built at capture), so one graph
serves every step and every context length.
Padded tree rows see only the context and themselves, and no real row sees them; their K/V land
in scratch rows past the committed length.

The runner owns every graph, and they share one memory pool. Capture runs with the garbage
collector off: a graph of an earlier runner destroyed by the collector in the middle of a
capture invalidates it. `close()` releases the graphs explicitly. Without `static` (the CPU,
float32, --no-cuda-graphs) the same methods call the models directly; `static` without
`capture` runs the static-buffer path eagerly, which lets the CPU tests check its padding, masks
and context append.

A decode step's own graphs (`graph`): the decoder hands the runner whole phases of a step (the
draft with its head and the tree build; the verify with its head, greedy draws, accept walk and
commit), which are captured at their first use, once per name. Inside such a phase the
forwards run through their static buffers *directly* (`direct=True`): a graph cannot replay
another inside its capture. The draft's block is [bonus, MASK...] with the bonus read from the
device (`bonus`), so a step queued before the host has read the previous one drafts from the
right token; the tree's static buffers (`tree_buffers`) carry the build to the verify.

Room checks use the sequence state's `bound`: the device's length may be ahead of the host's.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ..kernels import HAVE_TRITON
from ..kernels.gated_delta import TreeIndex
from ..models.dflash import DFlashDraft
from ..models.inputs import ForwardInput
from ..models.mtp import MTPCache, MTPDraft
from ..models.qwen3 import CausalLM
from .sequence import SequenceState

Outputs = tuple[torch.Tensor, Optional[torch.Tensor]]
Drafts = tuple[torch.Tensor, Optional[torch.Tensor]]  # a draft's hidden [bs-1, H] and logits [bs-1, V] or None


def can_capture(device: torch.device, dtype: torch.dtype, enabled: bool) -> bool:
    """Graphs apply on CUDA with Triton, in the dtypes the kernels take (float32 keeps the
    definitions' path)."""
    return (enabled and device.type == "cuda" and HAVE_TRITON
            and dtype in (torch.bfloat16, torch.float16))


class Replay:
    """A forward over static inputs; with a pool, captured as a CUDA graph. Calling it replays
    the graph (or runs the forward) and returns its outputs. `guard` wraps each of the two runs
    before the capture (they execute; the capture does not): a phase that commits puts the
    committed state back after each, so that both run where the replay will (a second run at a
    length the first moved on could write past the caches) and only the replay commits."""

    def __init__(self, fn: Callable[[], Any], pool: Optional[tuple],
                 guard: Optional[Callable[[], ContextManager[Any]]] = None):
        self.fn = fn
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Any = None
        if pool is None:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels, make cuBLAS workspaces: not capturable
            for _ in range(2):
                with (guard or contextlib.nullcontext)():
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()  # no destructor of another graph may run inside this capture
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()
        finally:
            if enabled:
                gc.enable()

    def __call__(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out

    def reset(self) -> None:
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


@dataclass
class TreeBuffers:
    """A device step's tree between its build and its verify: N rows (node 0 the root, padding
    rows copies of it, as kernels.tree lays them out), and the draft's top-1 per depth (traces)."""
    ids: torch.Tensor        # [N] long
    parents: torch.Tensor    # [N] long
    depths: torch.Tensor     # [N] long
    n_nodes: torch.Tensor    # [1] int32
    ancestors: torch.Tensor  # [N, N] bool: ancestors and self (padding rows: self)
    top1: torch.Tensor       # [D] long
    cap: torch.Tensor        # [1] int32: the depth cap the build reads
    cap_host: int = -1       # what `cap` holds (a fill only when it changes)

    @classmethod
    def new(cls, rows: int, depths: int, device: torch.device) -> "TreeBuffers":
        def z(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)
        return cls(z(rows), z(rows) - 1, z(rows), z(1, dtype=torch.int32) + 1,
                   torch.eye(rows, dtype=torch.bool, device=device), z(depths), z(1, dtype=torch.int32))

    def set_cap(self, cap: int) -> None:
        if cap != self.cap_host:
            self.cap.fill_(cap)
            self.cap_host = cap


@dataclass
class VerifyGraph:
    ids: torch.Tensor
    positions: torch.Tensor
    mask: Optional[torch.Tensor]   # uint8 [N, N]; None for N == 1 (plain causal)
    eye: Optional[torch.Tensor]    # padded rows see only themselves
    tril: Optional[torch.Tensor]   # the chain's (causal) mask
    run: Replay
    tree: Optional[TreeIndex]      # a hybrid target's tree buffers (recurrent layers)
    inp: ForwardInput              # the forward's input over these buffers (a shared step's part)


class ModelRunner:
    """Runs the target forward, the draft forward and the draft's context append for one
    target/draft pair over one SequenceState, through CUDA graphs where `capture` is on."""

    def __init__(self, target: CausalLM, draft: Optional[DFlashDraft], state: SequenceState,
                 feature_layers: Sequence[int], verify_sizes: Sequence[int], block_size: int,
                 capture: bool, static: Optional[bool] = None):
        self.target, self.draft, self.state = target, draft, state
        self.feature_layers = tuple(feature_layers)
        self.block_size = block_size
        self.verify: dict[int, VerifyGraph] = {}
        self.draft_run: Optional[Replay] = None
        self.append_run: Optional[Replay] = None
        self.phases: dict[Any, Replay] = {}
        self.trees: dict[Any, TreeBuffers] = {}
        self.pool: Optional[tuple] = None
        device = state.length_dev.device
        self.device = device
        # the pending bonus token: the draft's block starts with it; a device step's commit writes it
        self.bonus = torch.zeros(1, dtype=torch.long, device=device)
        self.mask_token = draft.config.mask_token_id if draft is not None else 0
        self.static = bool(capture if static is None else static)
        if not self.static:
            return
        pool = self.pool = torch.cuda.graph_pool_handle() if capture else None
        with torch.inference_mode():
            for n in sorted(set(verify_sizes)):
                self.verify[n] = self._verify_graph(n, device, pool)
            if isinstance(draft, MTPDraft):  # its commit's rows run eagerly or inside phase B's graph
                self.draft_run = Replay(self._mtp_chain, pool)
            elif draft is not None and state.draft is not None:
                self.block = torch.full((block_size,), self.mask_token, dtype=torch.long, device=device)
                width = len(self.feature_layers) * target.config.hidden_size
                self.feats = torch.zeros(block_size, width, dtype=state.target.dtype, device=device)
                self.draft_run = Replay(self._draft_static, pool)
                append = ForwardInput(embeds=self.feats, cache=state.draft, lengths=state.length_dev)
                self.append_run = Replay(lambda: draft.write_context(append), pool)

    def _draft_static(self) -> Drafts:
        if isinstance(self.draft, MTPDraft):
            return self._mtp_chain()
        assert self.draft is not None
        return self.draft(self.block_input())[1:], None

    def _draft_block(self, block: torch.Tensor) -> Drafts:
        """The draft over `block`'s target embeddings, after the committed context rows: the
        hidden of the positions after the bonus (their logits are the caller's)."""
        assert self.draft is not None
        hidden = self.draft(self.block_input(block))
        return hidden[1:], None

    def block_input(self, block: Optional[torch.Tensor] = None) -> ForwardInput:
        """The draft's input over a DFlash block (the static one, its root the device's bonus,
        by default) after the committed context rows: a shared draft phase's part."""
        if block is None:
            block = self.block
            block[:1].copy_(self.bonus)
        return ForwardInput(embeds=self.target.embed(block), cache=self.state.draft, lengths=self.state.length_dev)

    def _mtp_chain(self) -> Drafts:
        """An MTP draft's chain of block_size - 1 steps, one row each (models/mtp.py): step k at
        position length - 1 + k, from the previous step's argmax token and output (step 0: the
        bonus and the carried target hidden). Device work only: capturable, and queued ahead."""
        state, draft = self.state, self.draft
        assert isinstance(draft, MTPDraft) and isinstance(state.draft, MTPCache)
        start = (state.length_dev - 1).clamp(min=0)  # the pending row: its token is the bonus (none before a prefill)
        token, hidden = self.bonus, state.draft.hidden
        outs, logits = [], []
        for k in range(self.block_size - 1):
            rows = torch.cat([self.target.embed(token), hidden], dim=-1)
            hidden = draft(ForwardInput(embeds=rows, cache=state.draft, lengths=start + k))
            logits.append(self.target.logits(hidden))
            outs.append(hidden)
            token = logits[-1].argmax(-1)
        return torch.cat(outs), torch.cat(logits)

    def _verify_graph(self, n: int, device: torch.device, pool: Optional[tuple]) -> VerifyGraph:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.zeros(n, dtype=torch.long, device=device)
        eye = tril = mask = None
        if n > 1:
            eye = torch.eye(n, dtype=torch.uint8, device=device)
            tril = torch.ones(n, n, dtype=torch.uint8, device=device).tril()
            mask = eye.clone()
        tree = TreeIndex.static(n, self.target.config.conv_kernel, device) if self.state.recurrent else None
        inp = self.target_input(ids, positions, mask, tree)  # static buffers: every replay reads them
        return VerifyGraph(ids, positions, mask, eye, tril, Replay(lambda: self.target(inp), pool), tree, inp)

    def target_input(self, ids: torch.Tensor, positions: torch.Tensor, block_mask: Optional[torch.Tensor],
                      tree: Optional[TreeIndex]) -> ForwardInput:
        """The target's input over the sequence's cache, after its device length."""
        state = self.state
        return ForwardInput(ids=ids, positions=positions, cache=state.target, lengths=state.length_dev,
                            block_mask=block_mask, feature_layers=self.feature_layers, tree=tree)

    def close(self) -> None:
        """Release every graph now, rather than whenever the collector gets to them."""
        for g in self.verify.values():
            g.run.reset()
        for run in (self.draft_run, self.append_run, *self.phases.values()):
            if run is not None:
                run.reset()
        self.verify.clear()
        self.phases.clear()
        self.draft_run = self.append_run = None

    # ---- a decode step's phases ----------------------------------------------------------------
    @property
    def captures(self) -> bool:
        return self.pool is not None

    def graph(self, name: Any, fn: Callable[[], Any],
              guard: Optional[Callable[[], ContextManager[Any]]] = None) -> Callable[[], Any]:
        """`fn` as a replayable phase: captured at its first call under `name` (one graph per
        name: `fn` must read only static buffers and device tensors), or `fn` itself where the
        runner does not capture. `guard`: see Replay."""
        if not self.captures:
            return fn
        run = self.phases.get(name)
        if run is None:
            with torch.inference_mode():
                run = self.phases[name] = Replay(fn, self.pool, guard)
        return run

    def tree_buffers(self, name: Any, rows: int, depths: int) -> TreeBuffers:
        """The static tree buffers of N = `rows` nodes and `depths` draft rows, one set per name
        (a decoder's mode, budget and chain seed): the phases captured over them read them at
        every replay."""
        key = (name, rows, depths)
        if key not in self.trees:
            self.trees[key] = TreeBuffers.new(rows, depths, self.device)
        return self.trees[key]

    def verify_rows(self, t: int) -> Optional[int]:
        """The static verify size that holds a forward of `t` tree rows now (None: direct calls),
        as target_forward picks it."""
        n = next((n for n in self.verify if n >= t), None)
        if n is None or not self.state.reserve(n):
            return None
        return n

    def stage_tree(self, n: int, tree: Optional[TreeIndex]) -> None:
        """A hybrid target's tree index into the size-n verify buffers, before a phase that runs
        that verify directly; filled eagerly, before the phase's replay."""
        g = self.verify[n]
        if g.tree is not None and tree is not None:
            g.tree.fill_(tree)

    # ---- the three forwards ------------------------------------------------------------------
    def target_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       block_mask: Optional[torch.Tensor], tree: Optional[TreeIndex] = None
                       ) -> Outputs:
        """The target over T new tokens after the committed rows (causal without a mask; a
        hybrid target's recurrent layers follow `tree`, else the rows in order), through the
        smallest captured size that holds them, else directly (prefill chunks)."""
        state, t = self.state, ids.shape[0]
        n = self.verify_rows(t)
        sequence = state.recurrent and tree is None  # a hybrid's prefill chunk: not a tree graph
        if n is None or sequence:
            state.check_room(t)
            return self.target(self.target_input(ids, positions, block_mask, tree))
        self.stage_tree(n, tree)
        hidden, feats = self._verify_static(n, ids, positions, block_mask, direct=False)
        return hidden[:t], (feats[:t] if feats is not None else None)

    def verify_direct(self, ids: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor) -> Outputs:
        """The verify over exactly a static size's rows, through its buffers but not its graph:
        inside a step's phase (a hybrid's index staged before it, `stage_tree`)."""
        return self._verify_static(ids.shape[0], ids, positions, block_mask, direct=True)

    def _verify_static(self, n: int, ids: torch.Tensor, positions: torch.Tensor,
                       block_mask: Optional[torch.Tensor], direct: bool) -> Outputs:
        g = self.fill_verify(n, ids, positions, block_mask)
        return g.run.fn() if direct else g.run()

    def fill_verify(self, n: int, ids: torch.Tensor, positions: torch.Tensor,
                    block_mask: Optional[torch.Tensor]) -> VerifyGraph:
        """Copy T <= n rows into the size-n verify buffers (padding rows: the eye's mask); the
        forward over them is the graph's, or its `inp` inside a shared step's phase."""
        g, t = self.verify[n], ids.shape[0]
        g.ids[:t].copy_(ids)
        g.positions[:t].copy_(positions)
        if g.mask is not None:
            if block_mask is None:
                g.mask.copy_(g.tril)
            elif t == n:
                g.mask.copy_(block_mask)
            else:
                g.mask.copy_(g.eye)
                g.mask[:t, :t].copy_(block_mask)
        return g

    def draft_forward(self, direct: bool = False) -> Drafts:
        """The draft's proposal for the block_size - 1 positions after the bonus, its rows as
        scratch: (hidden, logits), or (hidden, None) where the caller applies the head. DFlash:
        the block [bonus, MASK x (bs-1)] at positions length + [0, bs); MTP: its chain
        (_mtp_chain). The bonus is read from `bonus` on the device."""
        state = self.state
        assert self.draft is not None and state.draft is not None
        if self.draft_run is None or not state.reserve(self.block_size):
            state.check_room(self.block_size)
            if isinstance(self.draft, MTPDraft):
                return self._mtp_chain()
            block = torch.full((self.block_size,), self.mask_token, dtype=torch.long, device=self.device)
            block[:1].copy_(self.bonus)
            return self._draft_block(block)
        return self._draft_static() if direct else self.draft_run()

    def append_context(self, features: torch.Tensor, tokens: torch.Tensor, direct: bool = False) -> None:
        """The draft's context for the rows about to be committed (the caller commits): their
        target features [T, F] and tokens [T]. DFlash: K/V at rows [length, length + T) of the
        device's length; MTP: _append_mtp."""
        state = self.state
        assert self.draft is not None and state.draft is not None
        n = features.shape[0]
        if isinstance(self.draft, MTPDraft):
            self._append_mtp(features, tokens)
        elif (self.append_run is not None and not direct and n <= self.block_size
                and state.reserve(self.block_size)):
            self.feats[:n].copy_(features)
            self.append_run()
        else:
            state.check_room(n)
            self.draft.write_context(ForwardInput(embeds=features, cache=state.draft, lengths=state.length_dev))

    def _append_mtp(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """An MTP draft's rows for committed tokens t[0, T) at positions s.. with the target's
        last-layer outputs: row p pairs token p+1 with the final-normed hidden at p, so the rows
        are [s-1, s+T-1) (the first pairs t[0] with the carried hidden of s-1; none at s = 0), and
        the hidden of s+T-1 becomes the carry, adopted at the commit. Device work only (a device step's path is padded
        with its last node: its last row's hidden is the last accepted one's)."""
        state = self.state
        cache = state.draft
        assert isinstance(self.draft, MTPDraft) and isinstance(cache, MTPCache)
        hidden = self.target.model.norm(features)
        before = torch.cat([cache.hidden, hidden[:-1]])
        rows = torch.cat([self.target.embed(tokens), before], dim=-1)
        lengths = state.length_dev - 1
        if state.length == 0 and not state.unread:  # the sequence's first rows: no row before them
            rows, lengths = rows[1:], state.length_dev
        state.check_room(rows.shape[0])
        if rows.shape[0]:
            self.draft.write_context(ForwardInput(embeds=rows, cache=cache, lengths=lengths))
        cache.pending.copy_(hidden[-1:])
