"""Exceptions that carry a message meant for the user: the CLI and the server print them as-is."""

from __future__ import annotations


class FlashtreeError(Exception):
    """Base of every error flashtree raises on purpose."""


class CheckpointError(FlashtreeError):
    """A model directory, file or config that cannot be loaded or does not fit its partner."""


class ConfigError(FlashtreeError):
    """An engine or server setting outside its valid range; `param` names the request field it
    came from, where it came from one (a sampling field: the server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GrammarError(ConfigError):
    """A request's grammar that the grammar library gave up on while decoding (one of its limits,
    such as the items a parser row may hold, that no check short of decoding can foresee): the
    request's fault, which the server answers with a 400 naming the field the grammar came from."""


class ContextLengthError(FlashtreeError):
    """A prompt that leaves no room in the engine's max_ctx: at least one token must be generated,
    so a prompt may have at most max_ctx - 1 tokens. `at_least` says that counting stopped early
    (the prompt was known to be too long): it has `prompt_tokens` tokens or more."""

    def __init__(self, prompt_tokens: int, max_ctx: int, at_least: bool = False):
        self.prompt_tokens = prompt_tokens
        self.max_ctx = max_ctx
        self.at_least = at_least
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(
            f"prompt has {count} tokens, too many for a context of {max_ctx} (max_ctx): the prompt "
            f"and at least one generated token must fit, so a prompt may have at most {max_ctx - 1}; "
            "shorten the prompt or raise --max-ctx"
        )


class EngineOutOfMemory(FlashtreeError):
    """Device (or host) memory ran out at `site`; caches were cleared and the request aborted."""

    def __init__(self, site: str, detail: str = ""):
        self.site = site
        super().__init__(f"out of memory during {site}" + (f": {detail}" if detail else ""))


class KVPagesExhausted(EngineOutOfMemory):
    """No free KV page for a sequence's next rows: the running sequences hold them all. Clearing
    snapshots frees no page, so the request fails at once (a 503) and the others go on."""

    def __init__(self, detail: str):
        super().__init__("kv pages", detail)


class NonFiniteLogits(FlashtreeError):
    """A row of the target's logits that a token is drawn from holds a NaN or an infinity (or
    no finite value at all): the model's weights or activations overflowed on this input. Drawn
    anyway, its token is garbage (the argmax of a NaN row is the NaN's index, often token 0, an
    end-of-sequence id in some vocabularies), and a sampled draw is a device-side assert on
    CUDA, which ends the process's CUDA context. So the request fails instead, and its live
    sequence is emptied so that no cache keeps rows of it. `position`: the index in the
    sequence (prompt and output) of the token that could not be drawn."""

    def __init__(self, position: int):
        self.position = position
        super().__init__(
            f"the model's logits for this request were not finite (NaN or infinity) at token position {position}: "
            "its weights or activations overflowed on this input, which is not the client's fault; the request's "
            "rows were dropped from the cache")
