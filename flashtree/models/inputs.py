"""The one argument of every model forward: what it reads besides the weights.

A forward runs T new rows after a sequence's committed cache rows. Everything that says which
rows, where they sit and what they may see travels in one `ForwardInput`, so the models, the
CUDA-graph runner and the tests build a forward's input the same way, and a field a forward
needs is added here rather than to every signature. Several sequences' rows go through one
forward as a batch (`ForwardInput.batch`): their rows are concatenated, so every linear reads
its weights once for all of them, and each sequence's part (its cache, lengths, positions,
block mask and tree) says where its rows' keys, values and states live and what they see.

Every tensor may be a static buffer: a CUDA graph captures a forward over one ForwardInput and
each replay reads whatever those buffers hold then, so nothing here is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ..kernels import use_triton
from ..kernels.gated_delta import DeltaBatch, TreeIndex
from .kv_cache import KVCache
from .state import HybridState

Cache = Union[KVCache, HybridState]
# Whether a batch's parts may run their attention and recurrent scans in one launch a layer
# (attention_at_once, scans_at_once); `flashtree bench --sessions` turns it off for one pass to
# time the launches a sequence it replaces, in the same run.
AT_ONCE = True


class AtOnce(NamedTuple):
    """A batch's cache attention as one launch a layer (kernels.attention.cache_attention over
    several sequences): the parts' page tables as one [S, pages] tensor over the pool their
    caches share, their lengths [S], and their block masks [S, T, T] (None: none has one)."""
    table: torch.Tensor
    lengths: torch.Tensor
    block_mask: Optional[torch.Tensor]


class AttentionGroup(NamedTuple):
    """Rows of a forward whose K/V store and cache attention are one launch a layer: a sequence's,
    or every sequence's of a batch that attends at once (`table`: their page tables over
    `cache`'s pool; `lengths` and `block_mask` theirs, a row each). `rows`: how many of the
    forward's rows, in order (split_groups)."""
    cache: KVCache
    lengths: torch.Tensor
    block_mask: Optional[torch.Tensor]
    table: Optional[torch.Tensor]
    rows: int


def split_groups(x: torch.Tensor, groups: Sequence[AttentionGroup]) -> Sequence[torch.Tensor]:
    """x [T, ...] over a forward's rows, cut into its attention groups' rows (views)."""
    return torch.split(x, [g.rows for g in groups])


@dataclass(kw_only=True)
class ForwardInput:
    """T new rows of one sequence, after its committed cache rows. Their K/V land in the cache's
    rows [length, length + T), uncommitted: the caller then commits, compacts or drops them.

    The targets embed token `ids`; the draft, which has no embedding, takes `embeds` (the
    target's embeddings of its block, or for its context append the target's features; an MTP
    draft's rows: the next token's embedding and the hidden it follows, side by side): exactly
    one of the two is given. The draft reads only the rows, cache, lengths and positions.

    A batch (`parts`: one single-sequence input each, their rows consecutive in `ids`) has no
    cache or lengths of its own; a target's forward runs its linears over all rows and each
    layer's attention or recurrent scan per part. Feature layers are the batch's, for all."""

    ids: Optional[torch.Tensor] = None          # [T] long token ids
    embeds: Optional[torch.Tensor] = None       # [T, D] the rows' vectors
    cache: Optional[Cache] = None               # KVCache, or a hybrid target's HybridState (None: a batch)
    lengths: Optional[torch.Tensor] = None      # [1] int32: the sequence's committed rows (None: a batch)
    positions: Optional[torch.Tensor] = None    # [T] long (a tree's: length + depth); None: row_positions
    block_mask: Optional[torch.Tensor] = None   # [T, T] bool/uint8 among the new rows; None: causal
    feature_layers: Sequence[int] = ()          # decoder layers whose outputs are also returned
    tree: Optional[TreeIndex] = None            # a hybrid's tree index; None: the rows are a sequence
    parts: tuple["ForwardInput", ...] = ()      # a batch's sequences, in the order of their rows

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.embeds is None):
            raise ValueError("a forward input takes either token ids or embeddings, exactly one")
        if self.parts:
            if any(p.parts or (p.ids is None) != (self.ids is None) for p in self.parts):
                raise ValueError("a batch's parts are single sequences, all of token ids or all of embeddings")
            if (self.cache, self.lengths, self.positions, self.block_mask, self.tree) != (None,) * 5:
                raise ValueError("a batch keeps each sequence's cache, lengths, positions, mask and tree "
                                 "in its parts")
        elif self.cache is None or self.lengths is None:
            raise ValueError("a forward input of one sequence needs its cache and lengths")

    @classmethod
    def batch(cls, parts: Sequence["ForwardInput"], feature_layers: Sequence[int] = ()) -> "ForwardInput":
        """One forward over several sequences' rows (a part each, as they would run alone)."""
        if len(parts) == 1:
            return parts[0]
        if parts[0].ids is None:
            return cls(embeds=torch.cat([p.embeds for p in parts]), parts=tuple(parts),  # type: ignore[misc]
                       feature_layers=feature_layers)
        return cls(ids=torch.cat([p.ids for p in parts]), parts=tuple(parts),  # type: ignore[misc]
                   feature_layers=feature_layers)

    def sequences(self) -> tuple["ForwardInput", ...]:
        """The sequences whose rows this input holds: its parts, or itself."""
        return self.parts or (self,)

    def split(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        """x [T, ...] over this input's rows, cut into each sequence's rows (views)."""
        if not self.parts:
            return (x,)
        return torch.split(x, [p.rows.shape[0] for p in self.parts])

    def attention_groups(self, caches: Sequence[KVCache]) -> tuple[AttentionGroup, ...]:
        """The groups this forward's attention layers launch for, over `caches` (each
        sequence's KV cache, in order): one for all where the parts attend at once
        (attention_at_once), else one a sequence."""
        together = self.attention_at_once(caches)
        if together is not None:
            return (AttentionGroup(caches[0], together.lengths, together.block_mask, together.table,
                                   self.rows.shape[0]),)
        return tuple(AttentionGroup(c, p.lengths, p.block_mask, None, p.rows.shape[0])  # type: ignore[arg-type]
                     for p, c in zip(self.sequences(), caches))

    def attention_at_once(self, caches: Sequence[KVCache]) -> Optional[AtOnce]:
        """The parts' attention as one launch a layer over `caches` (each part's KV cache, in
        order), or None where they cannot share one: a single sequence, parts of different row
        counts, a block mask for some parts only, caches over different pools or with tables of
        different sizes. Built once a forward, so the stacked tables and lengths are what the
        parts hold when it runs (a graph replay's too)."""
        parts = self._alike_parts()
        if not parts:
            return None
        masks = [p.block_mask for p in parts]
        if any(m is None for m in masks) and any(m is not None for m in masks):
            return None
        first = caches[0]
        if any(c.pool is not first.pool or c.table.shape != first.table.shape for c in caches):
            return None
        return AtOnce(torch.stack([c.table for c in caches]), torch.cat([p.lengths for p in parts]),
                      None if masks[0] is None else torch.stack(masks))  # type: ignore[arg-type]

    def _alike_parts(self) -> tuple["ForwardInput", ...]:
        """The parts, where one launch a layer may serve them all (AT_ONCE on, two or more parts
        of one row count), else ()."""
        parts = self.parts
        if not AT_ONCE or len(parts) < 2 or len({p.rows.shape[0] for p in parts}) > 1:
            return ()
        return parts

    def scans_at_once(self) -> Optional[DeltaBatch]:
        """The parts' DeltaNet layers as one launch per kernel (DeltaBatch), or None where they
        cannot share one: a single sequence, a part that is not a tree (a prefill chunk), trees
        of different row counts, states of different shapes or buffers not 16-byte aligned (the
        kernels declare the alignment a launch alone knows of its arguments, so that both lay out
        and sum alike), or kernels that are not Triton's. Built once a forward, like
        attention_at_once."""
        parts = self._alike_parts()
        if not parts:
            return None
        states = [p.cache for p in parts]
        first = states[0]
        if (any(p.tree is None for p in parts) or not all(isinstance(c, HybridState) and c.aligned for c in states)
                or not all(first.batches_with(c) for c in states) or not use_triton(first.ssm)):
            return None
        return DeltaBatch.of([c.addresses for c in states], [p.tree for p in parts])  # type: ignore[union-attr,misc]

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
        if self.parts:
            return torch.cat([p.row_positions() for p in self.parts])
        if self.positions is not None:
            return self.positions
        return torch.arange(self.rows.shape[0], device=self.rows.device) + self.lengths
