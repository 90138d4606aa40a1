"""The multi-token-prediction (MTP) layer that Qwen3.5 / 3.6 / 3.8 checkpoints ship under `mtp.*`,
as a draft (`--draft mtp`).

Definition (Qwen3-Next / Qwen3.5 MTP, as vLLM, SGLang and LMDeploy run it): for position p,
with e = the target's embedding of token p+1 and h = the target's final-normed hidden state at p,

    x = fc(concat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)))      (embedding first)
    o = norm(layer(x))                                                   (one decoder layer)

and lm_head(o) (the target's) predicts token p+2. The layer is the target's full-attention
layer type (gated attention, RoPE on the rotary part of each head, the model's MoE MLP for a
MoE checkpoint) with its own KV cache; every norm is zero-centred (scale 1 + weight). Names:
`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.0.*` (the target layers' names), `mtp.norm.weight`; config `mtp_num_hidden_layers`.
A GGUF target carries them as its nextn block (checkpoint/gguf_tensors.py reads them under these
names, `mtp.` stripped).

As a draft, the row of position p needs token p+1, so the cache's rows [0, L-1) of a sequence of
L committed tokens are context, and row L-1 (its token is the pending bonus) is written by each
draft before it is read, and again by each commit: it never holds a stale row that is read. The
target's hidden at L-1 (`MTPCache.hidden`) is carried between commits as a state of the sequence,
saved with checkpoints and snapshots like a recurrent state (the MTP serves hybrid targets,
whose state goes back only to those). A draft proposes a chain: step k feeds the previous step's
argmax token and its own output o as the hidden (step 1: the bonus and the carried target
hidden), one row each, so depth d's distribution is conditioned on the draft's top-1 path to
depth d-1; DDTree branches on those per-depth distributions as it does on DFlash's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..checkpoint.gguf_file import is_gguf, open_gguf
from ..checkpoint.gguf_tensors import mtp_layer
from ..checkpoint.weights import tensor_names
from ..errors import CheckpointError, ConfigError
from .common import Mix, RMSNorm, run_stack
from .rope import RotaryTable
from .inputs import ForwardInput
from .qwen35 import FULL, HybridConfig, HybridLayer
from .kv_cache import KVCache, PoolArg

PREFIX = "mtp."
DEFAULT_BLOCK = 4  # the bonus and 3 proposed tokens: a 1-layer head's acceptance falls fast with depth


@dataclass
class MTPConfig(HybridConfig):
    """The target's shape with the MTP's layers (one full-attention layer), the draft's block
    and the target layer whose output (final-normed) the MTP reads: the last."""

    block_size: int = DEFAULT_BLOCK
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0  # no mask token: a chain starts from the bonus (the decoder reads the field)

    @classmethod
    def of_target(cls, raw: dict[str, Any], target: HybridConfig, source: Path) -> "MTPConfig":
        """The MTP of a hybrid target whose checkpoint at `source` ships `mtp.*` weights, or whose
        GGUF file carries them as its nextn block (checkpoint/gguf_tensors.py); anything else is a
        ConfigError naming why --draft mtp cannot run (a nextn block without one of its tensors:
        a CheckpointError naming the tensor)."""
        if not isinstance(target, HybridConfig):
            raise ConfigError(f"--draft mtp needs a Qwen3.5 / 3.6 target (model_type {target.model_type!r} "
                              "has no multi-token-prediction layer)")
        if is_gguf(source):
            if not mtp_layer(open_gguf(source)):
                raise ConfigError(f"--draft mtp: the GGUF file {source} has no MTP layer (no nextn_predict_layers "
                                  "and blk.N.nextn.* tensors): it was converted without it")
        else:
            try:
                names: Optional[list[str]] = tensor_names(source)
            except CheckpointError:  # a config fetched alone (flashtree plan of a repo id): no weights to look at
                names = None
            if names is not None and not any(n.startswith(PREFIX) for n in names):
                raise ConfigError(f"--draft mtp: the checkpoint {source} has no MTP weights (mtp.*): its "
                                  "multi-token-prediction layer was not published or was stripped by a conversion")
        return cls.of_config(raw, target)

    @classmethod
    def of_config(cls, raw: dict[str, Any], target: HybridConfig) -> "MTPConfig":
        """The MTP layer that the config.json `raw` (its target's config: `target`) declares,
        from the config alone (`flashtree bench` gives a random-weight preset one); one that
        flashtree cannot run is a ConfigError naming the key."""
        text = raw.get("text_config") or raw
        layers = int(text.get("mtp_num_hidden_layers") or 1)
        if layers != 1:
            raise ConfigError(f"--draft mtp: mtp_num_hidden_layers {layers} is not supported (1 is)")
        if text.get("mtp_use_dedicated_embeddings"):  # published Qwen3.5 / 3.6 / 3.8 checkpoints: false
            raise ConfigError("--draft mtp: mtp_use_dedicated_embeddings is true: an MTP layer with its own "
                              "embedding table is not supported (this one reads the target's)")
        shape = {f.name: getattr(target, f.name) for f in fields(HybridConfig)}
        shape.update(num_layers=1, layer_types=[FULL])
        return cls(**shape, target_layer_ids=[target.num_layers - 1])


class MTPCache(KVCache):
    """The MTP layer's K/V rows, and `hidden` [1, H]: the target's final-normed hidden at the last
    committed position, which the next commit's first row and the next draft's first step read.
    It is a value of the sequence at its length, so `states()` hands it to checkpoints and
    snapshots, and `preserved()` puts it back after a captured phase's warm-up runs. A commit's
    rows leave the new one in `pending` and the commit adopts it (`adopt`), so a step that fails
    before its commit leaves the carried hidden as it was."""

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_type: Optional[str] = None, pool: PoolArg = None):
        super().__init__(1, capacity, kv_heads, head_dim, dtype, device, kv_type, pool=pool)
        self.hidden = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.pending = torch.zeros_like(self.hidden)

    def adopt(self) -> None:
        self.hidden.copy_(self.pending)

    def states(self) -> dict[str, torch.Tensor]:
        return {"mtp_hidden": self.hidden}

    @contextlib.contextmanager
    def preserved(self) -> Iterator[None]:
        saved = self.hidden.clone()
        try:
            yield
        finally:
            self.hidden.copy_(saved)


class MTPDraft(nn.Module):
    """The MTP layer over rows [embedding of the next token | the hidden it follows] (a
    ForwardInput's `embeds`, [T, 2H]); the embedding and lm_head are the target's."""

    def __init__(self, c: MTPConfig, max_pos: int):
        super().__init__()
        self.config = c
        h = c.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, c.rms_norm_eps, offset=1.0)
        self.pre_fc_norm_hidden = RMSNorm(h, c.rms_norm_eps, offset=1.0)
        self.layers = nn.ModuleList([HybridLayer(c, FULL)])
        self.norm = RMSNorm(h, c.rms_norm_eps, offset=1.0)
        self.rope = RotaryTable(c.rotary_dim, c.rope, max_pos)

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str,
                  kv_type: Optional[str] = None, pool: PoolArg = None) -> MTPCache:
        c = self.config
        return MTPCache(capacity, c.num_kv_heads, c.head_dim, c.hidden_size, dtype, device, kv_type, pool)

    def forward(self, inp: ForwardInput) -> torch.Tensor:
        """`inp.embeds` [T, 2H] at `inp.row_positions()`: their K/V go to rows [length, length + T)
        of `inp.cache` (an MTPCache), each row attends to the rows before it (causal). Returns
        the final-normed output [T, H]: the next step's hidden, and lm_head's input."""
        e, h = inp.embeds.chunk(2, dim=-1)  # type: ignore[union-attr]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))
        out, _ = run_stack(self.layers, x, self.norm, self._mixer(inp))
        return out

    def write_context(self, inp: ForwardInput) -> None:
        """Committed rows' K/V (the caller commits them): the forward, its output unused."""
        self(inp)

    def _mixer(self, inp: ForwardInput) -> Mix:
        rope = self.rope(inp.row_positions())

        def mix(i: int, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            attn = layer.self_attn
            return attn.o_proj(attn.attend(attn.qkv_proj(h), rope, inp.cache, i, inp.lengths, inp.block_mask))

        return mix
