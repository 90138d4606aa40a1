"""Checkpoint (directory or GGUF file) -> ready module on the device, plus the identity of the weights.

Configs are read first and returned separately so the engine can plan memory before any weight
is allocated.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..checkpoint import read_json
from ..checkpoint.gguf_draft import DRAFT_ARCHITECTURES, draft_config_json, is_draft
from ..checkpoint.gguf_file import hf_config, is_gguf, open_gguf
from ..checkpoint.gguf_tensors import file_names
from ..checkpoint.weights import build_module, config_dtype, read_state_dict, weight_files
from ..errors import CheckpointError
from .checks import check_config, check_draft, check_finite, check_logits, check_token_ids
from .common import LayerShape
from .rope import RotaryTable
from .dflash import DFlashDraft, DraftConfig
from .dflash2 import checkpoint_names, draft_config, new_draft
from .gguf_load import load_gguf_quantized
from .mtp import PREFIX, MTPConfig
from .quant import QUANT_BITS
from .quantize import link_prefetches, quantize_model, tile_for_kernels
from .registry import TargetConfig, TargetModel, architecture_of, by_gguf, by_model_type, same_names


def target_config(raw: dict[str, Any]) -> TargetConfig:
    """The target's config, parsed by the architecture of its model_type (models/registry.py)."""
    return by_model_type(raw.get("model_type")).parse(raw)


def load_target(model_dir: Path, cfg: TargetConfig, dtype: torch.dtype, device: torch.device,
                max_pos: int, quantize: Optional[str] = None) -> TargetModel:
    """The target on `device`; with `quantize` (int8, int4) its decoder-layer linears are
    quantized (models/quant.py), from a copy staged in host memory, so the device never holds
    the dense weights. Weights with a NaN or an infinity, or whose logits overflow to one, are
    refused (models/checks.py)."""
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    arch = architecture_of(cfg)
    factory = partial(arch.model, cfg, max_pos)
    if is_gguf(model_dir):  # its quantized linears stay quantized (models/gguf_load.py)
        model = load_gguf_quantized(model_dir, factory, dtype, device, arch.rename, optional,
                                    QUANT_BITS[quantize] if quantize else None)
        files = lambda: arch.rename(file_names(open_gguf(model_dir)))  # made only for an error
    else:
        staging = device if quantize is None else torch.device("cpu")
        model, files = _built(factory, read_state_dict(model_dir, dtype, staging), arch.rename, model_dir, optional)
    if cfg.tie_word_embeddings and isinstance(model.model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.model.embed_tokens.weight  # (a quantized table: shared already)
    model.rope = RotaryTable(cfg.rotary_dim, cfg.rope, max_pos)
    check_finite(model, str(model_dir), files)
    if quantize is not None:
        quantize_model(model, quantize, device)
    model = link_prefetches(tile_for_kernels(model.to(device).eval()))
    check_logits(model, str(model_dir))
    return model


def load_draft(model_dir: Path, cfg: DraftConfig, dtype: torch.dtype, device: torch.device,
               max_pos: int, quantize: Optional[str] = None) -> DFlashDraft:
    """The draft (DFlash or DFlash2, as its config says, from a checkpoint directory or a GGUF
    file; an MTP config: the target checkpoint's `mtp.*` weights in `model_dir`, or its GGUF
    file's nextn block) on `device`;
    with `quantize` (int8, int4) its linears are quantized, staged in host memory like the
    target's, and a GGUF draft's quantized linears with more bits are rounded to it, as a GGUF
    target's are by --quantize. Its embedding and lm_head are the target's (--quantize). Weights
    with a NaN or an infinity, or whose outputs overflow to one, are refused (models/checks.py)."""
    factory = partial(new_draft, cfg, max_pos)
    staging = device if quantize is None else torch.device("cpu")
    if is_gguf(model_dir):  # as a GGUF target: its quantized linears stay quantized
        mtp = isinstance(cfg, MTPConfig)  # the target file's nextn block
        rename = same_names if mtp else checkpoint_names
        draft = load_gguf_quantized(model_dir, factory, dtype, device, rename, (),
                                    QUANT_BITS[quantize] if quantize else None, mtp)
        files = lambda: rename(file_names(open_gguf(model_dir), mtp))  # made only for an error
    elif isinstance(cfg, MTPConfig):
        draft, files = _built(factory, read_state_dict(model_dir, dtype, staging, PREFIX),
                              lambda state: {k[len(PREFIX):]: v for k, v in state.items()}, model_dir)
    else:
        draft, files = _built(factory, read_state_dict(model_dir, dtype, staging), checkpoint_names, model_dir)
    draft.rope = RotaryTable(cfg.rotary_dim, cfg.rope, max_pos)
    check_finite(draft, str(model_dir), files)
    if quantize is not None:
        quantize_model(draft, quantize, device)
    draft = link_prefetches(tile_for_kernels(draft.to(device).eval()))
    check_draft(draft, str(model_dir))
    return draft


def _built(factory: Callable[[], Any], state: dict[str, torch.Tensor], rename: Callable[[dict], dict],
           model_dir: Path, optional: tuple[str, ...] = ()) -> tuple[Any, Callable[[], dict[str, str]]]:
    """The module `factory` makes, its weights the checkpoint's `state` under the model's names
    (`rename`), and what makes each of those names -> the file's, which check_finite's errors
    give (a rename maps names alone, so it maps them as it maps the tensors). `state` is not
    kept: a weight --quantize replaces is freed."""
    names = list(state)
    return build_module(factory, rename(state), str(model_dir), optional), lambda: rename(dict(zip(names, names)))


def fingerprint(dirs: list[Optional[Path]], extra: Any) -> str:
    """Identity of the weights and KV layout: config bytes, weight file names, sizes and heads.

    Cheap (no full hash of gigabytes) yet changes whenever a checkpoint file is replaced."""
    h = hashlib.sha256(repr(extra).encode())
    for d in dirs:
        if d is None:
            continue
        if d.is_dir():  # a GGUF file's metadata is in the bytes read below
            h.update((d / "config.json").read_bytes())
        for f in weight_files(d):
            h.update(f.name.encode() + str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:32]


def refuse_prequantized(raw: dict[str, Any], source: Path) -> None:
    """Refuse a safetensors checkpoint that another tool quantized (config.json's
    `quantization_config`: FP8, AWQ, GPTQ, bitsandbytes): its tensors are codes and scales in that
    tool's layout, which would load as plain weights (FP8 cast without its scales: a model that
    answers nonsense) or fail on its extra tensors. flashtree quantizes an unquantized checkpoint
    itself, or reads GGUF's types. A `quantization_config` of null (or {}) says none."""
    config = raw.get("quantization_config")
    if config is None or config == {}:
        return
    method = config.get("quant_method", "unnamed") if isinstance(config, dict) else "unnamed"
    raise CheckpointError(f"{source}: quantization_config: a checkpoint quantized by another tool ({method!r}) is "
                          "not read; give its unquantized checkpoint (--quantize int8 or int4 quantizes it) or "
                          "a GGUF file")


def _checked(parse: Callable[[dict[str, Any]], Any], raw: dict[str, Any], source: Path) -> Any:
    """`parse(raw)`, refused if it makes no working model (models/checks.py); a value of the
    wrong type (a string for a count), a missing key or an unsupported kind is an error naming
    `source`, not a traceback."""
    try:
        config_dtype(raw)  # a dtype that names none is refused here, before a device is chosen
        cfg: LayerShape = parse(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: malformed config: {e}") from None
    except CheckpointError as e:
        if str(e).startswith(f"{source}:"):  # already names the file
            raise
        raise CheckpointError(f"{source}: {e}") from None
    check_config(cfg, str(source))
    return cfg


def read_configs(target_dir: Path, draft_dir: Optional[Path], mtp: bool = False
                 ) -> tuple[dict, TargetConfig, Optional[DraftConfig]]:
    """The target's config.json dict (a GGUF file's as gguf_file.hf_config gives it, with the
    model_type of the architecture serving its general.architecture), its config and the
    draft's (from its config.json or its GGUF header), each checked, the target's special-token
    ids too (checks.check_token_ids). `mtp`: the draft is the target's own MTP layer
    (models/mtp.py), and `draft_dir` is not read."""
    if is_gguf(target_dir):
        source, g = target_dir, open_gguf(target_dir)
        if is_draft(g):
            raise g.error("general.architecture", f"{g.arch!r} is a draft's architecture: give this file as --draft")
        arch = by_gguf(g.arch, g.path)  # before its keys are read: another architecture's are not ours
        raw = {**hf_config(g), "model_type": arch.model_types[0]}
    else:
        source = target_dir / "config.json"
        raw = read_json(source)
        refuse_prequantized(raw, source)
    target = _checked(target_config, raw, source)
    check_token_ids(raw, target.vocab_size, source)
    draft = None
    if mtp:
        draft = _checked(lambda r: MTPConfig.of_target(r, target, target_dir), raw, source)
    elif draft_dir is not None:
        draft_raw, draft_source = draft_json(draft_dir)
        draft = _checked(draft_config, draft_raw, draft_source)
        problems = draft.fit_problems(target)
        if problems:
            raise CheckpointError(f"{draft_source}: the draft does not fit the target {source}: " + "; ".join(problems))
    return raw, target, draft


def draft_json(draft_dir: Path) -> tuple[dict[str, Any], Path]:
    """The draft's config.json dict and where it came from: a GGUF draft's header as
    gguf_draft.draft_config_json reads it (a file of another architecture is refused)."""
    if not is_gguf(draft_dir):
        return read_json(draft_dir / "config.json"), draft_dir / "config.json"
    g = open_gguf(draft_dir)
    if not is_draft(g):
        raise g.error("general.architecture", f"{g.arch!r} is not a DFlash draft's architecture "
                                              f"({', '.join(DRAFT_ARCHITECTURES)})")
    return draft_config_json(g), draft_dir
