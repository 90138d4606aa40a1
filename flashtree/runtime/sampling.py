"""The target's processed distribution for a request's SamplingParams (defined torch-free in
flashtree.sampling_params, re-exported here).

Speculative acceptance is lossless only if every emitted token is drawn from exactly the
distribution plain autoregressive decoding would use. So the processing here is a function of
(logits, history) alone, and a tree node's history is the committed history plus the node's own
ancestors: penalties stay exact inside a tree. logit_bias is part of that function too, so it
applies at every tree node exactly as it would in autoregressive decoding.

Logprobs (when a request asks for them) are read from the same processed logits, after the bias
and the penalties and before temperature and truncation: the target's own judgement of each
emitted token, whatever sampler drew it.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams", "TokenLogprob"]

# one emitted token's logprob and its top alternatives [(token id, logprob), ...], likeliest first
TokenLogprob = tuple[float, list[tuple[int, float]]]


class Sampler:
    """Per-request sampling state: the seeded generator and the token history counts."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device,
                 prompt_ids: list[int]):
        self.p = params
        self.vocab = vocab_size
        self.device = device
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.output_counts = torch.zeros(vocab_size, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if params.has_penalties and prompt_ids:
            self.seen[torch.tensor(prompt_ids, device=device)] = True
        self.bias: Optional[torch.Tensor] = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            self.bias[ids] = torch.tensor(list(params.logit_bias.values()), device=device)

    def observe(self, tokens: list[int]) -> None:
        """Record emitted tokens (they become history for later draws)."""
        if self.p.has_penalties and tokens:
            t = torch.tensor(tokens, device=self.device)
            self.output_counts.index_add_(0, t, torch.ones(len(tokens), device=self.device))
            self.seen[t] = True

    def adjust(self, logits: torch.Tensor, node_tokens: Optional[torch.Tensor] = None,
               ancestors: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits [N, V] in float32 with logit_bias and the penalties applied.

        Row i continues a path whose not-yet-emitted tokens are node_tokens[j] for the j with
        ancestors[i, j] (ancestors-and-self, excluding row 0, the already-emitted root)."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.p.has_penalties:
            counts = self.output_counts.expand(logits.shape[0], -1)
            if node_tokens is not None and ancestors is not None and logits.shape[0] > 1:
                path = ancestors.float().clone()
                path[:, 0] = 0.0
                onehot = torch.nn.functional.one_hot(node_tokens, self.vocab).float()
                counts = counts + path @ onehot
            logits = self._penalize(logits, counts)
        return logits

    def pick(self, adjusted: torch.Tensor) -> torch.Tensor:
        """One token per row of adjust()'s logits: argmax, or a draw from probs()."""
        if self.p.greedy:
            return adjusted.argmax(dim=-1)
        return torch.multinomial(self.probs(adjusted), 1, generator=self.generator).squeeze(1)

    def token_logprobs(self, adjusted: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """Row i of adjust()'s logits is the distribution `tokens[i]` was drawn from: its logprob
        there and the `logprobs` likeliest alternatives, as plain numbers (one transfer).

        A token the row cannot draw (a grammar masks it to -inf) is no alternative: it is left
        out, so a row with fewer drawable tokens than asked for has fewer alternatives, and no
        logprob is ever infinite (JSON has no spelling for it). The drawn token's own logprob is
        finite, as it was drawn."""
        logp = torch.log_softmax(adjusted, dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1)
        top_n = self.p.logprobs or 0
        if top_n:
            values, ids = logp.topk(top_n, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        else:
            top_values, top_ids = [[]] * len(tokens), [[]] * len(tokens)
        return [(lp, [(t, v) for t, v in zip(i, vs) if math.isfinite(v)])
                for lp, i, vs in zip(chosen.tolist(), top_ids, top_values)]

    def _penalize(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = self.p
        if p.repetition_penalty != 1.0:
            seen = self.seen.unsqueeze(0) | (counts > 0)
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        if p.frequency_penalty or p.presence_penalty:
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """temperature -> top-k -> top-p -> min-p, then softmax (rows sum to 1)."""
        p = self.p
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
            drop_sorted = before >= p.top_p
            drop_sorted[..., 0] = False  # the likeliest token always stays: a top_p that rounds to 0
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # in float32 kept none
            logits = logits.masked_fill(drop, float("-inf"))
        if p.min_p > 0.0:
            probs = logits.softmax(-1)
            floor = p.min_p * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits.softmax(-1)
