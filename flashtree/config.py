"""Every knob of the engine and the server in one place, with its default and its help text.

The CLI builds its flags from these dataclasses' field metadata, so a flag can never be parsed and
then ignored: each one lands in a field that the engine or server reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError

# The largest draft block served (--block-size, or a draft config's block_size): DFlash drafts
# use 8 or 16; a block of thousands has every step verify more rows than a context holds
MAX_BLOCK_SIZE = 64

DECODE_MODES = ("ar", "chain", "ddtree")
MTP_DRAFT = "mtp"                                     # --draft mtp: the target's MTP layer (models/mtp.py)
QUANT_TYPES = ("int8", "int4")                       # weight-only, group-wise (models/quant.py)
KV_TYPES = ("auto", "bf16", "fp8", "q8_0", "q4_0")  # auto = the model's dtype
DFLASH2_TREES = ("topk", "selector")                  # --dflash2-tree: what a DFlash2 draft's ddtree is built from
MAX_SEQUENCES = 64       # the most live sequences --max-sequences may ask for
AUTO_SEQUENCES = 8       # the most the memory plan chooses by itself


def _opt(default: Any, help: str, **extra: Any) -> Any:
    """A field with its help text; a bool that defaults to True also needs `off_help`, what its
    `--no-NAME` flag does."""
    return field(default=default, metadata={"help": help, **extra})


def parse_bytes(text: str) -> int:
    """'512M', '2G', '1.5GiB' or a plain byte count."""
    units = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 2G)") from None
    if value < 0:
        raise ValueError(f"size must be >= 0, got {text!r}")
    return int(value * units[unit])


@dataclass
class EngineConfig:
    """How the engine loads its models and decodes."""

    target: Optional[str] = _opt(None, "target model: local directory, .gguf file or HF repo id, downloaded "
                                 "into the HF cache unless --offline (default: embedded model)")
    draft: Optional[str] = _opt(None, "DFlash draft: local directory, .gguf file or HF repo id, or 'mtp': the "
                                "target's own multi-token-prediction layer (Qwen3.5/3.6 safetensors "
                                "checkpoints that ship mtp.* weights) (default: embedded draft)")
    offline: bool = _opt(False, "resolve HF repo ids from the local HF cache only, never download "
                                "(HF_HUB_OFFLINE=1 does the same)")
    device: Optional[str] = _opt(None, "torch device (default: cuda if available, else cpu)")
    dtype: Optional[str] = _opt(None, "weight/activation dtype: float32, bfloat16, float16 (default: config's on GPU, float32 on CPU)")
    max_ctx: int = _opt(4096, "maximum tokens of one sequence (prompt + completion)")
    mode: str = _opt("ddtree", "decoder: ar | chain | ddtree", choices=DECODE_MODES)
    budget: int = _opt(22, "DDTree node budget (tree size excluding the root)")
    block_size: Optional[int] = _opt(None, "draft block size (default: the draft's own)", type=int)
    chain_seed: bool = _opt(True, "insert the draft's top-1 chain into the tree first",
                            off_help="do not insert the draft's top-1 chain into the tree first: "
                                     "build the tree best-first alone")
    dflash2_tree: str = _opt("topk", "what --mode ddtree builds a DFlash2 draft's tree from: topk (each position's "
                             "top --budget log-probs of the draft's logits) | selector (each position's "
                             "selector_top_k candidates, ranked by the candidate selector's scores given its "
                             "greedy path, weighed by a log-softmax over those scores); topk until the selector's "
                             "trees are measured to accept more; selector needs a DFlash2 draft and --mode ddtree",
                             choices=DFLASH2_TREES)
    prefill_ubatch: Optional[int] = _opt(None, "prompt tokens per prefill forward (default: on a GPU the larger of "
                                         "2048 and 1024 whose memory plan leaves the prefix cache's device tier "
                                         "all it wants, after the live sequences, else 512; 512 on the CPU)",
                                         type=int)
    max_sequences: Optional[int] = _opt(None, "sequences kept live at once, each with its own page tables over the "
                                        "shared KV pages (--kv-pool-tokens) and its own recurrent states: "
                                        "requests run side by side and one session's request does not evict "
                                        "another's (default: as many as fit beside the prefix cache's device "
                                        "tier, at most 8)", type=int)
    kv_pool_tokens: Optional[int] = _opt(None, "KV rows the live sequences share, in pages of 64 rows (default: "
                                         "--max-sequences x --max-ctx, so that every sequence can reach "
                                         "--max-ctx at once); fewer let more sequences share a card: a "
                                         "sequence that needs a page when none is free takes an idle "
                                         "sequence's or preempts a running one (saved, resumed later); "
                                         "a request fails as out of memory only when no other runs",
                                         type=int)
    cuda_graphs: bool = _opt(True, "on CUDA in bf16/fp16: fused kernels and CUDA graphs for the decode steps",
                             off_help="do not use fused kernels and CUDA graphs for the decode steps "
                                      "(otherwise used on CUDA in bf16/fp16)")
    deterministic: bool = _opt(False, "greedy output bit-identical on the GPU whatever the prefix cache held, the "
                               "prefill chunk sizes, the decode mode and the batch: every kernel of the target "
                               "reduces in one order whatever the rows it is given (slower; dense targets, "
                               "CUDA, bfloat16/float16)")
    prefill_ubatch_floor: int = _opt(16, "smallest ubatch an out-of-memory prefill retry may halve down to")
    prefix_cache_slots: int = _opt(4, "snapshots kept in device memory at most")
    prefix_cache_bytes: int = _opt(2 * 1024 ** 3, "device memory for snapshots' copies of recurrent states, at "
                                   "most (e.g. 2G; their KV rows stay in the pool's pages)", type=parse_bytes)
    host_cache_bytes: int = _opt(8 * 1024 ** 3, "host memory for snapshots evicted from the device (0 = none)",
                                 type=parse_bytes)
    cache_dir: Optional[str] = _opt(None, "directory for snapshots evicted from host memory; survives restarts")
    disk_cache_bytes: int = _opt(32 * 1024 ** 3, "disk space for snapshots in --cache-dir; the least recently "
                                 "used files are deleted beyond it", type=parse_bytes)
    state_checkpoint_interval: int = _opt(2048, "hybrid targets: keep a copy of the recurrent states every this "
                                          "many prompt tokens (and at each prompt's end), where a later "
                                          "request can resume")
    state_checkpoints: int = _opt(8, "hybrid targets: recurrent-state copies kept for the live sequence at most")
    cache_min_tokens: int = _opt(64, "snapshot the live state only when a request would make it lose at "
                                       "least this many tokens")
    cache_min_fraction: float = _opt(1 / 32, "and only when those are at least this fraction of its length: a "
                                     "snapshot copies every row, so keeping a few tokens of a long state costs "
                                     "more than prefilling them again (0 = no such floor)")
    quantize: Optional[str] = _opt(None, "quantize the target's linear weights at load, weight-only and group-wise: "
                                   "int8 | int4, and its embedding table and lm_head to int8 (default: none; "
                                   "a GGUF target keeps its file's types, and with this flag its layers' "
                                   "weights stored with more bits, such as Q4_K_M's Q5_K and Q6_K, are rounded "
                                   "to it in groups of 32)",
                                   choices=QUANT_TYPES)
    quantize_draft: Optional[str] = _opt(None, "quantize the DFlash draft's linear weights at load, weight-only and "
                                         "group-wise: int8 | int4 (default: none; it borrows the target's "
                                         "embedding and lm_head, which --quantize covers)", choices=QUANT_TYPES)
    kv_type: str = _opt("auto", "KV cache type of K and V: auto (the model's dtype) | bf16 | fp8 | q8_0 | q4_0",
                        choices=KV_TYPES)
    v_type: Optional[str] = _opt(None, "KV cache type of V alone (default: --kv-type)", choices=KV_TYPES)
    draft_kv_type: str = _opt("auto", "KV cache type of the DFlash draft's K and V (its projections of the "
                              "target's features): auto (the model's dtype) | bf16 | fp8 | q8_0 | q4_0; at "
                              "128K a 27B's 5-layer draft's bf16 cache is 2.5 GiB, q8_0 1.3, q4_0 0.7",
                              choices=KV_TYPES)
    gpu_memory: Optional[int] = _opt(None, "size everything, the memory plan included, as if the device had this "
                                     "much memory, and cap the process to it, e.g. 24G; on the CPU the plan is "
                                     "checked against it (or the host's available memory if less) and nothing is "
                                     "capped (default: the whole device)", type=parse_bytes)
    threads: Optional[int] = _opt(None, "CPU threads for torch's operators, 0 = torch's own choice (default: "
                                  "OMP_NUM_THREADS if set, else half the cores, at most 8, on the CPU; torch's "
                                  "own choice on CUDA)", type=int)

    def validate(self) -> None:
        if self.mode not in DECODE_MODES:
            raise ConfigError(f"mode must be one of {', '.join(DECODE_MODES)}, got {self.mode!r}")
        if self.dflash2_tree not in DFLASH2_TREES:
            raise ConfigError(f"dflash2_tree must be one of {', '.join(DFLASH2_TREES)}, got {self.dflash2_tree!r}")
        if self.max_ctx < 16:
            raise ConfigError(f"max_ctx must be >= 16, got {self.max_ctx}")
        if not 1 <= self.budget <= 512:
            raise ConfigError(f"budget must be in [1, 512], got {self.budget}")
        if self.block_size is not None and not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be in [2, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.prefill_ubatch is not None and self.prefill_ubatch < 1:
            raise ConfigError(f"prefill_ubatch must be >= 1, got {self.prefill_ubatch}")
        if self.max_sequences is not None and not 1 <= self.max_sequences <= MAX_SEQUENCES:
            raise ConfigError(f"max_sequences must be in [1, {MAX_SEQUENCES}], got {self.max_sequences}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.max_ctx:
            raise ConfigError(f"kv_pool_tokens must be at least max_ctx ({self.max_ctx}), got {self.kv_pool_tokens}")
        if self.state_checkpoint_interval < 1 or self.state_checkpoints < 1:
            raise ConfigError("state_checkpoint_interval and state_checkpoints must be >= 1")
        if self.prefix_cache_slots < 0 or self.cache_min_tokens < 1 or self.prefill_ubatch_floor < 1:
            raise ConfigError("prefix_cache_slots must be >= 0, cache_min_tokens and prefill_ubatch_floor >= 1")
        if not 0 <= self.cache_min_fraction <= 1:
            raise ConfigError(f"cache_min_fraction must be in [0, 1], got {self.cache_min_fraction}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("quantize", "quantize_draft"):
            value = getattr(self, name)
            if value is not None and value not in QUANT_TYPES:
                raise ConfigError(f"{name} must be one of {', '.join(QUANT_TYPES)}, got {value!r}")
        for name in ("kv_type", "v_type", "draft_kv_type"):
            value = getattr(self, name)
            if value is not None and value not in KV_TYPES:
                raise ConfigError(f"{name} must be one of {', '.join(KV_TYPES)}, got {value!r}")
        if self.gpu_memory is not None and self.gpu_memory < 256 * 1024 ** 2:
            raise ConfigError(f"gpu_memory must be at least 256M, got {self.gpu_memory} bytes")
        if self.threads is not None and self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.cache_dir is not None:
            _check_can_be_dir(Path(self.cache_dir))


def _check_can_be_dir(path: Path) -> None:
    """A directory that exists or can be made: no file at the path or at any of its parents (the
    mkdir that fails later would read as a model that cannot load)."""
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                raise ConfigError(f"--cache-dir {path}: {at} is a file, not a directory")
            return


def add_dataclass_flags(parser: Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag-name` per dataclass field, typed from its default, help from its metadata."""
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            # a True default is turned off by `--no-NAME`, a False one turned on by `--NAME`;
            # either way the flag's presence is the non-default, so its help states no default
            if f.default:
                parser.add_argument("--no-" + flag[2:], dest=f.name, default=True, action="store_false",
                                    help=f.metadata["off_help"])
            else:
                parser.add_argument(flag, dest=f.name, default=False, action="store_true",
                                    help=f.metadata["help"])
            continue
        help_text = f.metadata["help"]
        if "(default:" not in help_text:  # some say in words what a None default means
            help_text += " (default: %(default)s)"
        kind = int if isinstance(f.default, int) else (float if isinstance(f.default, float) else str)
        kind = f.metadata.get("type", kind)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "type": kind, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)


def dataclass_from_args(cls: type, args: Any) -> Any:
    """Build `cls` from an argparse namespace holding (some of) its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


TOOL_PARSERS = ("auto", "hermes", "qwen3_coder")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ServerConfig:
    """How `flashtree serve` listens and admits requests (the engine's knobs are EngineConfig)."""

    host: str = _opt("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network")
    port: int = _opt(8000, "TCP port to listen on (0 picks a free one)")
    api_key: Optional[str] = _opt(None, "require `Authorization: Bearer KEY` on every route but /health")
    model_alias: Optional[str] = _opt(None, "model id reported by /v1/models and in responses (default: the model's name)")
    max_queue: int = _opt(16, "requests that may wait for the engine; more get 429 with Retry-After")
    cors_origin: Optional[str] = _opt(None, "comma-separated origins allowed by CORS, or * (default: no CORS)")
    max_body_mb: float = _opt(32.0, "largest accepted request body in MiB; larger ones get 413")
    default_max_tokens: Optional[int] = _opt(
        None, "completion tokens for a request that sets no limit (default: all the context leaves); a guard "
              "against one runaway answer holding the single engine", type=int)
    tool_parser: str = _opt("auto", "tool-call format: auto (from the chat template), hermes, qwen3_coder",
                            choices=TOOL_PARSERS)
    log_level: str = _opt("info", "server log level", choices=LOG_LEVELS)
    worker_timeout: float = _opt(60.0, "seconds the engine worker may stay silent (no heartbeat, sent after "
                                       "every prefill chunk and decode step, and to the server's pings when "
                                       "idle) before it is killed and restarted")
    header_timeout: float = _opt(30.0, "seconds a connection has to send a request's headers, from when it "
                                       "opens or its previous response ended; then it is closed (408)")
    body_timeout: float = _opt(60.0, "seconds a request body may pause between two reads; then 408")
    chat_template_timeout: float = _opt(
        10.0, "seconds the chat template may take to render one conversation, and a structured-output "
              "grammar to be checked; past that the request gets 400, and a template that takes longer on "
              "a one-message conversation is refused at start-up")
    keep_alive_timeout: float = _opt(5.0, "seconds an idle keep-alive connection is kept open")
    parse_special_in_content: bool = _opt(
        False, "encode special-token text inside messages (`<|im_end|>`) as control tokens, as older "
               "servers did; by default only the chat template's own markup becomes control tokens")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if not (math.isfinite(self.max_body_mb) and self.max_body_mb > 0):
            raise ConfigError(f"max_body_mb must be a finite number > 0, got {self.max_body_mb}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key must not be empty")
        if self.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("worker_timeout", "header_timeout", "body_timeout", "keep_alive_timeout",
                     "chat_template_timeout"):
            seconds = getattr(self, name)
            if not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {seconds}")
