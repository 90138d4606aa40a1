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

Every draw comes with whether its row was finite (`Draws`): a row holding a NaN or an infinity,
or nothing but -inf, is no distribution, and the step that would emit a token drawn from it
fails the request instead (errors.NonFiniteLogits). The flags are computed beside the draws on
the device, so reading them costs no read of their own.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from ..sampling_params import SamplingParams

__all__ = ["Draws", "Sampler", "SamplingParams", "TokenLogprob", "argmax_draws", "finite_rows"]

# one emitted token's logprob and its top alternatives [(token id, logprob), ...], likeliest first
TokenLogprob = tuple[float, list[tuple[int, float]]]


class Draws(NamedTuple):
    """One token drawn per row of a logits tensor [N, V] (`tokens` [N] long), and whether the
    row was finite (`finite` [N] bool, finite_rows'): a token drawn from a row that was not is
    meaningless, and a step must not emit it."""
    tokens: torch.Tensor
    finite: torch.Tensor

    def read(self) -> tuple[list[int], list[bool]]:
        """The tokens and the flags on the host, in one transfer (a host step's one read)."""
        values = torch.cat([self.tokens, self.finite.long()]).tolist()
        n = self.tokens.numel()
        return values[:n], [bool(v) for v in values[n:]]


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Which rows of logits [N, V] a token can be drawn from: their largest value is finite.
    amax propagates a NaN and keeps a +inf, and a row of nothing but -inf (no drawable token)
    has -inf for its largest: each of those is not finite. One reduction over the rows, on
    their device, with nothing read."""
    return torch.isfinite(logits.amax(-1))


def argmax_draws(logits: torch.Tensor) -> Draws:
    """Plain greedy draws (each row's argmax) of logits [N, V] and their rows' flags."""
    return Draws(logits.argmax(-1), finite_rows(logits))


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

    @property
    def plain_greedy(self) -> bool:
        """Draws that are the argmax of the raw logits (no bias, no penalties) and no logprobs:
        what a captured verify phase computes itself (device_step.DeviceSteps.greedy_phase)."""
        p = self.p
        return p.greedy and self.bias is None and not p.has_penalties and p.logprobs is None

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

    def draw(self, adjusted: torch.Tensor) -> Draws:
        """One token per row of adjust()'s logits, argmax or a draw from probs(), and which rows
        were finite: for a draw, the rows of probs(), which are NaN wherever the logits were not
        finite and also where finite ones tempered past float32's range (1e35 at a temperature
        of 1e-4). Such a row is drawn from uniformly instead: torch.multinomial refuses a NaN, on
        CUDA with a device-side assert that ends the process's CUDA context, and the caller
        fails the request on that row anyway (where the walk reaches it: a tree's row off the
        accepted path emits nothing)."""
        if self.p.greedy:
            return argmax_draws(adjusted)
        probs = self.probs(adjusted)
        finite = finite_rows(probs)
        drawable = probs.masked_fill(~finite[:, None], 1.0)
        return Draws(torch.multinomial(drawable, 1, generator=self.generator).squeeze(1), finite)

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
