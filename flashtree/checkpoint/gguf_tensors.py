"""A GGUF file's tensors under transformers' names and in transformers' layout.

llama.cpp's converter renames every tensor (`model.layers.3.self_attn.q_proj.weight` ->
`blk.3.attn_q.weight`) and, for its own kernels, changes some of them. Each change is undone
here, so the loaded weights equal the HF checkpoint's (up to the float rounding of the
arithmetic ones) and the model modules load them unchanged:

- llama: the rows of q_proj / k_proj are permuted within each head (interleaved RoPE pairs
  instead of HF's rotate-half halves);
- qwen35: the zero-centred RMSNorm weights are stored as 1 + w (all but the gated norm of the
  linear attention; the MTP layer's too), A_log as -exp(A_log), dt_bias under `ssm_dt.bias`, the
  conv1d weight [C, 1, K] squeezed to [C, K], and, where there are more value heads than key
  heads, the value heads reordered from grouped-by-key-head to tiled (rows of in_proj_qkv's V
  part, in_proj_z, in_proj_a/b, the conv's V channels, A_log, dt_bias; columns of out_proj).

Dense weights are dequantized with `gguf.quants.dequantize`. A 2-D linear weight in a quantized
type (or the embedding table) can instead be handed, still quantized, to a hook (QuantizedTensor: its blocks with the row
reorders already applied, and the column order still to apply). Torch-free (numpy).

A qwen35 file may carry the checkpoint's multi-token-prediction layer (`mtp.*`) as one extra block
after the decoder layers, as llama.cpp's converter writes it: `{arch}.nextn_predict_layers` 1,
`block_count` one more than the layers, and in block N = the layer count `blk.N.nextn.eh_proj`
(`mtp.fc`, [hidden, 2 * hidden] with the embedding's columns first, as HF's), `.nextn.enorm`
(`mtp.pre_fc_norm_embedding`), `.nextn.hnorm` (`mtp.pre_fc_norm_hidden`), `.nextn.shared_head_norm`
(`mtp.norm`), all norms 1 + w, beside the usual tensors of its one full-attention layer
(`mtp.layers.0.*`). A target never reads that block; `--draft mtp` reads only it (`mtp=True`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .gguf_draft import draft_config_json, is_draft
from .gguf_file import GGUFFile, hf_config

# GGUF tensor name (after `blk.N.`) -> transformers name (after `model.layers.N.`)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
CONSUMED = ("rope_freqs.weight",)  # read into the config (gguf_file._rope), not a weight
# the MTP layer's own tensors (blk.N.nextn.*) -> its names in models/mtp.py (the checkpoint's after `mtp.`)
NEXTN_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
               "shared_head_norm": "norm"}
NEXTN_NAME = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.weight$")
# copies of the target's embedding and lm_head some converters put in a nextn block: the draft uses the target's
NEXTN_SKIPPED = (".nextn.embed_tokens.weight", ".nextn.shared_head_head.weight")
# qwen35 norms the converter stored as 1 + w (all RMSNorms but the linear attention's gated one)
OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                *(f"nextn.{n}.weight" for n in ("enorm", "hnorm", "shared_head_norm")))
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS",
                   "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
DENSE_TYPES = ("F32", "F16", "BF16")
# a draft's (checkpoint/gguf_draft.py): GGUF name -> the z-lab checkpoint's, every spelling published
DRAFT_GLOBAL_NAMES = {
    "fc.weight": "fc.weight", "dflash.fc.weight": "fc.weight", "dflash_fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight", "dflash.hidden_norm.weight": "hidden_norm.weight",
    "dflash_hidden_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
}
DRAFT_LAYER_NAMES = {**{k: v for k, v in LAYER_NAMES.items() if v.startswith(("self_attn.", "mlp.")) or k in
                        ("attn_norm", "ffn_norm", "post_attention_norm")},
                     "attn_conv_proj": "attention_conv.kernel_projection",
                     "ffn_conv_proj": "mlp_conv.kernel_projection"}
DRAFT_CONV_BASE = re.compile(r"blk\.(\d+)\.(attn|ffn)_conv_base$")
DRAFT_SKIPPED = ("token_embd.weight", "output.weight")  # the target's, which a draft uses: not read
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
BLOCK_PARAM = re.compile(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)$")
BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


@dataclass
class QuantizedTensor:
    """A 2-D linear weight still in its GGUF blocks. `blocks` uint8 [out_features, bytes per
    row], rows already in HF order; HF column j is stored column `column_order[j]` (None: the
    same order). `shape` is the HF (out_features, in_features)."""

    name: str
    qtype: str
    blocks: np.ndarray
    shape: tuple[int, int]
    column_order: Optional[np.ndarray]


QuantHook = Callable[[QuantizedTensor], Any]


def hf_name(gguf_name: str) -> Optional[str]:
    """The transformers name of a GGUF tensor; None: not a tensor of the supported architectures."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_PARAM.match(gguf_name)
    if m:
        return f"model.layers.{m[1]}.linear_attn." + ("A_log" if m[2] == "ssm_a" else "dt_bias")
    m = BLOCK_NAME.match(gguf_name)
    if m and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
    return None


def draft_name(gguf_name: str) -> Optional[str]:
    """The z-lab checkpoint's name of a draft's GGUF tensor; None: not a draft's tensor."""
    if gguf_name in DRAFT_GLOBAL_NAMES:
        return DRAFT_GLOBAL_NAMES[gguf_name]
    m = DRAFT_CONV_BASE.match(gguf_name)
    if m:
        return f"layers.{m[1]}.{'attention' if m[2] == 'attn' else 'mlp'}_conv.base_kernel"
    m = BLOCK_NAME.match(gguf_name)
    if m and m[2] in DRAFT_LAYER_NAMES:
        return f"layers.{m[1]}.{DRAFT_LAYER_NAMES[m[2]]}.{m[3]}"
    return None


def mtp_name(gguf_name: str) -> Optional[str]:
    """The MTP draft's name (models/mtp.py: the checkpoint's after `mtp.`) of a tensor of the
    nextn block: its own tensors by NEXTN_NAMES, its layer's as `layers.0.*`; None: neither."""
    m = NEXTN_NAME.match(gguf_name)
    if m:
        return f"{NEXTN_NAMES[m[2]]}.weight" if m[2] in NEXTN_NAMES else None
    name = hf_name(gguf_name)
    return "layers.0." + name.split(".", 3)[3] if name and name.startswith("model.layers.") else None


def is_read(name: str, layers: int, draft: bool = False, mtp: bool = False) -> bool:
    """Whether the loader reads tensor `name` of a file whose model has `layers` decoder layers:
    a target or a draft reads none of the blocks after them (a multi-token-prediction layer), nor
    what the config takes in (`rope_freqs`) and a draft's copies of the target's tensors; the MTP
    draft (`mtp`) reads block `layers` alone (one layer: models/mtp.py refuses more), but the
    copies of the target's embedding and lm_head some converters put there."""
    block = BLOCK_INDEX.match(name)
    if mtp:
        return block is not None and int(block[1]) == layers and not name.endswith(NEXTN_SKIPPED)
    skipped = (CONSUMED + DRAFT_SKIPPED) if draft else CONSUMED
    return name not in skipped and not (block and int(block[1]) >= layers)


def mtp_layer(g: GGUFFile) -> bool:
    """Whether the file carries a multi-token-prediction layer (`{arch}.nextn_predict_layers`
    above 0); one whose block lacks a nextn tensor is refused, naming it."""
    nextn = g.integer("{arch}.nextn_predict_layers", 0, least=0)
    if nextn:
        block = g.integer("{arch}.block_count") - nextn
        for name in NEXTN_NAMES:
            g.tensor(f"blk.{block}.nextn.{name}.weight")
    return nextn > 0


def rope_pair_rows(heads: int, head_dim: int) -> np.ndarray:
    """The GGUF rows of HF's q/k rows for llama: the converter interleaved each head's two
    rotate-half halves (row h*D + 2i + j holds HF row h*D + j*D/2 + i)."""
    return np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def grouped_heads(key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """The stored indices of HF's value-head rows for qwen35: HF groups the value heads by key
    head ([k0v0, k0v1, k1v0, ...]); the converter tiled them ([k0v0, k1v0, k0v1, ...])."""
    tiled = np.arange(key_heads * per_key * head_dim).reshape(per_key, key_heads, head_dim)
    return tiled.transpose(1, 0, 2).reshape(-1)


COLUMN_ORDERED = ("linear_attn.out_proj.weight",)  # the tensors whose columns a Layout may reorder


class Layout:
    """The row and column orders that take one file's stored tensors back to HF's layout."""

    def __init__(self, g: GGUFFile, cfg: dict[str, Any]):
        self.arch, self.cfg = g.arch, cfg
        self.value_groups: Optional[tuple[int, int]] = None  # (key heads, value heads per key head)
        if g.arch == "qwen35" and cfg["linear_num_value_heads"] != cfg["linear_num_key_heads"]:
            keys = cfg["linear_num_key_heads"]
            self.value_groups = (keys, cfg["linear_num_value_heads"] // keys)

    def _values(self, head_dim: int) -> Optional[np.ndarray]:
        return None if self.value_groups is None else grouped_heads(*self.value_groups, head_dim)

    def rows(self, name: str) -> Optional[np.ndarray]:
        """The stored row of each HF row of tensor `name` (HF name), or None: the same."""
        c = self.cfg
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            return rope_pair_rows(c["num_attention_heads"], c["head_dim"])
        if self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            return rope_pair_rows(c["num_key_value_heads"], c["head_dim"])
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            order = self._values(c["linear_value_head_dim"])
            if order is None:
                return None
            qk = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
            return np.concatenate([np.arange(qk), qk + order])
        if name.endswith("in_proj_z.weight"):
            return self._values(c["linear_value_head_dim"])
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return self._values(1)
        return None

    def columns(self, name: str) -> Optional[np.ndarray]:
        if name.endswith(COLUMN_ORDERED):
            return self._values(self.cfg["linear_value_head_dim"])
        return None


def _dense(name: str, array: np.ndarray, g: GGUFFile, gguf_name: str) -> np.ndarray:
    """The value transforms of a dequantized tensor (row/column orders already applied)."""
    if g.arch != "qwen35":
        return array
    if gguf_name.endswith(OFFSET_NORMS) or gguf_name == "output_norm.weight":
        return array - np.float32(1.0)
    if name.endswith("A_log"):
        return np.log(-array)
    if name.endswith("conv1d.weight"):
        return array[:, None, :]  # [C, K] -> nn.Conv1d's [C, 1, K]
    return array


def _hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of a tensor stored in `shape` (numpy order): the conv taps were squeezed."""
    return (shape[0], 1, shape[1]) if name.endswith("conv1d.weight") and len(shape) == 2 else shape


def _config(g: GGUFFile) -> dict[str, Any]:
    return draft_config_json(g) if is_draft(g) else hf_config(g)


def _naming(g: GGUFFile, mtp: bool) -> Callable[[str], Optional[str]]:
    """GGUF name -> the name read_tensors gives the tensor (None: not one it reads)."""
    return mtp_name if mtp else draft_name if is_draft(g) else hf_name


def file_names(g: GGUFFile, mtp: bool = False) -> dict[str, str]:
    """The name read_tensors gives each tensor it reads -> the file's own name for it
    (`model.embed_tokens.weight` -> `token_embd.weight`), for errors that name what the file holds."""
    layers, draft, name_of = _config(g)["num_hidden_layers"], is_draft(g), _naming(g, mtp)
    names = {}
    for t in g.tensors.values():
        name = name_of(t.name) if is_read(t.name, layers, draft, mtp) else None
        if name is not None:
            names[name] = t.name
    return names


def column_orders(g: GGUFFile, mtp: bool = False) -> Callable[[str], Optional[np.ndarray]]:
    """The column order read_tensors hands a tensor (by GGUF name) over with (None: none), for the
    memory plan; the file's config is read only for a tensor that may have one (COLUMN_ORDERED)."""
    name_of = _naming(g, mtp)
    layout = functools.cache(lambda: Layout(g, _config(g)))

    def order(gguf_name: str) -> Optional[np.ndarray]:
        name = name_of(gguf_name)
        return layout().columns(name) if name is not None and name.endswith(COLUMN_ORDERED) else None
    return order


def read_tensors(g: GGUFFile, quantized: Optional[QuantHook] = None,
                 shapes: Optional[dict[str, tuple[int, ...]]] = None, mtp: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 array in HF layout) for every weight the loader reads (is_read), one at
    a time (a draft's under its z-lab checkpoint's names, draft_name; with `mtp`, a target's MTP
    layer under the MTP draft's, mtp_name); with `quantized`, a 2-D linear weight in a quantized
    type yields `quantized(QuantizedTensor)`.
    With `shapes` (the model's HF shape of each weight its config implies), a tensor it does not
    name or holds in another shape is an error naming the tensor, raised before its rows are
    reordered by the config's head counts (which would index past a short tensor)."""
    from gguf.quants import dequantize

    draft = is_draft(g)
    cfg = _config(g)
    name_of, layout = _naming(g, mtp), Layout(g, cfg)
    for t in g.tensors.values():
        if not is_read(t.name, cfg["num_hidden_layers"], draft, mtp):
            continue
        name, qtype = name_of(t.name), t.kind.name
        if name is None:
            raise g.error(t.name, "not a tensor of the supported architectures")
        if qtype not in SUPPORTED_TYPES:
            raise g.error(t.name, f"has type {qtype}; supported types: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(reversed(t.shape))
        if shapes is not None and shapes.get(name) != _hf_shape(name, shape):
            implied = f"the config implies {shapes[name]}" if name in shapes else "the model has no such weight"
            raise g.error(t.name, f"holds {name} in shape {_hf_shape(name, shape)}; {implied}")
        rows = layout.rows(name)
        data = g.data(t) if rows is None else g.data(t)[rows]
        # every matrix but the conv taps is a linear weight or the embedding table, which the
        # loader keeps quantized alike (rows of codes: a lookup dequantizes the rows it reads)
        grouped = len(shape) == 2 and not name.endswith("conv1d.weight")
        if quantized is not None and grouped and qtype not in DENSE_TYPES:
            yield name, quantized(QuantizedTensor(name, qtype, np.ascontiguousarray(data), shape,
                                                  layout.columns(name)))
            continue
        try:
            array = dequantize(data, t.kind).astype(np.float32, copy=False).reshape(shape)
        except (ValueError, NotImplementedError) as e:
            raise g.error(t.name, f"cannot dequantize its {qtype} data: {e}") from None
        columns = layout.columns(name)
        if columns is not None:
            array = array[:, columns]
        yield name, _dense(name, array, g, t.name)
