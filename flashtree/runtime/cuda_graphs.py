"""Static buffers and CUDA graphs for the per-step forwards: the target over N tokens (N = 1 for
AR, N = budget + 1 for a tree, padded), the draft block, and the draft's context append.

At batch 1 a decode step is a few hundred small launches around a read of every weight; issued
one by one from Python they cost more than the read. Each forward here is captured once and then
replayed: it reads its token ids, positions and tree mask from static buffers and the committed
length from a device scalar, so one graph serves every step and every context length, and a step's
host work is a handful of small copies. Padded tree rows see only the context and themselves, and
no real row sees them; their K/V land in scratch rows past the committed length.

The runner mirrors the three model calls the decoder makes (target forward, draft forward,
draft context append), so decoding.py stays one loop. Without `capture` (CPU, tests) the same
buffers and code run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..kernels import HAVE_TRITON
from ..models.dflash import DFlashDraft
from ..models.qwen3 import CausalLM
from .fast_forward import FastDraft, FastTarget
from .kv_cache import KVCache

Outputs = tuple[torch.Tensor, Optional[torch.Tensor]]


class Captured:
    """A forward with static inputs; with `capture`, a CUDA graph of it. Calling it runs the
    forward (or replays the graph) and returns its outputs (the same tensors on every replay)."""

    def __init__(self, fn: Callable[[], object], capture: bool):
        self.fn = fn
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out: object = None
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile kernels, make cuBLAS workspaces: not capturable
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


@dataclass
class VerifyGraph:
    ids: torch.Tensor
    positions: torch.Tensor
    mask: Optional[torch.Tensor]   # uint8 [N, N]; None for N == 1 (plain causal)
    eye: Optional[torch.Tensor]    # padded rows see only themselves
    tril: Optional[torch.Tensor]   # the chain's (causal) mask
    run: Captured


class GraphRunner:
    """Owns the fused forwards, their static buffers and graphs, for one target/draft pair and
    its two KV caches (whose Python `length`s stay the source of truth)."""

    def __init__(self, target: CausalLM, draft: Optional[DFlashDraft], tcache: KVCache,
                 dcache: Optional[KVCache], feature_layers: Sequence[int],
                 verify_sizes: Sequence[int], block_size: int, capture: bool):
        device = tcache.k.device
        self.tcache, self.dcache = tcache, dcache
        self.feature_layers = tuple(feature_layers)
        self.fast_target = FastTarget(target)
        self.tlen = torch.zeros(1, dtype=torch.int32, device=device)
        self.dlen = torch.zeros(1, dtype=torch.int32, device=device)
        self.block_size = block_size
        with torch.inference_mode():
            self.tlen.fill_(tcache.length)
            self.verify = {n: self._verify_graph(n, device, capture) for n in sorted(set(verify_sizes))}
            self.fast_draft: Optional[FastDraft] = None
            if draft is not None and dcache is not None:
                self.fast_draft = FastDraft(draft, target)
                self.dlen.fill_(dcache.length)
                self.block = torch.zeros(block_size, dtype=torch.long, device=device)
                width = len(self.feature_layers) * target.config.hidden_size
                self.feats = torch.zeros(block_size, width, dtype=tcache.k.dtype, device=device)
                fd = self.fast_draft
                self.draft_run = Captured(lambda: fd.forward(self.block, dcache, self.dlen), capture)
                self.append_run = Captured(lambda: fd.write_context(self.feats, dcache, self.dlen),
                                           capture)

    def _verify_graph(self, n: int, device: torch.device, capture: bool) -> VerifyGraph:
        ids = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.zeros(n, dtype=torch.long, device=device)
        eye = tril = mask = None
        if n > 1:
            eye = torch.eye(n, dtype=torch.uint8, device=device)
            tril = torch.ones(n, n, dtype=torch.uint8, device=device).tril()
            mask = eye.clone()
        ft, feats = self.fast_target, self.feature_layers
        run = Captured(lambda: ft.forward(ids, positions, self.tcache, self.tlen, mask, mask is None,
                                          feats), capture)
        return VerifyGraph(ids, positions, mask, eye, tril, run)

    def target_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       block_mask: Optional[torch.Tensor]) -> Outputs:
        """CausalLM.forward(ids, positions, tcache, block_mask, feature_layers), through the
        smallest captured size that holds the T tokens, else eagerly (prefill chunks)."""
        t = ids.shape[0]
        self.tlen.fill_(self.tcache.length)
        n = next((n for n in self.verify if n >= t), None)
        if n is None or self.tcache.length + n > self.tcache.capacity:
            _check_room(self.tcache, t)
            return self.fast_target.forward(ids, positions, self.tcache, self.tlen, block_mask,
                                            block_mask is None, self.feature_layers)
        g = self.verify[n]
        g.ids[:t].copy_(ids)
        g.positions[:t].copy_(positions)
        if g.mask is not None:
            if block_mask is None:
                g.mask.copy_(g.tril)
            else:
                g.mask.copy_(g.eye)
                g.mask[:t, :t].copy_(block_mask)
        hidden, feats = g.run()
        return hidden[:t], (feats[:t] if feats is not None else None)

    def draft_forward(self, block_ids: torch.Tensor) -> torch.Tensor:
        """DFlashDraft.forward(embed(block_ids), dcache.length + arange(bs), dcache)."""
        assert self.fast_draft is not None and self.dcache is not None
        self.dlen.fill_(self.dcache.length)
        if (block_ids.shape[0] != self.block_size
                or self.dcache.length + self.block_size > self.dcache.capacity):
            _check_room(self.dcache, block_ids.shape[0])
            return self.fast_draft.forward(block_ids, self.dcache, self.dlen)
        self.block.copy_(block_ids)
        return self.draft_run()

    def append_context(self, features: torch.Tensor) -> None:
        """DFlashDraft.append_context for the next committed positions (rows == positions)."""
        assert self.fast_draft is not None and self.dcache is not None
        n = features.shape[0]
        self.dlen.fill_(self.dcache.length)
        if n <= self.block_size and self.dcache.length + self.block_size <= self.dcache.capacity:
            self.feats[:n].copy_(features)
            self.append_run()
        else:
            _check_room(self.dcache, n)
            self.fast_draft.write_context(features, self.dcache, self.dlen)
        self.dcache.advance(n)


def _check_room(cache: KVCache, rows: int) -> None:
    """The kernels write where they are told: refuse an overflow as KVCache.write does."""
    if cache.length + rows > cache.capacity:
        raise RuntimeError(f"KV cache overflow: {cache.length + rows} rows > capacity {cache.capacity}")


def runner_for(decoder, enabled: bool) -> Optional[GraphRunner]:
    """The CUDA-graph runner for an engine's decoder, or None where it does not apply: turned off,
    not on CUDA, no Triton, or a dtype the kernels do not take (float32 keeps the plain path)."""
    dtype = decoder.tcache.k.dtype
    if not (enabled and decoder.device.type == "cuda" and HAVE_TRITON
            and dtype in (torch.bfloat16, torch.float16)):
        return None
    sizes = {1}
    if decoder.draft is not None:
        sizes.add(decoder.budget + 1 if decoder.mode == "ddtree" else decoder.block_size)
    return GraphRunner(decoder.target, decoder.draft, decoder.tcache, decoder.dcache,
                       decoder.feature_layers, sorted(sizes), decoder.block_size, capture=True)
