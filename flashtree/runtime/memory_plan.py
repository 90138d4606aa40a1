"""The start-up memory plan: every large buffer's bytes, computed from the configs before anything
is allocated, against the memory the device has free. A configuration that cannot fit is refused
with the numbers and the knobs that would make it fit, instead of failing later mid-request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from ..models.dflash import DraftConfig
from ..models.common import LayerShape
from ..models.qwen3 import LMConfig
from ..models.qwen35 import HybridCausalLM, HybridConfig

GiB = 1024 ** 3


def layers_param_count(c: LayerShape, qk_norm: bool) -> int:
    """Weights of all decoder layers: q/k/v/o, the SwiGLU MLP, two norms (+ per-head q/k norms)."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    per_layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return c.num_layers * (per_layer + (2 * c.head_dim if qk_norm else 0))


def lm_param_count(c: LMConfig) -> int:
    embed = c.vocab_size * c.hidden_size
    return embed * (1 if c.tie_word_embeddings else 2) + layers_param_count(c, c.qk_norm) + c.hidden_size


def hybrid_param_count(c: HybridConfig) -> int:
    """Counted on a meta-device instance: no memory, and exact for any mix of layer types."""
    with torch.device("meta"):
        model = HybridCausalLM(c, 1)
    return sum(p.numel() for p in model.parameters())


def draft_param_count(c: DraftConfig) -> int:
    return layers_param_count(c, True) + len(c.target_layer_ids) * c.hidden_size ** 2 + 2 * c.hidden_size


@dataclass
class MemoryPlan:
    items: list[tuple[str, int]]
    free: Optional[int]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)

    def describe(self) -> str:
        rows = [f"  {name:<34} {b / GiB:8.3f} GiB" for name, b in self.items]
        rows.append(f"  {'total':<34} {self.total / GiB:8.3f} GiB")
        if self.free is not None:
            rows.append(f"  {'free on the device':<34} {self.free / GiB:8.3f} GiB")
        return "\n".join(rows)


def free_memory(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_plan(lm: "LMConfig | HybridConfig", draft: Optional[DraftConfig], dtype: torch.dtype,
              device: torch.device, capacity: int, budget: int, block_size: int, prefill_ubatch: int,
              prefix_cache_bytes: int, state_checkpoints: int = 0) -> MemoryPlan:
    size = torch.tensor([], dtype=dtype).element_size()
    hybrid = isinstance(lm, HybridConfig)
    attn_layers = len(lm.attention_layers) if hybrid else lm.num_layers
    kv_row = 2 * attn_layers * lm.num_kv_heads * lm.head_dim * size
    weights = hybrid_param_count(lm) if hybrid else lm_param_count(lm)
    items = [("target weights", weights * size),
             (f"target KV ({capacity} rows)", capacity * kv_row)]
    if hybrid:  # float32 recurrent state + conv window per DeltaNet layer, per copy of them
        layers, heads = len(lm.linear_layers), lm.linear_value_heads
        window = (lm.conv_kernel - 1) * lm.conv_channels * size
        states = layers * (heads * lm.linear_key_dim * lm.linear_value_dim * 4 + window)
        per_node = layers * (window + heads * (lm.linear_key_dim + lm.linear_value_dim + 2) * 4)
        nodes = max(budget + 1, block_size)
        items += [("recurrent states (live + pending)", 2 * states),
                  (f"tree nodes' delta-rule inputs ({nodes})", nodes * per_node),
                  (f"recurrent state checkpoints ({state_checkpoints})", state_checkpoints * states)]
    draft_row = 0
    if draft is not None:
        draft_row = 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * size
        items += [("draft weights", draft_param_count(draft) * size),
                  (f"draft KV ({capacity} rows)", capacity * draft_row)]
    tree = budget + 1
    hidden_act = lm.hidden_size * 6 + lm.intermediate_size * 3 + lm.num_heads * lm.head_dim * 3
    items.append((f"verify buffers ({tree} nodes)", tree * (hidden_act * size + lm.vocab_size * 8)
                  + (block_size * lm.vocab_size * 8 if draft is not None else 0)))
    scratch = prefill_ubatch * hidden_act * size + lm.vocab_size * 4
    if device.type == "cpu":  # the math attention path materialises scores for a chunk
        scratch += lm.num_heads * prefill_ubatch * capacity * 4
    items.append((f"prefill scratch (ubatch {prefill_ubatch})", scratch))
    items.append(("prefix cache, device tier (budget)", prefix_cache_bytes))
    return MemoryPlan(items, free_memory(device))


def check_plan(plan: MemoryPlan, max_ctx: int, prefill_ubatch: int) -> None:
    if plan.free is None or plan.total <= plan.free:
        return
    raise ConfigError(
        "this configuration does not fit in memory:\n" + plan.describe() +
        f"\nshort by {(plan.total - plan.free) / GiB:.3f} GiB; try a smaller --max-ctx (now {max_ctx}), "
        f"--prefill-ubatch (now {prefill_ubatch}), --budget or --prefix-cache-bytes, or a float16/bfloat16 --dtype")
