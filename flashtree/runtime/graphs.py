"""The model runner: every forward the decoder makes, and on CUDA the graphs that replay them.

At batch 1 a decode step is a few hundred small launches around a read of every weight; issued
one by one from Python they cost more than the read. On CUDA (bf16/fp16, Triton present) each
per-step forward is captured once and then replayed: the target over N tokens (N = 1 for AR,
N = budget + 1 for a tree, padded), the draft block, and the draft's context append. A graph
reads its token ids, positions and tree mask from static buffers and the committed length from
the sequence state's device tensor, so one graph serves every step and every context length.
Padded tree rows see only the context and themselves, and no real row sees them; their K/V land
in scratch rows past the committed length.

The runner owns every graph, and they share one memory pool. Capture runs with the garbage
collector off: a graph of an earlier runner destroyed by the collector in the middle of a
capture invalidates it. `close()` releases the graphs explicitly. Without `static` (the CPU,
float32, --no-cuda-graphs) the same methods call the models directly; `static` without
`capture` runs the static-buffer path eagerly, which lets the CPU tests check its padding, masks
and context append.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..kernels import HAVE_TRITON
from ..kernels.gated_delta import TreeIndex
from ..models.dflash import DFlashDraft
from ..models.qwen3 import CausalLM
from .sequence import SequenceState

Outputs = tuple[torch.Tensor, Optional[torch.Tensor]]


def can_capture(device: torch.device, dtype: torch.dtype, enabled: bool) -> bool:
    """Graphs apply on CUDA with Triton, in the dtypes the kernels take (float32 keeps the
    definitions' path)."""
    return (enabled and device.type == "cuda" and HAVE_TRITON
            and dtype in (torch.bfloat16, torch.float16))


class Replay:
    """A forward over static inputs; with a pool, captured as a CUDA graph. Calling it replays
    the graph (or runs the forward) and returns its outputs."""

    def __init__(self, fn: Callable[[], Any], pool: Optional[tuple]):
        self.fn = fn
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: Any = None
        if pool is None:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels, make cuBLAS workspaces: not capturable
            fn()
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
class VerifyGraph:
    ids: torch.Tensor
    positions: torch.Tensor
    mask: Optional[torch.Tensor]   # uint8 [N, N]; None for N == 1 (plain causal)
    eye: Optional[torch.Tensor]    # padded rows see only themselves
    tril: Optional[torch.Tensor]   # the chain's (causal) mask
    run: Replay
    tree: Optional[TreeIndex]      # a hybrid target's tree buffers (recurrent layers)


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
        if not (capture if static is None else static):
            return
        pool = torch.cuda.graph_pool_handle() if capture else None
        device = state.target.k.device
        with torch.inference_mode():
            for n in sorted(set(verify_sizes)):
                self.verify[n] = self._verify_graph(n, device, pool)
            if draft is not None and state.draft is not None:
                self.block = torch.zeros(block_size, dtype=torch.long, device=device)
                width = len(self.feature_layers) * target.config.hidden_size
                self.feats = torch.zeros(block_size, width, dtype=state.target.dtype, device=device)
                self.draft_run = Replay(
                    lambda: draft(target.embed(self.block), state.draft, state.length_dev), pool)
                self.append_run = Replay(
                    lambda: draft.write_context(self.feats, state.draft, state.length_dev), pool)

    def _verify_graph(self, n: int, device: torch.device, pool: Optional[tuple]) -> VerifyGraph:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.zeros(n, dtype=torch.long, device=device)
        eye = tril = mask = None
        if n > 1:
            eye = torch.eye(n, dtype=torch.uint8, device=device)
            tril = torch.ones(n, n, dtype=torch.uint8, device=device).tril()
            mask = eye.clone()
        state, feats = self.state, self.feature_layers
        tree = TreeIndex.static(n, self.target.config.conv_kernel, device) if state.recurrent else None
        extra = {"tree": tree} if tree is not None else {}
        run = Replay(lambda: self.target(ids, positions, state.target, state.length_dev,
                                         mask, mask is None, feats, **extra), pool)
        return VerifyGraph(ids, positions, mask, eye, tril, run, tree)

    def close(self) -> None:
        """Release every graph now, rather than whenever the collector gets to them."""
        for g in self.verify.values():
            g.run.reset()
        for run in (self.draft_run, self.append_run):
            if run is not None:
                run.reset()
        self.verify.clear()
        self.draft_run = self.append_run = None

    # ---- the three forwards ------------------------------------------------------------------
    def target_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       block_mask: Optional[torch.Tensor], tree: Optional[TreeIndex] = None
                       ) -> Outputs:
        """The target over T new tokens after the committed rows (causal without a mask; a
        hybrid target's recurrent layers follow `tree`, else the rows in order), through the
        smallest captured size that holds them, else directly (prefill chunks)."""
        state, t = self.state, ids.shape[0]
        n = next((n for n in self.verify if n >= t), None)
        sequence = state.recurrent and tree is None  # a hybrid's prefill chunk: not a tree graph
        if n is None or sequence or state.length + n > state.capacity:
            state.check_room(t)
            extra = {"tree": tree} if tree is not None else {}
            return self.target(ids, positions, state.target, state.length_dev, block_mask,
                               block_mask is None, self.feature_layers, **extra)
        g = self.verify[n]
        g.ids[:t].copy_(ids)
        g.positions[:t].copy_(positions)
        if g.mask is not None:
            if block_mask is None:
                g.mask.copy_(g.tril)
            else:
                g.mask.copy_(g.eye)
                g.mask[:t, :t].copy_(block_mask)
        if g.tree is not None:
            g.tree.fill_(tree)
        hidden, feats = g.run()
        return hidden[:t], (feats[:t] if feats is not None else None)

    def draft_forward(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The draft over a block at positions length + [0, bs), its rows as scratch."""
        state = self.state
        assert self.draft is not None and state.draft is not None
        if (self.draft_run is None or block_ids.shape[0] != self.block_size
                or state.length + self.block_size > state.capacity):
            state.check_room(block_ids.shape[0])
            return self.draft(self.target.embed(block_ids), state.draft, state.length_dev)
        self.block.copy_(block_ids)
        return self.draft_run()

    def append_context(self, features: torch.Tensor) -> None:
        """The draft's context K/V for the rows about to be committed (the caller commits)."""
        state = self.state
        assert self.draft is not None and state.draft is not None
        n = features.shape[0]
        if (self.append_run is not None and n <= self.block_size
                and state.length + self.block_size <= state.capacity):
            self.feats[:n].copy_(features)
            self.append_run()
        else:
            state.check_room(n)
            self.draft.write_context(features, state.draft, state.length_dev)
