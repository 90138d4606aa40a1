"""Find and load HF-format checkpoints offline: config.json, safetensors (single or sharded),
tokenizer.json and the chat template.

A model reference is either a local directory or an HF repo id already in the local HF cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# buffers some exporters write that we recompute
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_model_dir(ref: str | os.PathLike) -> Path:
    """A local directory, or the snapshot of an HF repo id in the local cache (never downloads)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    text = str(ref)
    if path.exists():
        raise CheckpointError(f"{text} is a file; expected a model directory")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        repo = hf_cache_root() / ("models--" + text.replace("/", "--"))
        snapshots = repo / "snapshots"
        ref_file = repo / "refs" / "main"
        if ref_file.is_file() and (snapshots / ref_file.read_text().strip()).is_dir():
            return snapshots / ref_file.read_text().strip()
        if snapshots.is_dir():
            found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
            if found:
                return found[-1]
        raise CheckpointError(
            f"model {text!r} is not a local directory and is not in the HF cache at {hf_cache_root()} "
            "(flashtree never downloads: fetch it first, e.g. `huggingface-cli download`)")
    raise CheckpointError(f"model directory {text} does not exist")


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def config_dtype(cfg: dict[str, Any]) -> Optional[torch.dtype]:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return DTYPES.get(str(name)) if name else None


def pick_dtype(override: Optional[str], cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    """An explicit override wins; on CPU float32 (exact and fast enough); else the config's."""
    if override:
        if override not in DTYPES:
            raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {override!r}")
        return DTYPES[override]
    if device.type == "cpu":
        return torch.float32
    return config_dtype(cfg) or torch.bfloat16


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index} has an empty weight_map")
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"missing shard {f} named in {index}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    return found


def read_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    if key.endswith(IGNORED_SUFFIXES):
                        continue
                    t = sf.get_tensor(key)
                    state[key] = t.to(dtype) if t.is_floating_point() else t
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise CheckpointError(f"cannot read weights {f}: {e}") from None
    return state


def build_module(factory: Callable[[], nn.Module], state: dict[str, torch.Tensor], where: str,
                 optional: tuple[str, ...] = ()) -> nn.Module:
    """Instantiate on the meta device (no init cost, no double memory) and adopt the loaded
    tensors; any missing or unexpected weight is an error naming the keys."""
    with torch.device("meta"):
        module = factory()
    expected = set(module.state_dict().keys())
    missing = sorted(expected - set(state) - set(optional))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} weights (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} weights (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"weights in {where} do not match the architecture: " + "; ".join(parts))
    for key, tensor in state.items():
        expect = module.state_dict()[key].shape
        if tensor.shape != expect:
            raise CheckpointError(f"weight {key} in {where} has shape {tuple(tensor.shape)}, "
                                  f"config implies {tuple(expect)}")
    module.load_state_dict(state, strict=False, assign=True)
    return module


@dataclass
class Tokenizer:
    """tokenizer.json through `tokenizers`, plus what tokenizer_config.json adds."""

    raw: Any
    chat_template: Optional[str]
    eos_token_ids: list[int]
    bos_token: Optional[str]
    eos_token: Optional[str]
    special_tokens: set[str]

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.raw.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.raw.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.raw.id_to_token(idx)


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_tokenizer(model_dir: Path, model_cfg: Optional[dict[str, Any]] = None) -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"missing file {path} (flashtree needs a fast tokenizer.json)")
    try:
        raw = RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    tcfg = read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    eos_token = _token_text(tcfg.get("eos_token"))
    eos_ids: list[int] = []
    gen = model_dir / "generation_config.json"
    for source in (read_json(gen) if gen.is_file() else {}, model_cfg or {}):
        value = source.get("eos_token_id")
        for i in ([value] if isinstance(value, int) else value or []):
            if i not in eos_ids:
                eos_ids.append(int(i))
    if eos_token and raw.token_to_id(eos_token) is not None and raw.token_to_id(eos_token) not in eos_ids:
        eos_ids.append(raw.token_to_id(eos_token))
    specials = {t.content for t in raw.get_added_tokens_decoder().values() if t.special}
    return Tokenizer(raw=raw, chat_template=template, eos_token_ids=eos_ids,
                     bos_token=_token_text(tcfg.get("bos_token")), eos_token=eos_token,
                     special_tokens=specials)
