"""A checkpoint's weights: safetensors files (single or sharded) or a GGUF file -> tensors -> a
module, and the dtype to hold them in.

The one torch module of the checkpoint package, imported only by the model loaders, so that
resolving a model or reading its tokenizer never loads torch.
"""

from __future__ import annotations

import json
import math
import os
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
# the bits of a value of each safetensors dtype (_header_problem: which tensor's entry is wrong)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8, "F8_E5M2FNUZ": 8,
              "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
              "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64, "F64": 64, "C64": 64}
HEADER_LIMIT = 100_000_000  # the safetensors library's own bound on a header's bytes


def config_dtype(cfg: dict[str, Any]) -> Optional[torch.dtype]:
    """The weights' dtype that config.json names (`dtype`, transformers 5's key, else
    `torch_dtype`): one of DTYPES, or None where it names none (absent, or another floating-point
    type such as float8_e4m3fn, which the loader converts from, or "auto"). A value naming no floating-point
    torch dtype (`"float7"`, `"int8"`, `5`) is refused, not served as bfloat16: transformers would
    fail on it or build the model in it, and a silent default hides a damaged config."""
    key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    name = cfg.get(key)
    if name is None or name == "auto":  # "auto": transformers' own word for "as the weights are"
        return None
    known = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(known, torch.dtype) or not known.is_floating_point:
        raise CheckpointError(f"{key}: must name a floating-point torch dtype such as bfloat16, found {name!r}")
    return DTYPES.get(name)


def pick_dtype(override: Optional[str], cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    """An explicit override wins; on CPU float32 (exact and fast enough); else the config's."""
    if override:
        if override not in DTYPES:
            raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {override!r}")
        return DTYPES[override]
    if device.type == "cpu":
        return torch.float32
    return config_dtype(cfg) or torch.bfloat16


def _weight_map(model_dir: Path) -> Optional[dict[str, Path]]:
    """Each tensor the shard index (model.safetensors.index.json) names -> its shard's path; None
    without an index, or beside a model.safetensors: that file wins, and the index is not read,
    as in transformers' from_pretrained (it looks for the single file first), so a directory
    holding both gives flashtree the weights it gives transformers. The index is downloaded
    data, so its shard names are checked before any is opened: a name must be relative and stay
    inside `model_dir` once `..` is resolved, or the index could make the loader read any file
    (`/etc/passwd`, `../other/model.safetensors`). The check is on the name, not on the file a
    symlink points to: the HF cache's snapshot files are symlinks into its blobs/ folder,
    outside the snapshot."""
    index = model_dir / "model.safetensors.index.json"
    # either there but no regular file: read_json refuses the index, weight_files the single file
    if not os.path.lexists(index) or os.path.lexists(model_dir / "model.safetensors"):
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    if not weight_map:
        raise CheckpointError(f"{index} has an empty weight_map")
    paths = {}
    for shard in set(weight_map.values()):
        name = os.path.normpath(shard)
        if os.path.isabs(name) or name == os.pardir or name.startswith(os.pardir + os.sep):
            raise CheckpointError(f"{index} names shard {shard!r} outside {model_dir}")
        paths[shard] = model_dir / name
    return {tensor: paths[shard] for tensor, shard in weight_map.items()}


def weight_files(model_dir: Path) -> list[Path]:
    """The files holding the weights: the GGUF file itself, model.safetensors (beside an index
    too: _weight_map), the shards the index names (those only: a stray *.safetensors beside them
    is not read), or else every *.safetensors in `model_dir`. Each must be a regular file (or a
    link to one, as in the HF cache): reading a FIFO would wait for a writer forever, and a
    directory or a device says nothing useful when read as weights. So a model.safetensors that
    is there but no regular file is refused, where transformers would pass over it for the
    index: which weights were meant is then unknown."""
    if is_gguf(model_dir):
        return [model_dir]
    weight_map = _weight_map(model_dir)  # None beside a model.safetensors: that file wins
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.lexists(f):
                raise CheckpointError(f"missing shard {f} named in {model_dir / 'model.safetensors.index.json'}")
    elif os.path.lexists(model_dir / "model.safetensors"):
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"cannot read weights {f}: not a regular file")
    return files


def _sizes(value: Any, count: Optional[int]) -> bool:
    """Whether `value` is a list of `count` (None: any number of) non-negative integers."""
    return (isinstance(value, list) and (count is None or len(value) == count)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _header_problem(path: Path) -> Optional[str]:
    """The first tensor entry of the safetensors file at `path` whose header does not add up,
    said as `tensor NAME: what is wrong`: a shape or data_offsets that are no sizes, or a shape
    and dtype that make another number of bytes than its data_offsets span (a header saying F32
    over F16 data). None: no entry is wrong so (or the header cannot be read as JSON; an
    unknown dtype is left alone), and the library's own message stands. safetensors refuses such
    a file as it opens, but says only "invalid shape, data type, or offset for tensor", naming
    neither; reading the header again here costs a read of its bytes, on a failed read only."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if size <= HEADER_LIMIT else None
    except (OSError, ValueError, RecursionError):
        return None
    for name, entry in (header.items() if isinstance(header, dict) else ()):
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if name == "__metadata__" or not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            continue
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not _sizes(shape, None):
            return f"tensor {name}: shape {shape!r} is not a list of sizes"
        if not _sizes(offsets, 2) or offsets[0] > offsets[1]:
            return f"tensor {name}: data_offsets {offsets!r} are not a [start, end] pair of byte offsets"
        bits, span = math.prod(shape) * DTYPE_BITS[dtype], offsets[1] - offsets[0]
        if bits != 8 * span:
            size = bits // 8 if bits % 8 == 0 else bits / 8  # 4- and 6-bit types may end mid-byte
            return (f"tensor {name}: dtype {dtype} and shape {shape} make {size} bytes, but its data_offsets "
                    f"{offsets} span {span}")
    return None


def _unreadable(path: Path, error: Exception) -> CheckpointError:
    """The error for a safetensors file the library could not read: the tensor _header_problem
    names, or else the library's own message."""
    return CheckpointError(f"cannot read weights {path}: {_header_problem(path) or error}")


def tensor_names(model_dir: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint, from its index or its files' headers (no
    tensor is read)."""
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        return list(weight_map)
    names: list[str] = []
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names += sf.keys()
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise _unreadable(f, e) from None
    return names


def read_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device, prefix: str = ""
                    ) -> dict[str, torch.Tensor]:
    """Every weight of a safetensors checkpoint whose name starts with `prefix` (all by default),
    in `dtype` on `device` (a GGUF target loads through models/gguf_load.py, its quantized linears
    kept quantized); the others are not read. A tensor held by two files (two shards, or a stray
    file beside them), or by another shard than the index maps it to, is refused: which copy
    the model should get is unknown, and taking the last one read would hide the conflict. So is
    an index naming a tensor its shard does not hold: the shard is not the one the index was
    written with."""
    weight_map = _weight_map(model_dir) or {}
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    if key.endswith(IGNORED_SUFFIXES) or not key.startswith(prefix):
                        continue
                    if weight_map.get(key, f) != f:
                        raise CheckpointError(f"tensor {key} is in {f}, but model.safetensors.index.json "
                                              f"maps it to {weight_map[key]}")
                    if key in origin:
                        raise CheckpointError(f"tensor {key} appears in both {origin[key]} and {f}")
                    t = sf.get_tensor(key)
                    state[key], origin[key] = (t.to(dtype) if t.is_floating_point() else t), f
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise _unreadable(f, e) from None
    absent = [k for k in weight_map if k.startswith(prefix) and not k.endswith(IGNORED_SUFFIXES) and k not in state]
    if absent:
        raise CheckpointError(f"{model_dir / 'model.safetensors.index.json'} maps {len(absent)} tensor(s) to shards "
                              f"that do not hold them (e.g. {absent[0]} to {weight_map[absent[0]]}): a shard is "
                              "incomplete or from another checkpoint")
    return state


def build_module(factory: Callable[[], nn.Module], state: dict[str, torch.Tensor], where: str,
                 optional: tuple[str, ...] = ()) -> nn.Module:
    """Instantiate on the meta device (no init cost, no double memory) and adopt the loaded
    tensors; any missing or unexpected weight is an error naming the keys, and so is a weight of
    another shape than the module's, or an integer or bool tensor where the module holds floats
    (a quantized module's integer codes take integer tensors: those are not refused)."""
    with torch.device("meta"):
        module = factory()
    params = module.state_dict()
    expected = set(params)
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
        expect = params[key]
        if tensor.shape != expect.shape:
            raise CheckpointError(f"weight {key} in {where} has shape {tuple(tensor.shape)}, "
                                  f"config implies {tuple(expect.shape)}")
        if expect.is_floating_point() and not tensor.is_floating_point():
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(f"weight {key} in {where} has dtype {dtype}, expected a floating-point type")
    module.load_state_dict(state, strict=False, assign=True)
    return module
