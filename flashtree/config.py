"""Every knob of the engine and the server in one place, with its default and its help text.

The CLI builds its flags from these dataclasses' field metadata, so a flag can never be parsed and
then ignored: each one lands in a field that the engine or server reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from .errors import ConfigError

DECODE_MODES = ("ar", "chain", "ddtree")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    """How the engine loads its models and decodes."""

    target: Optional[str] = _opt(None, "target model: local directory or HF cache repo id (default: embedded model)")
    draft: Optional[str] = _opt(None, "DFlash draft: local directory or HF cache repo id (default: embedded draft)")
    device: Optional[str] = _opt(None, "torch device (default: cuda if available, else cpu)")
    dtype: Optional[str] = _opt(None, "weight/activation dtype: float32, bfloat16, float16 (default: config's on GPU, float32 on CPU)")
    max_ctx: int = _opt(4096, "maximum tokens of one sequence (prompt + completion)")
    mode: str = _opt("ddtree", "decoder: ar | chain | ddtree", choices=DECODE_MODES)
    budget: int = _opt(22, "DDTree node budget (tree size excluding the root)")
    block_size: Optional[int] = _opt(None, "draft block size (default: the draft's own)", type=int)
    chain_seed: bool = _opt(True, "insert the draft's top-1 chain into the tree first")
    prefill_ubatch: int = _opt(512, "prompt tokens per prefill forward")

    def validate(self) -> None:
        if self.mode not in DECODE_MODES:
            raise ConfigError(f"mode must be one of {', '.join(DECODE_MODES)}, got {self.mode!r}")
        if self.max_ctx < 16:
            raise ConfigError(f"max_ctx must be >= 16, got {self.max_ctx}")
        if not 1 <= self.budget <= 512:
            raise ConfigError(f"budget must be in [1, 512], got {self.budget}")
        if self.block_size is not None and not 2 <= self.block_size <= 64:
            raise ConfigError(f"block_size must be in [2, 64], got {self.block_size}")
        if self.prefill_ubatch < 1:
            raise ConfigError(f"prefill_ubatch must be >= 1, got {self.prefill_ubatch}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def add_dataclass_flags(parser: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag-name` per dataclass field, typed from its default, help from its metadata."""
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if isinstance(f.default, bool):
            # a True default is turned off by `--no-NAME`, a False one turned on by `--NAME`
            off = f.default
            name = ("--no-" if off else "--") + f.name.replace("_", "-")
            parser.add_argument(name, dest=f.name, default=f.default,
                                action="store_false" if off else "store_true", help=help_text)
            continue
        kind = int if isinstance(f.default, int) else (float if isinstance(f.default, float) else str)
        if f.default is None:
            kind = f.metadata.get("type", str)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "type": kind, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)


def dataclass_from_args(cls: type, args: Any) -> Any:
    """Build `cls` from an argparse namespace holding (some of) its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
