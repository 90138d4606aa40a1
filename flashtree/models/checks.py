"""Refusing, at load, a model that could not serve: a config whose shape or constants make no
working model, weights holding a NaN or an infinity or overflowing to one in a forward, and a
tokenizer whose ids the model has no rows for.

Such a model loads without complaint and then fails every request (a stack of no layers indexes
past its end) or, worse, answers every request with "" and finish_reason stop (one NaN weight, a
NaN norm epsilon or a RoPE base at or below zero makes every logit NaN). So the loader
(models/loader.py) checks every checkpoint, safetensors or GGUF, target or draft, here, once:
the config when it is read (so `flashtree plan` refuses it too), the weights once loaded, where
they lie (the device, or the host copy that --quantize stages), and the target's logits and the
draft's outputs once each is ready; the engine checks the tokenizer against the target's config.
Each refusal is a CheckpointError naming the checkpoint, the field or tensor (as the file names
it), and what is wrong.
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..checkpoint.gguf_file import is_gguf, open_gguf
from ..checkpoint.gguf_tokenizer import special_token_ids
from ..checkpoint.tokenizer import Tokenizer, eos_token_ids
from ..errors import CheckpointError
from .common import COUNT_LIMITS
from .rope import positive_number, rope_inv_freq
from .dflash import DFlashDraft, DraftConfig
from .dflash2 import DFlash2Draft
from .inputs import ForwardInput
from .moe import Experts
from .mtp import MTPDraft
from .quant import GroupQuantized
from .registry import TargetConfig, TargetModel


# An RMSNorm's epsilon guards a division: models use 1e-6 to 1e-5. One of 1e30 passes every
# other check and makes the norms output about 0, so the model answers ""
MAX_NORM_EPS = 1e-2
# check_logits' test input: a prefill of this many distinct tokens (attention over several keys)
CHECK_TOKENS = 16
# check_draft's test input: context rows the draft attends to (a DFlash draft's context
# projection writes them, an MTP draft's layer its own), then the draft's own forward
DRAFT_CONTEXT = 4
# _rope_table_problem: the positions a RoPE table must hold finite (any max_position_embeddings)
MAX_ROPE_POSITIONS = COUNT_LIMITS["max_position_embeddings"]
MAX_NAMED = 4  # the parts file_tensors names of a tensor packed from more: the first two, "...", the last
ROUND_TRIP = "Hello, world! The answer is 42.\nIt costs $3.50 (or so)."


def check_config(cfg: Union[TargetConfig, DraftConfig], source: str) -> None:
    """Refuse a config that makes no working model: a count or size below 1 (no layers, no
    heads), key/value heads that do not divide the query heads (each serves a whole group), a
    norm epsilon that is not a small positive number (MAX_NORM_EPS), a RoPE base that is not a
    positive finite number (the RoPE scaling's numbers: rope.rope_params; a count that is no
    integer or implausibly large: common.read_int, as the config is read, before a list or a
    module per layer is made), a rotary width that is not an even number of a head's dimensions
    (RoPE turns pairs), RoPE settings whose table is not finite (_rope_table_problem), or what
    the config's own rules refuse (its `counts` and `problems`: a
    hybrid's DeltaNet heads)."""
    def fail(field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{source}: {field}: {problem}")

    for field, value in cfg.counts():
        if value < 1:
            raise fail(field, f"must be at least 1, found {value}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise fail("num_key_value_heads", f"{cfg.num_kv_heads} does not divide num_attention_heads {cfg.num_heads}")
    if not positive_number(cfg.rms_norm_eps) or cfg.rms_norm_eps > MAX_NORM_EPS:
        raise fail("rms_norm_eps", f"must be a positive number of at most {MAX_NORM_EPS:g}, found {cfg.rms_norm_eps}")
    if not positive_number(cfg.rope["rope_theta"]):
        raise fail("rope_theta", f"must be a positive finite number, found {cfg.rope['rope_theta']!r}")
    rotary = cfg.rotary_dim
    if rotary < 2 or rotary % 2 or rotary > cfg.head_dim:
        raise fail("head_dim", f"RoPE turns {rotary} of its {cfg.head_dim} dimensions, which must be an even "
                               "number from 2 to head_dim")
    rope_problem = _rope_table_problem(cfg)
    if rope_problem:
        raise fail(*rope_problem)
    problems = cfg.problems()
    if problems:
        raise fail(*problems[0])


def _rope_table_problem(cfg: Union[TargetConfig, DraftConfig]) -> Optional[tuple[str, str]]:
    """(config.json key, what is wrong) where the RoPE table the config makes is not finite: each
    number is positive and finite (rope.rope_params), and still a base far below 1 (1e-300) or a
    linear factor of 1e-300 makes inverse frequencies past float32, a yarn attention_factor of
    1e300 a scale past it, and every cos and sin at some position up to MAX_ROPE_POSITIONS is
    then NaN. That was refused only once the weights were loaded, as the buffer `rope.cos`,
    which names no key of the config (and `flashtree plan` passed it). None: the table is
    finite. Only the inverse frequencies are computed (head_dim / 2 numbers), not the table."""
    params = cfg.rope
    try:
        inv, scale = rope_inv_freq(cfg.rotary_dim, params, getattr(cfg, "max_position_embeddings", 0) or 32768)
    except CheckpointError as e:  # a GGUF file's frequency factors, one per frequency
        return "rope freq_factors", str(e)
    angles = inv.float() * MAX_ROPE_POSITIONS  # each frequency's angle at the last position
    if bool(torch.isfinite(angles).all()) and abs(scale) <= torch.finfo(torch.float32).max:
        return None
    kind = params.get("rope_type", "default")
    effect = "past float32 (every cos and sin would be NaN at some position)"
    if kind == "default":
        return "rope_theta", f"{params['rope_theta']!r} makes RoPE angles {effect}"
    said = ", ".join(f"{key} {params[key]!r}" for key in ("rope_theta", "factor", "attention_factor")
                     if params.get(key) is not None)
    return f"rope ({kind})", f"{said} make RoPE angles or scales {effect}"


def check_token_ids(raw: Mapping[str, Any], vocab_size: int, source: Path) -> None:
    """Refuse, as the configs are read (so `flashtree plan` refuses it too), a special-token id
    that the engine reads and the model has no row for (config vocab_size): config.json's
    `eos_token_id` (an int, a list of them, or null: checkpoint/tokenizer.py, eos_token_ids) or,
    of a GGUF file `source`, its `tokenizer.ggml.bos_token_id`, `eos_token_id`, `eot_token_id`
    and `eom_token_id` (gguf_tokenizer.special_token_ids). An end-of-sequence id decides where
    generation stops, and one past the vocabulary is never sampled; a GGUF file's bos is the
    chat template's `bos_token`, and may be prepended. The error names the field, the value and
    the vocabulary's size. Ids the engine never reads are ignored, not refused, whatever they
    hold: `bos_token_id` and `pad_token_id` of config.json and generation_config.json (whose
    `eos_token_id` the tokenizer checks: checkpoint/tokenizer.py, load_tokenizer), a GGUF file's
    `padding_token_id`. Checkpoints that serve carry such ids outside their vocabulary (LLaMA
    conversions with `pad_token_id: -1`): refusing them would refuse working models."""
    if is_gguf(source):
        special_token_ids(open_gguf(source), vocab_size)
    else:
        eos_token_ids(raw.get("eos_token_id"), source, vocab_size, f"config vocab_size {vocab_size}")


def positions_past_training(cfg: TargetConfig, max_ctx: int) -> Optional[str]:
    """What to tell a user whose --max-ctx is past the positions the model was trained on: its
    `max_position_embeddings` with plain RoPE (no `rope_scaling`). Not refused: a model may read
    a little past it, and the number is sometimes set low by mistake; but its answers degrade
    there without a word, and Qwen's model cards turn YaRN on for long contexts through
    `rope_scaling`, which is the fix this names. None where the context is within it or a
    scaling is set."""
    trained = cfg.max_position_embeddings
    if max_ctx <= trained or cfg.rope.get("rope_type", "default") != "default":
        return None
    return (f"--max-ctx {max_ctx} is past the {trained} positions the model was trained on "
            "(max_position_embeddings, with no rope_scaling): answers past them may degrade; "
            "a model whose card enables YaRN for long contexts needs its rope_scaling in config.json")


def check_finite(model: nn.Module, source: str,
                 files: Optional[Callable[[], Mapping[str, str]]] = None) -> None:
    """Refuse a model holding a NaN or an infinity in any floating-point parameter or buffer:
    a dense weight, a quantized weight's scales and minimums, the RoPE table.

    Each tensor is reduced once where it lies to its smallest and largest value (one pass,
    aminmax): both are finite only if every value is, since a NaN makes both NaN and an infinity
    is one of them. So one read of each weight clears it, with no temporary the size of the
    weight (torch.isfinite(t).all() would first write a byte per value: 1.3 GB for the bfloat16
    embedding of a 248K x 5120 vocabulary). Only a tensor that fails is looked at value by
    value, to count what is wrong in it. A weight matrix whose every value is 0 (the same pass:
    its smallest and largest value) is refused too: a layer of one loads, runs, and gives
    garbage (a zeroed down projection: the same word over and over), and a draft of them accepts
    nothing. (A vector may be 0: a norm scale applied as 1 + weight.) The error names the
    tensors as the file holds them (file_tensors; `files` makes the loader's renames, asked for
    only when a check fails)."""
    matrices = {id(t) for t in model.parameters() if t.dim() >= 2}
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        low_high = torch.stack(t.aminmax())
        finite = bool(torch.isfinite(low_high).all())
        if finite and (id(t) not in matrices or bool(low_high.any())):
            continue
        where, its = file_tensors(model, name, files() if files else {})
        if not finite:
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{source}: {where}: {bad} of {its} {t.numel()} values are not finite "
                                  "(NaN or infinity)")
        raise CheckpointError(f"{source}: {where}: every value is 0 (a download cut short and zero-filled?): "
                              "no trained weight matrix is")


def file_tensors(model: nn.Module, name: str, files: Mapping[str, str]) -> tuple[str, str]:
    """The checkpoint tensors that parameter or buffer `name` of `model` was built from, named as
    the file holds them, for an error; and "its" or "their". Names inside the model are not the
    file's: a linear packed at load (common.packed_linear) was several (`gate_proj/up_proj`), an
    Experts stack every expert's parts, a quantized matrix's scales and minimums come from its
    weight, and the loader renamed what it read (`files`: the model's checkpoint name -> the
    file's, a GGUF file's `token_embd.weight` for `model.embed_tokens.weight`; one absent is the
    same). Several are said as one (_joined)."""
    path, _, kind = name.rpartition(".")
    parent, _, attr = path.rpartition(".")
    owner = model.get_submodule(path)
    packed = getattr(model.get_submodule(parent), "packed_parts", {}).get(attr)
    quantized = isinstance(owner, GroupQuantized) and kind != "bias"
    if isinstance(owner, Experts):
        names = [f"{path}.{part}" for part in owner.checkpoint_names(kind)]
    elif packed or quantized:  # a quantized matrix's scales and minimums: its weight's values
        source_kind = "weight" if quantized else kind
        names = [".".join(filter(None, (parent, part, source_kind))) for part in packed or (attr,)]
    else:
        names = [name]
    its = "its" if len(names) == 1 else "their"
    where = _joined([files.get(n, n) for n in names])
    return (f"{where} ({its} quantized blocks' {kind})" if quantized else where), its


def _joined(names: list[str]) -> str:
    """Tensor names as one: several as their common dotted prefix and suffix around the parts
    that differ (`model.layers.2.mlp.gate_proj/up_proj.weight`); of more than MAX_NAMED, the
    first two, "..." and the last of those parts."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    head = len(os.path.commonprefix(parts))
    tail = min(len(os.path.commonprefix([p[::-1] for p in parts])), min(map(len, parts)) - head)
    middles = [".".join(p[head:len(p) - tail]) for p in parts]
    if len(middles) > MAX_NAMED:
        middles = [*middles[:2], "...", middles[-1]]
    return ".".join([*parts[0][:head], "/".join(middles), *parts[0][len(parts[0]) - tail:]])


@torch.inference_mode()
def check_logits(model: TargetModel, source: str) -> None:
    """Refuse a target whose finite weights still overflow: a norm scale of 1e30, an embedding
    of 3e38. check_finite passes them, and the model then loaded and answered every request with
    "" and finish_reason stop: its logits were NaN, or all 0 (an RMSNorm computes its input's mean
    square in float32, which a stream beyond ~1e19 overflows to infinity, and then outputs 0 or
    NaN), and the argmax of such a row is token 0, an end-of-sequence id in some vocabularies.

    So CHECK_TOKENS distinct token ids, spread over the vocabulary, run as one prefill at
    positions 0.. through every layer and the lm_head where the model lies, with its final
    weights (quantized, tiled), and every row's logits and the mean square of its stream into
    the final norm (the last layer's output) must be finite. Several rows, not one: a weight may
    overflow only once attention weighs several keys (a q_norm scale of 3.4e38 makes NaN
    queries, which attention over one key may still turn into a finite output, and over two
    does not), so a one-token check passed it, and then every request failed. The cost: one
    forward of a few rows (one read of each weight, as a decode step) and a cache of that many
    rows (a hybrid's recurrent states once: a few MB a layer). Other inputs may still overflow:
    decode itself checks every row a token is drawn from and fails that request
    (errors.NonFiniteLogits) rather than emit garbage. Logits that are finite but all equal (a
    final norm or an embedding of zeros, the tail of a download cut short and left zero-filled)
    make the same empty answer, and are refused too: no trained model scores every token of its
    vocabulary alike."""
    norm = model.model.norm.weight  # in the model's dtype and place, whatever is quantized
    device = norm.device
    vocab = model.config.vocab_size
    rows = min(CHECK_TOKENS, vocab)
    with torch.inference_mode():  # as the engine runs it: the kernels, not autograd's definitions
        cache = model.new_cache(rows, norm.dtype, device, max_nodes=1)
        inp = ForwardInput(ids=torch.arange(rows, device=device) * (vocab // rows), cache=cache,
                           lengths=torch.zeros(1, dtype=torch.int32, device=device),
                           feature_layers=(model.config.num_layers - 1,))
        hidden, stream = model(inp)
        logits = model.logits(hidden).float()
        finite = torch.isfinite(logits).all() & torch.isfinite(stream.float().square().mean(dim=-1)).all()
        spread = logits.max() - logits.min()
    if not bool(finite):
        raise CheckpointError(f"{source}: gives non-finite logits on a test input (or a hidden state whose norm "
                              "overflows float32): weights out of range?")
    if not bool(spread > 0):
        raise CheckpointError(f"{source}: gives the same logit for every token on a test input: zeroed weights "
                              "(a download cut short, a norm or embedding of zeros)?")


@torch.inference_mode()
def check_draft(draft: Union[DFlashDraft, MTPDraft], source: str) -> None:
    """Refuse a draft whose finite weights overflow in its forward (a norm scale or a projection
    of 3.4e38, a stream past ~1e19). check_finite passes them, and the draft then loaded without a
    word and proposed garbage from NaN (or all-0) hidden states, none of which verification
    accepted: the output stayed exact, at the speed of decoding with no draft, and nothing said
    why.

    So the draft runs once where it lies, with its final weights (quantized, tiled), on a few
    rows of fixed pseudo-random values in place of the target's embeddings and features (a draft
    loads without the target; each row it reads goes through a norm first, so their scale does
    not matter): a DFlash or DFlash2 draft writes DRAFT_CONTEXT context rows (its fc and
    hidden_norm) and then predicts a block of block_size rows over them, as a decode step does;
    an MTP draft runs DRAFT_CONTEXT rows of [embedding | hidden], each attending to those before
    it; a DFlash2 draft's candidate selector then ranks the block on pseudo-random logits (its
    codebooks and projection). Every output must be finite, and no row of the final hidden
    states all 0: an RMSNorm computes its input's mean square in float32, and outputs 0 for a
    stream past ~1e19 (NaN past float32), which the target's lm_head makes the same logit for
    every token. The cost: one draft step of a few rows."""
    c = draft.config
    weight = draft.norm.weight  # in the draft's dtype and place, whatever is quantized
    device, dtype = weight.device, weight.dtype
    room = draft.rope.cos.shape[0]  # the positions its RoPE table holds
    gen = torch.Generator().manual_seed(0)

    def rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(device, dtype)

    start = torch.zeros(1, dtype=torch.int32, device=device)
    if isinstance(draft, MTPDraft):
        n = min(DRAFT_CONTEXT, room)
        hidden = draft(ForwardInput(embeds=rows(n, 2 * c.hidden_size), cache=draft.new_cache(n, dtype, device),
                                    lengths=start))
    else:
        block = min(c.block_size, room)
        context = min(DRAFT_CONTEXT, room - block)
        cache = draft.new_cache(context + block, dtype, device)
        if context:
            draft.write_context(ForwardInput(embeds=rows(context, len(c.target_layer_ids) * c.hidden_size),
                                             cache=cache, lengths=start))
        hidden = draft(ForwardInput(embeds=rows(block, c.hidden_size), cache=cache, lengths=start + context))
    outputs = [hidden]
    if isinstance(draft, DFlash2Draft) and hidden.shape[0] > 1:
        logits = draft.proposal_logits(rows(hidden.shape[0] - 1, draft.config.vocab_size).float())
        outputs += draft.select_candidates(hidden[1:], logits, torch.zeros(1, dtype=torch.long, device=device))[:1]
    if not all(bool(torch.isfinite(o).all()) for o in outputs):
        found = "NaN or infinity"
    elif not bool(hidden.float().abs().amax(dim=-1).gt(0).all()):
        found = ("rows of 0: what its final norm gives for a hidden state whose norm overflows float32, or for a "
                 "norm of zeros")
    else:
        return
    raise CheckpointError(f"{source}: the draft's outputs are not finite on a test input ({found}): weights out of "
                          "range? It would propose garbage, and have none of its tokens accepted")


def check_tokenizer(tokenizer: Tokenizer, vocab_size: int, model_dir: Path) -> None:
    """Refuse a tokenizer that makes token ids the model has no row for: its largest id, added
    and special tokens included, and its end-of-sequence ids must be below the config's
    vocab_size (the embedding's and lm_head's rows; a padded vocabulary may have more rows than
    tokens). Else the model loaded and /health said ok, and then every chat request failed with
    a 400 blaming the client for the template's own <|im_start|>. A vocabulary with no tokens but
    the added ones is refused too: every prompt's text was dropped, and only the chat template's
    markup reached the model. So is one of fewer tokens than half the model's rows (another
    model's, or one cut short: prompts lose their text to unknown tokens), and one whose
    decoder does not give a plain text back (`"decoder": null` answers `The Ġcapital`), or whose
    normalizer lowercases it (_text_lost says which), where it makes the text without its
    unknown token. (A GGUF file's tokens are checked against its
    embedding as it is read: checkpoint/gguf_tokenizer.py; this holds for it too.)"""
    source = model_dir if model_dir.is_file() else model_dir / "tokenizer.json"
    if not tokenizer.raw.get_vocab(with_added_tokens=False):
        raise CheckpointError(f"{source}: the vocabulary is empty: only the added tokens could be made, and "
                              "the text of every prompt would be dropped")
    size = tokenizer.raw.get_vocab_size(with_added_tokens=True)
    if 2 * size < vocab_size:
        raise CheckpointError(f"{source}: {size} tokens for the model's {vocab_size} rows (config vocab_size): "
                              "a tokenizer of another model, or cut short?")
    ids = tokenizer.raw.encode(ROUND_TRIP, add_special_tokens=False).ids
    unknown = getattr(tokenizer.raw.model, "unk_token", None)
    unknown_id = tokenizer.raw.token_to_id(unknown) if unknown else None
    back = tokenizer.raw.decode(ids, skip_special_tokens=False)
    if unknown_id not in ids and back.strip() != ROUND_TRIP.strip():
        raise CheckpointError(f"{source}: {_text_lost(tokenizer, back)}")
    token, top = max(tokenizer.raw.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    if top >= vocab_size:
        raise CheckpointError(f"{source}: token {token!r} id {top} >= config vocab_size {vocab_size}")
    bad = [i for i in tokenizer.eos_token_ids if not 0 <= i < vocab_size]
    if bad:
        raise CheckpointError(f"{model_dir}: end-of-sequence token ids {bad} (eos_token_id of generation_config.json "
                              f"or config.json) outside config vocab_size {vocab_size}")


def _text_lost(tokenizer: Tokenizer, back: str) -> str:
    """What check_tokenizer says of a tokenizer that gives ROUND_TRIP back as `back`. Where its
    normalizer lowercases (`{"type": "Lowercase"}`, alone or in a Sequence), that is the cause,
    not the decoder: the text reaches the model lowercased (transformers does the same), so
    every prompt's code, names and tool-call arguments lose their case, and a vocabulary holding
    capitals (a cased model's: none of the models served here lowercase) has tokens no text could
    make. Such a tokenizer is refused, as any that loses text, and the error says so: it said
    "no decoder, or a broken one?", and the decoder was sound."""
    normalizer = tokenizer.raw.normalizer
    said = f"{ROUND_TRIP!r} decodes as {back!r}"
    if normalizer is None or "hello" not in normalizer.normalize_str("Hello"):
        return f"text does not come back from its tokens: {said} (no decoder, or a broken one?)"
    cased = sum(any("A" <= c <= "Z" for c in token) for token in tokenizer.raw.get_vocab(with_added_tokens=False))
    unreachable = f", and {cased} of its tokens hold capitals that no text could then make" if cased else ""
    return (f"normalizer: lowercases every text before it is tokenized ({said}): each prompt would reach the model "
            f"changed, its code, names and tool-call arguments without their case{unreachable} (the normalizer of "
            "another, uncased tokenizer?)")
