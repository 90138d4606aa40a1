"""Structured output: a request's grammar as token masks over the target's logits, for every node
of a verify tree, through llguidance's matcher.

Why per node: speculative acceptance stays lossless only if the target's draw at a tree node
comes from exactly the distribution autoregressive decoding would use after that node's path. Under
a grammar that distribution is masked by the grammar state *after the path*, so each node gets its
own mask: a depth-first walk consumes a node's token into the matcher, computes the mask of what may
follow, visits the children, and rolls the token back. A node whose token its parent's mask forbids
can never be accepted (the target's draw at the parent is masked), so it is pruned with its subtree
before the verify forward: the tree holds only paths the grammar allows.

The root is the pending bonus token: already emitted, and already consumed by the matcher (the
engine advances the matcher by every emitted token). Once the grammar is complete only the
request's end tokens (its stop ids) are allowed, and a node holding an end token ends its path.

The llguidance tokenizer is built from the checkpoint's tokenizer.json (the `tokenizers` JSON,
no transformers), once per engine: it walks the whole vocabulary.
"""

from __future__ import annotations

from typing import Optional

import llguidance
import torch

from ..errors import ConfigError
from .ddtree import Tree

_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """The engine's llguidance tokenizer; makes one GrammarConstraint per request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        # n_vocab: the model's logits may be wider than the tokenizer (padded rows); those ids
        # are never allowed. The EOS given here is only llguidance's; end tokens are per request.
        self.vocab = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_ids[0] if eos_ids else None)
        self.words = (self.tokenizer.vocab_size + 31) // 32

    def constraint(self, grammar: str, end_tokens: set[int], device: torch.device) -> "GrammarConstraint":
        """A fresh matcher for `grammar` (an llguidance grammar, as the server built it); a
        grammar llguidance refuses is the request's error."""
        if not end_tokens:
            raise ConfigError("structured output needs an end-of-sequence token: "
                              "the model declares none and the request allows none")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"the grammar of this request is invalid: {matcher.get_error()}")
        return GrammarConstraint(matcher, self, sorted(end_tokens), device)


class GrammarConstraint:
    """One request's grammar state: the matcher holds every emitted token (the bonus included)."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, end_tokens: list[int],
                 device: torch.device):
        self.matcher = matcher
        self.vocab = compiler.vocab
        self.words = compiler.words
        self.end_tokens = end_tokens
        self.device = device

    def _fill(self, bits: torch.Tensor, row: int) -> None:
        """Row `row` of `bits` [N, words] int32 := what may follow the matcher's current state:
        the grammar's tokens, or only the end tokens once it may end (and none may follow)."""
        view = bits[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)
        if self.matcher.is_accepting():
            self._set_end(view)

    def _set_end(self, view: torch.Tensor, only: bool = False) -> None:
        if only:
            view.zero_()
        for tok in self.end_tokens:
            view[tok // 32] |= _bit(tok % 32)

    def _allowed(self, bits: torch.Tensor, row: int, tok: int) -> bool:
        return tok < self.vocab and bool((int(bits[row, tok // 32]) >> (tok % 32)) & 1)

    def root_mask(self) -> torch.Tensor:
        """[1, V] bool: the tokens allowed next (the draw after prefill, or an AR step)."""
        bits = torch.empty(1, self.words, dtype=torch.int32)
        self._fill(bits, 0)
        return self._unpack(bits)

    def tree_masks(self, tree: Tree) -> tuple[Tree, torch.Tensor]:
        """The tree without the nodes the grammar forbids (and their subtrees), and per kept node
        the [N, V] bool mask of the tokens allowed after its path, in the kept tree's order."""
        bits = torch.empty(tree.size, self.words, dtype=torch.int32)
        kids = [[] for _ in range(tree.size)]
        for node in range(1, tree.size):
            kids[tree.parents[node]].append(node)
        self._fill(bits, 0)
        keep = [0]
        self._visit(tree, kids, bits, 0, keep)
        keep.sort()  # insertion order again: parents before children
        renumber = {old: new for new, old in enumerate(keep)}
        pruned = Tree([tree.tokens[n] for n in keep], [renumber.get(tree.parents[n], -1) for n in keep],
                      [tree.depths[n] for n in keep])
        return pruned, self._unpack(bits[keep])

    def _visit(self, tree: Tree, kids: list[list[int]], bits: torch.Tensor, node: int, keep: list[int]) -> None:
        """Depth first below `node`, whose row of `bits` holds its mask and whose path the
        matcher has consumed: keep, mask and visit every child the mask allows."""
        for child in kids[node]:
            tok = tree.tokens[child]
            if not self._allowed(bits, node, tok):
                continue
            keep.append(child)
            if tok in self.end_tokens:  # the path ends here; what the target draws after is cut
                self._set_end(bits[child], only=True)
                continue
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"grammar matcher refused token {tok} its own mask allowed: "
                                   f"{self.matcher.get_error()}")
            self._fill(bits, child)
            self._visit(tree, kids, bits, child, keep)
            self.matcher.rollback(1)

    def _unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """[N, words] int32 bitmask -> [N, V] bool on the device (the unpacking runs there)."""
        bits = bits.to(self.device, non_blocking=True)
        flags = (bits.unsqueeze(-1) >> _SHIFTS.to(self.device)) & 1
        return flags.view(bits.shape[0], -1)[:, :self.vocab].bool()

    def advance(self, tokens: list[int]) -> None:
        """Consume emitted tokens (never an end token: the engine stops before consuming one)."""
        for tok in tokens:
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"grammar matcher refused emitted token {tok}: {self.matcher.get_error()}")


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int in the int32 range (bit 31 is negative)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def apply_mask(logits: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits with every token outside `allowed` at -inf (unchanged without a mask)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))
