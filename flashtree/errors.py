"""Exceptions that carry a message meant for the user: the CLI and the server print them as-is."""

from __future__ import annotations


class FlashtreeError(Exception):
    """Base of every error flashtree raises on purpose."""


class CheckpointError(FlashtreeError):
    """A model directory, file or config that cannot be loaded or does not fit its partner."""


class ConfigError(FlashtreeError):
    """An engine or server setting outside its valid range."""


class ContextLengthError(FlashtreeError):
    """A prompt (plus the room decoding needs) longer than the engine's max_ctx."""

    def __init__(self, prompt_tokens: int, max_ctx: int):
        self.prompt_tokens = prompt_tokens
        self.max_ctx = max_ctx
        super().__init__(
            f"prompt has {prompt_tokens} tokens but the context holds at most {max_ctx} "
            f"(max_ctx={max_ctx}); shorten the prompt or raise --max-ctx"
        )


class EngineOutOfMemory(FlashtreeError):
    """Device (or host) memory ran out at `site`; caches were cleared and the request aborted."""

    def __init__(self, site: str, detail: str = ""):
        self.site = site
        super().__init__(f"out of memory during {site}" + (f": {detail}" if detail else ""))
