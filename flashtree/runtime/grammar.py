"""Structured output: a request's grammar as token masks over the target's logits, for every node
of a verify tree, through llguidance's matcher.

Why per node: speculative acceptance stays lossless only if the target's draw at a tree node
comes from exactly the distribution autoregressive decoding would use after that node's path. Under
a grammar that distribution is masked by the grammar state *after the path*, so each node gets its
own mask: a copy of the matcher stands after each node's path (the copy of its parent's, fed
the node's token) and computes the mask of what may follow it. Copies, never rollback: llguidance
(1.9.1) rolls back a token consumed after a mask was computed to a state whose later masks are
wrong (after `"humidity":`, ` ["` consumed and rolled back, ` {"` then allowed `":`), which made
ddtree output differ from AR output and fail at a token its own mask allowed. A node whose token its parent's mask forbids
can never be accepted (the target's draw at the parent is masked), so it is pruned with its subtree
before the verify forward: the tree holds only paths the grammar allows. A ddtree build asks the
grammar first (`admits`), so that its budget goes to nodes that can be accepted: the draft proposes
free text, and pruning its tree afterwards would leave a few nodes of 22.

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

from ..checkpoint import Tokenizer
from ..errors import ConfigError, GrammarError
from .ddtree import Tree

_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """The engine's llguidance tokenizer; makes one GrammarConstraint per request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        # The model's logits may be wider than the tokenizer (padded rows: never allowed) or
        # narrower (masks are cut to the logits). llguidance's EOS is the model's first: the
        # engine makes every EOS id an end token of a constrained request, so none is ever
        # consumed (which would stop llguidance's matcher); the end tokens are added to a mask
        # wherever the grammar may end.
        self.vocab = vocab_size
        eos = tokenizer.eos_token_ids
        self.tokenizer = llguidance.LLTokenizer(tokenizer.raw.to_str(), n_vocab=max(vocab_size, tokenizer.vocab_size),
                                                eos_token=eos[0] if eos else None)
        self.words = (self.tokenizer.vocab_size + 31) // 32

    def constraint(self, grammar: str, end_tokens: set[int], device: torch.device) -> "GrammarConstraint":
        """A fresh matcher for `grammar` (an llguidance grammar, as the server built it); a
        grammar llguidance refuses is the request's error."""
        if not end_tokens:
            raise ConfigError("structured output needs an end-of-sequence token: "
                              "the model declares none and the request allows none")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar of this request is invalid: {matcher.get_error()}")
        return GrammarConstraint(matcher, self, sorted(end_tokens), device)


class GrammarConstraint:
    """One request's grammar state. `matcher` holds every emitted token (the bonus included);
    within a step, a copy of it stands after each tree path asked about (`_at`, the root's being
    `matcher` itself), and the masks of those paths are kept until the next emitted tokens, so
    the tree build (`admits`) and the verify masks (`tree_masks`) compute each once."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, end_tokens: list[int],
                 device: torch.device):
        self.matcher = matcher
        self.vocab = compiler.vocab
        self.words = compiler.words
        self.end_tokens = frozenset(end_tokens)
        self.device = device
        self._at: dict[tuple[int, ...], llguidance.LLMatcher] = {(): matcher}  # path -> a matcher after it
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # path after the root -> bits [words]

    def _matcher_at(self, path: tuple[int, ...]) -> llguidance.LLMatcher:
        """A matcher after `path`: a copy of the one after its parent path, fed its last token
        (which the parent's mask allowed)."""
        matcher = self._at.get(path)
        if matcher is None:
            matcher = self._matcher_at(path[:-1]).deep_copy()
            if not matcher.consume_token(path[-1]):
                self._fail(matcher, f"token {path[-1]}, which its own mask allowed, was refused")
            self._at[path] = matcher
        return matcher

    def _fail(self, matcher: llguidance.LLMatcher, what: str) -> None:
        """A matcher in its error state (a limit of llguidance's hit by this grammar) fails the
        request; anything else is a bug."""
        if matcher.is_error():
            raise GrammarError(f"structured output failed: {matcher.get_error().splitlines()[0]}")
        raise RuntimeError(f"grammar matcher: {what}")

    def _mask(self, path: tuple[int, ...]) -> torch.Tensor:
        """The bits [words] of what may follow `path`: the grammar's tokens, plus the end tokens
        once it may end; after an end token only end tokens (the path is over: what the target
        draws there is cut, but its row must still be a distribution)."""
        bits = self._masks.get(path)
        if bits is None:
            bits = torch.zeros(self.words, dtype=torch.int32)
            ended = bool(path) and path[-1] in self.end_tokens
            matcher = None if ended else self._matcher_at(path)
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(bits.data_ptr(), self.words * 4)
                if matcher.is_error():
                    self._fail(matcher, "mask failed")
            if matcher is None or matcher.is_accepting():
                for tok in self.end_tokens:
                    bits[tok // 32] |= _bit(tok % 32)
            if not bits.any():  # a distribution needs a token: never draw from all -inf
                self._fail(self.matcher if matcher is None else matcher, f"no token may follow {list(path)}")
            self._masks[path] = bits
        return bits

    def _allows(self, path: tuple[int, ...], tok: int) -> bool:
        if path and path[-1] in self.end_tokens:
            return False  # nothing follows an end token
        return tok < self.vocab and bool((int(self._mask(path)[tok // 32]) >> (tok % 32)) & 1)

    def admits(self, tree: Tree, parent: int, tok: int) -> bool:
        """ddtree.build_tree's `admit`: may `tok` follow the path of `parent` in `tree`."""
        return self._allows(_path_of(tree, parent), tok)

    def root_mask(self) -> torch.Tensor:
        """[1, V] bool: the tokens allowed next (the draw after prefill, or an AR step)."""
        return self._unpack(self._mask(()).unsqueeze(0))

    def tree_masks(self, tree: Tree) -> tuple[Tree, torch.Tensor]:
        """The tree without the nodes the grammar forbids (and their subtrees), and per kept node
        the [N, V] bool mask of the tokens allowed after its path, in the kept tree's order."""
        paths: list[Optional[tuple[int, ...]]] = [()]
        for node in range(1, tree.size):  # parents come first
            above = paths[tree.parents[node]]
            tok = tree.tokens[node]
            paths.append(above + (tok,) if above is not None and self._allows(above, tok) else None)
        keep = [node for node, path in enumerate(paths) if path is not None]
        rows = torch.stack([self._mask(paths[node]) for node in keep])
        renumber = {old: new for new, old in enumerate(keep)}
        pruned = Tree([tree.tokens[n] for n in keep], [renumber.get(tree.parents[n], -1) for n in keep],
                      [tree.depths[n] for n in keep])
        return pruned, self._unpack(rows)

    def _unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """[N, words] int32 bitmask -> [N, V] bool on the device (the unpacking runs there)."""
        bits = bits.to(self.device, non_blocking=True)
        flags = (bits.unsqueeze(-1) >> _SHIFTS.to(self.device)) & 1
        return flags.view(bits.shape[0], -1)[:, :self.vocab].bool()

    def advance(self, tokens: list[int]) -> None:
        """Consume emitted tokens (never an end token: the engine stops before consuming one)."""
        self._at = {(): self.matcher}
        self._masks.clear()
        for tok in tokens:
            if not self.matcher.consume_token(tok):
                self._fail(self.matcher, f"emitted token {tok} was refused")


def _path_of(tree: Tree, node: int) -> tuple[int, ...]:
    """The tokens from below the root down to `node`."""
    path: list[int] = []
    while node > 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(path))


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int in the int32 range (bit 31 is negative)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def apply_mask(logits: torch.Tensor, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits with every token outside `allowed` at -inf (unchanged without a mask)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))
