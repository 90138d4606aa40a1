"""DFlash2 block-diffusion draft, weight- and config-compatible with z-lab's DFlash2 checkpoints
(`architectures: ["DFlash2DraftModel"]`).

A DFlash draft (models/dflash.py: the context K/V from the target's features, the block
[bonus, MASK...] predicted jointly, the target's embedding and lm_head) with three additions:

- around each layer's attention and around its MLP, a grouped dynamic causal convolution over
  the block's rows: tap j of row t mixes row t - j (zero before the block's first row) with a
  per-channel base kernel plus a dynamic one that row t's input projects, shared by the
  `conv_group_size` channels of a group. The kernels after a sublayer come from the same
  projection as those before it, of the sublayer's input;
- sliding-window layers (`layer_types`, `sliding_window`) and, where `is_causal` is not given,
  causal attention inside the block for them (full-attention layers see the whole block);
- logits times `output_multiplier`, soft-capped at `final_logit_softcapping`, and a candidate
  selector: each position's top `selector_top_k` tokens, scored as their logit plus a rank
  `selector_rank` bilinear term between the previous position's choice (predecessor codebook),
  the position's hidden state (projected) and the candidate (successor codebook). The chain
  mode follows its greedy path from the bonus token; the DDTree is built from the scaled,
  soft-capped logits' log-probs, or with `--dflash2-tree selector` from the selector's
  candidates and their scores (CandidateSelector.candidates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..config import DFLASH2_TREES
from ..errors import ConfigError
from .common import add_norm, cache_attend
from .dflash import DFlashDraft, DraftConfig, DraftKeys, draft_fields
from .inputs import ForwardInput
from .mtp import MTPConfig, MTPDraft

ARCHITECTURE = "DFlash2DraftModel"


@dataclass
class DFlash2Config(DraftConfig):
    vocab_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    causal: list[bool]                         # per layer: causal attention inside the block
    output_multiplier: float
    final_logit_softcapping: Optional[float]   # None: no cap
    input_embedding_scale: float

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "DFlash2Config":
        """The config as the reference reads it: the DFlash2 keys from `dflash_config`, else the
        top level; anything missing or inconsistent is a CheckpointError naming the key. Its
        layer types, when not given, are transformers' Qwen3 config's: the layers from
        max_window_layers on slide when use_sliding_window is true."""
        keys = DraftKeys(cfg, "DFlash2 draft")
        sliding_on = cfg.get("use_sliding_window")

        def absent_types(layers: int) -> list[str]:
            start = cfg.get("max_window_layers", 28)
            return ["sliding_attention" if sliding_on is True and i >= start else "full_attention"
                    for i in range(layers)]

        fields = draft_fields(keys, absent_types)
        fail, value, count = keys.fail, keys.value, keys.count

        def number(key: str, found: Any) -> float:
            if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
                raise fail(key, f"must be a finite number, found {found!r}")
            return float(found)

        vocab = count("vocab_size", cfg.get("vocab_size"))
        windows = fields["sliding_windows"]
        # transformers' Qwen3 config, which the reference reads, drops the window without it
        if any(w is not None for w in windows) and sliding_on is not True:
            raise fail("use_sliding_window", f"must be true for sliding_attention layers, found {sliding_on!r}")
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise fail("is_causal", f"must be true, false or absent, found {is_causal!r}")
        hidden = fields["hidden_size"]
        group = count("dflash_config.conv_group_size", value("conv_group_size"))
        if hidden % group:
            raise fail("dflash_config.conv_group_size", f"{group} does not divide hidden_size {hidden}")
        top_k = count("dflash_config.selector_top_k", value("selector_top_k"))
        if top_k > vocab:
            raise fail("dflash_config.selector_top_k", f"{top_k} is more than vocab_size {vocab}")
        cap = value("final_logit_softcapping", None)
        cap = None if cap is None else number("final_logit_softcapping", cap)
        if cap is not None and cap < 0:
            raise fail("final_logit_softcapping", f"must be 0 (none) or positive, found {cap}")
        multiplier = number("output_multiplier", value("output_multiplier", 1.0))
        if multiplier <= 0:
            raise fail("output_multiplier", f"must be positive, found {multiplier}")
        return cls(
            **fields,
            vocab_size=vocab,
            conv_kernel_size=count("dflash_config.conv_kernel_size", value("conv_kernel_size")),
            conv_group_size=group,
            selector_rank=count("dflash_config.selector_rank", value("selector_rank")),
            selector_top_k=top_k,
            causal=[w is not None if is_causal is None else is_causal for w in windows],
            output_multiplier=multiplier,
            final_logit_softcapping=cap or None,
            input_embedding_scale=number("input_embedding_scale", value("input_embedding_scale", 1.0)),
        )

    def fit_problems(self, target: Any) -> list[str]:
        problems = super().fit_problems(target)
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {target.vocab_size} (the selector's "
                            "codebooks index its tokens)")
        return problems


def draft_config(raw: dict[str, Any]) -> DraftConfig:
    """A draft's config by its architecture: DFlash2, else DFlash."""
    if ARCHITECTURE in (raw.get("architectures") or []):
        return DFlash2Config.from_hf(raw)
    return DraftConfig.from_hf(raw)


def new_draft(cfg: DraftConfig, max_pos: int) -> DFlashDraft:
    """The draft module its config describes (a target's MTP layer too: models/mtp.py)."""
    if isinstance(cfg, MTPConfig):
        return MTPDraft(cfg, max_pos)  # type: ignore[return-value]
    return DFlash2Draft(cfg, max_pos) if isinstance(cfg, DFlash2Config) else DFlashDraft(cfg, max_pos)


def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The codebooks under the published names (no `.weight`), whichever way they were saved."""
    return {k.removesuffix(".weight") if k.endswith("_codebook.weight") else k: v for k, v in state.items()}


def dense_linear(in_features: int, out_features: int) -> nn.Linear:
    """A small linear that --quantize-draft leaves dense (models/quant.py: quantizable_linears):
    the convolutions' kernel projections and the selector's, as other runtimes keep them."""
    lin = nn.Linear(in_features, out_features, bias=False)
    lin.keep_dense = True
    return lin


class GroupedDynamicConv(nn.Module):
    """`prepare(x)` convolves a sublayer's input [T, H] and returns the kernels for `finish`,
    which convolves the sublayer's output: base_kernel [2, K, H] (before, after), and per row
    kernel_projection(x) [T, 2, K, groups] added to it, one value for each group of channels."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = dense_linear(hidden, 2 * kernel * (hidden // group))

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_j (base[j] + dynamic[t, j]) * x[t - j], x [T, H], dynamic [T, K, groups]."""
        t, hidden = x.shape
        rows = x.view(t, hidden // self.group, self.group)
        out = torch.zeros_like(rows)
        for j in range(min(self.kernel, t)):
            shifted = F.pad(rows[:t - j], (0, 0, 0, 0, j, 0))
            out = out + (base[j].view(rows.shape[1:]).to(x.dtype) + dynamic[:, j, :, None]) * shifted
        return out.view(t, hidden)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, self.kernel, -1)
        return self.convolve(x, dynamic[:, 0], self.base_kernel[0]), dynamic[:, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """Top-k candidates per position, scored given the previous position's choice: the greedy
    path through them (`chain`) and each position's candidates ranked by score (`candidates`).
    The codebooks are parameters under the checkpoint's own names."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = dense_linear(hidden, rank)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [D, H] and logits [D, V] of the positions after the anchor, anchor [1] (the
        bonus, on the device) -> each position's candidates [D, k] (its top-k logits' tokens),
        their scores [D, k] (float32) and the greedy path [D]: at each position a candidate
        scores its logit + <predecessor(previous) * projection(hidden), successor(candidate)>,
        `previous` being the path's token before it, and the path takes the best. No host read,
        so a captured draft phase holds it."""
        unary, candidates = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        query = self.hidden_projection(hidden)
        successors = F.embedding(candidates, self.successor_codebook)  # [D, k, rank]
        previous, path, scores = anchor.reshape(1), [], []
        for d in range(hidden.shape[0]):
            weights = F.embedding(previous, self.predecessor_codebook)[0] * query[d]
            scores.append(unary[d] + (successors[d] @ weights).float())
            previous = candidates[d].gather(0, scores[-1].argmax().reshape(1))
            path.append(previous)
        return candidates, torch.stack(scores), torch.cat(path)

    def chain(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The greedy path [D] after the anchor (`walk`): the reference's proposal."""
        return self.walk(hidden, logits, anchor)[2]

    def candidates(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's k candidates best first, as DDTree's build takes them: log-probs
        [D, k] (a log-softmax over their scores given the greedy path's previous token: the
        distribution the reference samples its proposal from at temperature 1) and tokens
        [D, k]. Ranked by the scores themselves in a stable sort, so rank 0 is the greedy
        path's token (argmax takes the first of equal scores too) and a tree seeded with its
        top-1 chain starts with the path."""
        tokens, scores, _ = self.walk(hidden, logits, anchor)
        order = scores.argsort(dim=-1, descending=True, stable=True)
        return torch.log_softmax(scores, dim=-1).gather(1, order), tokens.gather(1, order)


class DFlash2Draft(DFlashDraft):
    """The DFlash draft's context projection, cache and checks, with DFlash2's layers, logits
    and selector. Loaded by models/loader.py: load_draft (new_draft picks it by config)."""

    config: DFlash2Config

    def __init__(self, c: DFlash2Config, max_pos: int):
        super().__init__(c, max_pos)
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k)

    def _block_mask(self, i: int, t: int, device: torch.device) -> Optional[torch.Tensor]:
        """Layer i's visibility among the block's rows where its window is narrower than the
        block (the context rows' window is the attention's own); None: causal or all."""
        window = self.config.sliding_windows[i]
        if window is None or window >= t:
            return None
        at = torch.arange(t, device=device)
        ahead = at[:, None] - at[None, :]
        behind = ahead >= 0 if self.config.causal[i] else -ahead < window
        return (ahead < window) & behind

    def forward(self, inp: ForwardInput) -> torch.Tensor:
        """Predict a block: `inp.embeds` [bs, H] (the target's embeddings of [bonus, MASK...]) at
        `inp.row_positions()` (length + [0, bs) unless given) over the committed context rows of
        `inp.cache`; each layer's own in-block mask (causal or not, its window), whatever
        `inp.block_mask` says. Returns final-normed hidden [bs, H]."""
        block_emb = inp.embeds
        c, t = self.config, block_emb.shape[0]
        positions = inp.row_positions()
        mixes = []
        for i in range(c.num_layers):
            mask = self._block_mask(i, t, block_emb.device)
            mixes.append(cache_attend(replace(inp, positions=positions, block_mask=mask), self.rope, c.causal[i],
                                      c.sliding_windows))
        x = block_emb * c.input_embedding_scale if c.input_embedding_scale != 1.0 else block_emb
        h, residual = add_norm(x, self.layers[0].input_layernorm)
        for i, layer in enumerate(self.layers):
            a, later = layer.attention_conv.prepare(h)
            a = layer.attention_conv.finish(mixes[i](i, layer, a), later)
            h, residual = add_norm(a, layer.post_attention_layernorm, residual)
            m, later = layer.mlp_conv.prepare(h)
            m = layer.mlp_conv.finish(layer.mlp(m), later)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < c.num_layers else self.norm
            h, residual = add_norm(m, nxt, residual)
        return h

    def stack(self, block_emb: torch.Tensor, mix: Any) -> torch.Tensor:
        raise NotImplementedError("flashtree/train trains DFlash drafts; a DFlash2 draft only runs (forward)")

    def proposal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over the draft's hidden -> the draft's logits: scaled, soft-capped."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def select_chain(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The selector's greedy path [D] after `anchor` (CandidateSelector.chain)."""
        return self.candidate_selector.chain(hidden, logits, anchor)

    def select_candidates(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's candidates after `anchor`, best first: log-probs and tokens [D, top_k]
        (CandidateSelector.candidates)."""
        return self.candidate_selector.candidates(hidden, logits, anchor)


def check_dflash2_tree(tree: str, mode: str, draft_config: Optional[object]) -> None:
    """`--dflash2-tree`: `topk` goes with anything; `selector` changes how ddtree builds a
    DFlash2 draft's tree and nothing else, so with another mode or draft it is refused
    (ConfigError) rather than silently ignored. The engine checks it from the configs, before
    any weight loads; a decoder checks it again from its draft."""
    if tree not in DFLASH2_TREES:
        raise ConfigError(f"dflash2_tree must be one of {', '.join(DFLASH2_TREES)}, got {tree!r}")
    if tree == "selector" and (mode != "ddtree" or not isinstance(draft_config, DFlash2Config)):
        what = "a DFlash2 draft" if isinstance(draft_config, DFlash2Config) else "no DFlash2 draft"
        raise ConfigError(f"--dflash2-tree selector builds a DFlash2 draft's ddtree: it needs --mode ddtree and a "
                          f"DFlash2 draft (here: --mode {mode}, {what})")
