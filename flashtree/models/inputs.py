"""The one argument of every model forward: what it reads besides the weights.

A forward runs T new rows after a sequence's committed cache rows. Everything that says which
rows, where they sit and what they may see travels in one `ForwardInput`, so the models, the
CUDA-graph runner and the tests build a forward's input the same way, and a field the batched
forward needs later is added here rather than to every signature. Batching sequences will add
the row-to-cache-slot mapping and each sequence's range of rows; `lengths` already holds one
entry per sequence (today one sequence: shape [1]).

Every tensor may be a static buffer: a CUDA graph captures a forward over one ForwardInput and
each replay reads whatever those buffers hold then, so nothing here is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..kernels.gated_delta import TreeIndex
from .state import HybridState, KVCache

Cache = Union[KVCache, HybridState]


@dataclass(kw_only=True)
class ForwardInput:
    """T new rows of one sequence, after its committed cache rows. Their K/V land in the cache's
    rows [length, length + T), uncommitted: the caller then commits, compacts or drops them.

    The targets embed token `ids`; the draft, which has no embedding, takes `embeds` (the
    target's embeddings of its block, or for its context append the target's features): exactly
    one of the two is given. The draft reads only the rows, cache, lengths and positions."""

    ids: Optional[torch.Tensor] = None          # [T] long token ids
    embeds: Optional[torch.Tensor] = None       # [T, D] the rows' vectors
    cache: Cache                                # KVCache, or a hybrid target's HybridState
    lengths: torch.Tensor                       # [1] int32: each sequence's committed rows
    positions: Optional[torch.Tensor] = None    # [T] long (a tree's: length + depth); None: row_positions
    block_mask: Optional[torch.Tensor] = None   # [T, T] bool/uint8 among the new rows; None: causal
    feature_layers: Sequence[int] = ()          # decoder layers whose outputs are also returned
    tree: Optional[TreeIndex] = None            # a hybrid's tree index; None: the rows are a sequence

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.embeds is None):
            raise ValueError("a forward input takes either token ids or embeddings, exactly one")

    @classmethod
    def prefill(cls, ids: torch.Tensor, cache: Cache, start: int = 0) -> "ForwardInput":
        """Token ids after `start` committed rows, a length the caller knows on the host: a prompt
        scored from an empty cache, or one chunk of it. (The engine passes its device length.)"""
        return cls(ids=ids, cache=cache, lengths=torch.tensor([start], dtype=torch.int32, device=ids.device))

    @property
    def rows(self) -> torch.Tensor:
        """The new rows as given: the ids, else the embeddings."""
        return self.ids if self.ids is not None else self.embeds  # type: ignore[return-value]

    def row_positions(self) -> torch.Tensor:
        """`positions`, or lengths + [0, T) when they are None. The default is computed in the
        forward, not at construction, so an input built once over static buffers places its rows
        at the committed length of every replay (the draft's block and context append)."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.rows.shape[0], device=self.rows.device) + self.lengths
