"""SamplingParams: how one request wants its tokens drawn, validated before any work is done.

It sits at the bottom layer, beside config, and imports no torch: the HTTP process validates a
request's sampling fields and sends them to the worker without ever loading the engine, and the
engine (runtime/sampling.py) turns the same object into a processed distribution.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from .errors import ConfigError

GREEDY_BELOW = 1e-4
MAX_BIAS = 100.0        # OpenAI's range for logit_bias values
MAX_TOP_LOGPROBS = 20   # OpenAI's most alternatives per token (chat; completions allows 5)
# The smallest repetition_penalty: a seen token's positive logit is divided by it, and below about
# 1e-37 a float32 logit overflows to inf (then every probability is NaN). A hundredth already
# multiplies a logit by 100, far past any use.
MIN_REPETITION_PENALTY = 0.01


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # over prompt + output, as transformers/vLLM
    frequency_penalty: float = 0.0    # over output only, as OpenAI
    presence_penalty: float = 0.0     # over output only, as OpenAI
    seed: Optional[int] = None
    # token id -> added to its logit before everything else, as OpenAI's logit_bias
    logit_bias: Optional[dict[int, float]] = None
    # None: no logprobs; n: each emitted token's logprob and the n likeliest alternatives'
    logprobs: Optional[int] = None

    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise ConfigError naming the first field out of range; `vocab_size` (the engine's)
        also bounds the token ids of logit_bias."""
        checks = [
            ("temperature", 0.0 <= self.temperature <= 10.0, "[0, 10]"),
            ("top_k", self.top_k >= -1, "-1, 0 (off) or a positive integer"),
            ("top_p", 0.0 < self.top_p <= 1.0, "(0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "[0, 1]"),
            ("repetition_penalty", MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
             f"[{MIN_REPETITION_PENALTY:g}, 10]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "[-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "[-2, 2]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "[0, 2^63)"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"None or [0, {MAX_TOP_LOGPROBS}] alternatives"),
        ]
        for name, ok, valid in checks:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is out of range; valid: {valid}", name)
        for token, bias in (self.logit_bias or {}).items():
            if type(token) is not int or isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ConfigError(f"logit_bias maps token ids (int) to biases (numbers), got {token!r}: {bias!r}",
                                  "logit_bias")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ConfigError(f"logit_bias of token {token} is {bias!r}, out of range; "
                                  f"valid: [-{MAX_BIAS:g}, {MAX_BIAS:g}]", "logit_bias")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ConfigError(f"logit_bias names token id {token}, outside the vocabulary "
                                  f"[0, {vocab_size if vocab_size is not None else 'vocab size'})", "logit_bias")
        return self

    @property
    def greedy(self) -> bool:
        """Below GREEDY_BELOW the tempered distribution is argmax to float precision, and
        dividing logits by it would overflow to inf/nan: decode greedily instead."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
