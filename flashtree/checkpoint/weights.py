"""A checkpoint's weights: safetensors files (single or sharded) or a GGUF file -> tensors -> a
module, and the dtype to hold them in.

The one torch module of the checkpoint package, imported only by the model loaders, so that
resolving a model or reading its tokenizer never loads torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointError
from .files import read_json
from .gguf_file import is_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# buffers some exporters write that we recompute
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    if is_gguf(model_dir):
        return [model_dir]
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


def tensor_names(model_dir: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint, from its index or its files' headers (no
    tensor is read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(read_json(index).get("weight_map", {}))
    names: list[str] = []
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names += sf.keys()
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise CheckpointError(f"cannot read weights {f}: {e}") from None
    return names


def read_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device, prefix: str = ""
                    ) -> dict[str, torch.Tensor]:
    """Every weight of a safetensors checkpoint whose name starts with `prefix` (all by default),
    in `dtype` on `device` (a GGUF target loads through models/gguf_load.py, its quantized linears
    kept quantized); the others are not read."""
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    if key.endswith(IGNORED_SUFFIXES) or not key.startswith(prefix):
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
