"""Train a DFlash draft for any Hugging Face causal LM (the public SpecForge-style recipe).

The frozen target reads each training sequence once and supplies the outputs of the chosen
layers. Random anchor positions are drawn in the loss region; each anchor's block is [token at
anchor, MASK x (bs-1)], its queries see the context strictly before the anchor plus their own
block (bidirectional) and nothing else, and block position k learns the data token at anchor+k
with weight exp(-(k-1)/gamma). Data should be the target's own responses (see regen.py): then a
block position is right exactly when greedy verification would accept it, and the chain
acceptance length can be computed offline (`chain_acceptance`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..checkpoint import read_json
from ..errors import CheckpointError
from ..models.dflash import DFlashDraft, DraftConfig, default_target_layer_ids
from ..models.loader import load_draft
from .corpus import read_jsonl
from .datasets import Example, draft_example, load_draft_examples
from .draft_model import block_forward, draft_config, new_draft, save_draft
from .loop import LoopConfig, autocast_for, batch_indices, train_loop

_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class DraftTrainConfig:
    """Shape of the draft and of its training batches."""

    block_size: int = 16
    num_layers: int = 1
    intermediate_size: Optional[int] = None  # default: the target's
    layer_ids: Optional[list[int]] = None  # default: z-lab spread of `num_features` layers
    num_features: int = 3
    mask_token_id: Optional[int] = None  # default: the tokenizer's mask token, else an unused row
    max_anchors: int = 512
    gamma: Optional[float] = None  # default: 7 for bs 16, 5 for 10, 4 for 8
    batch_size: int = 8
    max_len: int = 2048
    seed: int = 0
    init_dir: Optional[str] = None  # continue this draft: its shape replaces the shape fields above
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(lr=6e-4, warmup=50))


class FrozenTarget:
    """A transformers causal LM that hands out layer outputs, embeddings and its lm_head."""

    def __init__(self, target_dir: str, device: torch.device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.config = json.loads((Path(target_dir) / "config.json").read_text())
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()

    def mask_token_id(self, requested: Optional[int]) -> int:
        """The reserved DFlash mask id: as asked, the tokenizer's mask token, or a spare row."""
        if requested is not None:
            return requested
        if self.tokenizer.mask_token_id is not None:
            return int(self.tokenizer.mask_token_id)
        if self.config["vocab_size"] > len(self.tokenizer):
            return len(self.tokenizer)
        raise ValueError("the target has no mask token and no spare embedding row; pass --mask-token-id")

    @torch.no_grad()
    def features(self, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """Concatenated outputs of decoder layers `layer_ids` for ids [B,T] -> [B,T,n*H].

        Hooks read the decoder layers themselves, because transformers' `hidden_states` replaces
        the last layer's output by its final-normed version."""
        layers = self.model.model.layers
        caught: dict[int, torch.Tensor] = {}
        hooks = [layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in layer_ids]
        try:
            self.model.model(input_ids=ids, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([caught[i] for i in layer_ids], dim=-1)


def _pad(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.bool)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)], mask[i, : len(m)] = x, m
    lengths = torch.tensor([len(x) for x, _ in examples])
    return ids, mask, lengths


def pick_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, max_anchors: Optional[int],
                 gen: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions [B,A] (sorted) and their validity [B,A]: loss positions with a successor.
    `max_anchors=None` takes every candidate (evaluation)."""
    chosen = []
    for b in range(loss_mask.shape[0]):
        cand = torch.nonzero(loss_mask[b, : max(0, int(lengths[b]) - 1)]).flatten()
        if max_anchors is not None and cand.numel() > max_anchors:
            cand = cand[torch.randperm(cand.numel(), generator=gen)[:max_anchors]].sort().values
        chosen.append(cand)
    width = max(1, max(c.numel() for c in chosen))
    anchors = torch.zeros(len(chosen), width, dtype=torch.long)
    valid = torch.zeros(len(chosen), width, dtype=torch.bool)
    for b, c in enumerate(chosen):
        anchors[b, : c.numel()], valid[b, : c.numel()] = c, True
    return anchors, valid


def block_inputs(ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, bs: int, mask_id: int) -> dict[str, torch.Tensor]:
    """Tokens, positions, labels ([B,A,bs]) and the attention mask [B,A*bs,T+A*bs] of the blocks,
    built on the device of `ids`."""
    b, t = ids.shape
    a, dev = anchors.shape[1], ids.device
    offs = torch.arange(bs, device=dev)
    pos = anchors[:, :, None] + offs  # [B,A,bs]
    safe = pos.clamp(max=t - 1).view(b, -1)
    gathered = torch.gather(ids, 1, safe).view(b, a, bs)
    in_loss = torch.gather(loss_mask, 1, safe).view(b, a, bs)
    labelled = (pos < lengths[:, None, None]) & in_loss & valid[:, :, None] & (offs > 0)
    labels = torch.where(labelled, gathered, torch.full_like(gathered, -100))
    tokens = torch.full_like(gathered, mask_id)
    tokens[:, :, 0] = gathered[:, :, 0]
    sees_ctx = torch.arange(t, device=dev)[None, None, :] < anchors[:, :, None]  # strictly before the anchor
    ctx_part = sees_ctx[:, :, None, :].expand(b, a, bs, t).reshape(b, a * bs, t)
    block_of = torch.arange(a * bs, device=dev) // bs
    own_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return {"tokens": tokens, "pos": pos, "labels": labels, "mask": torch.cat([ctx_part, own_block], dim=2)}


def _draft_to_continue(init_dir: Path, target: dict[str, Any], max_len: int) -> tuple[dict[str, Any], DFlashDraft]:
    """(config.json, float32 draft) of an existing draft to train further, after checking that it
    was made for a target of this shape: its width, vocabulary and layer count."""
    config = read_json(init_dir / "config.json")
    shape = DraftConfig.from_hf(config)
    made_for = {"hidden_size": shape.hidden_size, "vocab_size": config.get("vocab_size"),
                "num_hidden_layers": shape.num_target_layers or target["num_hidden_layers"]}
    for key, have in made_for.items():
        if have != target[key]:
            raise CheckpointError(f"draft {init_dir} was made for a target with {key}={have}; "
                                  f"this target has {target[key]}")
    draft = load_draft(init_dir, shape, torch.float32, torch.device("cpu"), max_len + shape.block_size)
    return config, draft.train()


def leading_matches(correct: torch.Tensor) -> torch.Tensor:
    """[.., bs-1] booleans (block positions 1..bs-1) -> how many leading ones each row has."""
    return correct.long().cumprod(dim=-1).sum(dim=-1)


class DraftTrainer:
    """Holds the frozen target, the draft and the data; computes the loss of any step."""

    def __init__(self, target: FrozenTarget, data: list[Example], cfg: DraftTrainConfig, device: torch.device):
        tcfg = target.config
        if cfg.init_dir is not None:  # the draft's own shape replaces the shape fields of cfg
            self.hf_config, draft = _draft_to_continue(Path(cfg.init_dir), tcfg, cfg.max_len)
            shape = DraftConfig.from_hf(self.hf_config)
            cfg = replace(cfg, block_size=shape.block_size, num_layers=shape.num_layers,
                          intermediate_size=shape.intermediate_size, layer_ids=list(shape.target_layer_ids),
                          mask_token_id=shape.mask_token_id)
        else:
            ids = cfg.layer_ids or default_target_layer_ids(tcfg["num_hidden_layers"], cfg.num_features)
            cfg = replace(cfg, layer_ids=list(ids), mask_token_id=target.mask_token_id(cfg.mask_token_id),
                          intermediate_size=cfg.intermediate_size or tcfg["intermediate_size"])
            self.hf_config = draft_config(tcfg, cfg.num_layers, cfg.intermediate_size, cfg.block_size,
                                          cfg.layer_ids, cfg.mask_token_id)
            draft = new_draft(self.hf_config, cfg.max_len + cfg.block_size, cfg.seed)
        self.target, self.data, self.cfg, self.device = target, data, cfg, device
        self.layer_ids: list[int] = cfg.layer_ids
        self.mask_id: int = cfg.mask_token_id
        self.pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
        self.draft: DFlashDraft = draft.to(device)
        self.gamma = cfg.gamma or _GAMMA.get(cfg.block_size, max(1.0, cfg.block_size * 7 / 16))
        k = torch.arange(cfg.block_size, dtype=torch.float32)
        self.weights = torch.exp(-(k - 1) / self.gamma).to(device)

    def _batch(self, step: int) -> list[Example]:
        return [self.data[j] for j in batch_indices(len(self.data), self.cfg.batch_size, step, self.cfg.seed)]

    def forward(self, examples: list[Example], max_anchors: Optional[int], gen: Optional[torch.Generator]):
        """(weighted loss, leading matches [B,A], anchor validity [B,A], anchor positions [B,A])."""
        dev = self.device
        ids, loss_mask, lengths = _pad(examples, self.pad_id)
        anchors, valid = pick_anchors(loss_mask, lengths, max_anchors, gen)
        ids, loss_mask, lengths, anchors, valid = (x.to(dev) for x in (ids, loss_mask, lengths, anchors, valid))
        blk = block_inputs(ids, loss_mask, lengths, anchors, valid, self.cfg.block_size, self.mask_id)
        b, t = ids.shape
        feats = self.target.features(ids, self.layer_ids)
        block = self.target.embed(blk["tokens"]).view(b, -1, self.target.config["hidden_size"])
        ctx_pos = torch.arange(t, device=dev).expand(b, t)
        hidden = block_forward(self.draft, feats, ctx_pos, block, blk["pos"].view(b, -1), blk["mask"])
        labels = blk["labels"]
        sel = labels.view(b, -1) != -100
        logits = self.target.lm_head(hidden[sel]).float()
        targets = labels.view(b, -1)[sel]
        k_of = torch.arange(self.cfg.block_size, device=dev).repeat(labels.shape[1])[None].expand(b, -1)[sel]
        w = self.weights[k_of]
        loss = (F.cross_entropy(logits, targets, reduction="none") * w).sum() / w.sum().clamp(min=1e-6)
        correct = torch.zeros_like(labels, dtype=torch.bool)
        correct.view(b, -1)[sel] = logits.argmax(-1) == targets
        return loss, leading_matches(correct[:, :, 1:]), valid, anchors

    def loss_at(self, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + step)
        loss, matches, valid, _ = self.forward(self._batch(step), self.cfg.max_anchors, gen)
        accept = ((matches + 1) * valid).sum() / valid.sum().clamp(min=1)
        return loss, {"accept": accept}

    @torch.no_grad()
    def chain_walk(self, examples: list[Example], batch_size: int = 4) -> tuple[int, int]:
        """(tokens emitted, steps) of greedy chain decoding over `examples`, exact when they are
        the target's greedy outputs: walk each completion from its first token, accepting the
        draft's leading matches plus the target's bonus token at every step."""
        self.draft.eval()
        emitted = steps = 0
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            with autocast_for(self.device):
                _, matches, valid, anchors = self.forward(chunk, None, None)
            for b, (ids, mask) in enumerate(chunk):
                table = {int(p): int(m) for p, m, v in zip(anchors[b], matches[b], valid[b]) if v}
                pos, end = int(torch.nonzero(mask)[0]), len(ids) - 1
                while pos < end:
                    got = table.get(pos, 0) + 1
                    emitted, steps, pos = emitted + min(got, end - pos), steps + 1, pos + got
        self.draft.train()
        return emitted, steps

    def chain_acceptance(self, examples: list[Example]) -> float:
        """Mean tokens per chain step (AL) over `examples`; see `chain_walk`."""
        emitted, steps = self.chain_walk(examples)
        return emitted / steps if steps else 0.0


def evaluate_by_kind(trainer: DraftTrainer, path: Path | str) -> dict[str, float]:
    """Chain acceptance per record kind (and overall) on a file of target-generated records."""
    groups: dict[str, list[Example]] = {}
    for rec in read_jsonl(path):
        ex = draft_example(rec, trainer.target.tokenizer, trainer.cfg.max_len)
        if ex is not None and int(ex[1].sum()) >= 2:
            groups.setdefault(rec.get("kind", "all"), []).append(ex)
    counts = {kind: trainer.chain_walk(exs) for kind, exs in sorted(groups.items())}
    out = {kind: round(e / max(1, s), 3) for kind, (e, s) in counts.items()}
    total_e, total_s = sum(e for e, _ in counts.values()), sum(s for _, s in counts.values())
    out["overall"] = round(total_e / max(1, total_s), 3)
    return out


def train_draft(target_dir: str, data_path: str, out_dir: Path, cfg: DraftTrainConfig,
                device: torch.device, eval_path: Optional[str] = None,
                work_dir: Optional[Path] = None) -> dict[str, Any]:
    """Train, save the draft under `out_dir`, and return a summary (steps, time, acceptance)."""
    torch.manual_seed(cfg.seed)
    target = FrozenTarget(target_dir, device)
    data = load_draft_examples(data_path, target.tokenizer, cfg.max_len)
    trainer = DraftTrainer(target, data, cfg, device)
    work = work_dir or out_dir.with_name(out_dir.name + "_work")
    params = [p for p in trainer.draft.parameters() if p.requires_grad]
    summary = train_loop(params, trainer.loss_at, cfg.loop, work / "draft.pt", {"draft": trainer.draft},
                         device, desc="draft")
    save_draft(trainer.draft, trainer.hf_config, out_dir)
    summary.update({"examples": len(data), "parameters": sum(p.numel() for p in params),
                    "config": {k: v for k, v in asdict(trainer.cfg).items() if k != "loop"}, "loop": asdict(cfg.loop)})
    if eval_path:
        summary["chain_acceptance"] = evaluate_by_kind(trainer, eval_path)
    summary["final_accept_train"] = summary["history"][-1].get("accept") if summary["history"] else math.nan
    work.mkdir(parents=True, exist_ok=True)
    (work / "draft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
