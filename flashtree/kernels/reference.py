"""The plain-PyTorch definitions of the kernels' arithmetic: what every Triton kernel here must
compute, and what runs where Triton does not (the CPU, float32, training with autograd).

They match transformers' numerics (norms in float32 and cast back, rotate-half RoPE, SDPA), so a
model built on them is bit-compatible enough with the reference implementations to compare
logits in float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back to x's dtype before the weight, as transformers."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-row cos/sin [T, D] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def split_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], eps: float,
              heads: int, kv_heads: int, head_dim: int
              ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The packed projection qkv [T, (heads + 2 kv_heads) * D] -> q [T, heads, D] (None when
    heads == 0), k, v [T, kv_heads, D]; q and k RMSNormed per head (if norm weights are given)
    and rotated by the RoPE table rows at `positions`."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
        if heads:
            q = rms_norm(q, q_norm, eps)
    c, s = cos[positions], sin[positions]
    return (apply_rope(q, c, s) if heads else None), apply_rope(k, c, s), v


def split_gated_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int,
                    rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3.5's gated attention projection qkv [T, heads*2D + 2 kv_heads*D] (each query head's
    D values then its gate's D, then k, then v) -> q [T, heads, D], k, v [T, kv_heads, D] and
    sigmoid(gate) [T, heads*D]: q and k RMSNormed per head with zero-centered weights, their
    first `rotary_dim` dims rotated by the rows' cos/sin [T, rotary_dim]."""
    t, d = qkv.shape[0], head_dim
    qg, k, v = qkv.split([2 * heads * d, kv_heads * d, kv_heads * d], -1)
    q, gate = qg.view(t, heads, 2 * d).chunk(2, dim=-1)
    q = rms_norm_offset(q, q_norm, eps, 1.0)
    k = rms_norm_offset(k.view(t, kv_heads, d), k_norm, eps, 1.0)
    r = rotary_dim
    q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
    return q, k, v.view(t, kv_heads, d), torch.sigmoid(gate).reshape(t, -1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
         scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] (GQA), mask bool [T, S] (True = may attend) or None (all).
    Returns [T, Hq*D]."""
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if groups > 1:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def prefix_block_mask(prefix_len: int, block_mask: torch.Tensor) -> torch.Tensor:
    """[T, prefix_len + T] mask: every query sees the whole committed prefix, then `block_mask`
    (causal for prefill/chain, ancestors-and-self for a tree) inside the new block."""
    t = block_mask.shape[0]
    full = torch.ones(t, prefix_len + t, dtype=torch.bool, device=block_mask.device)
    full[:, prefix_len:] = block_mask
    return full


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm with the weight stored as an offset from `offset` (Qwen3.5 keeps it zero-centered:
    the scale is 1 + w), multiplied in float32 before the cast back, as transformers does."""
    if offset == 0.0:
        return rms_norm(x, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * silu(gate) per head (Gated DeltaNet's output norm), in float32 around the
    weight as transformers does."""
    dtype = x.dtype
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (normed * F.silu(gate.float())).to(dtype)


def causal_conv_windows(x: torch.Tensor, window: torch.Tensor, rows: Optional[torch.Tensor]
                        ) -> torch.Tensor:
    """The K inputs each new row's depthwise causal convolution sees, [T, K, C].

    x [T, C] are the new rows' inputs, `window` [K-1, C] the last K-1 committed inputs. Without
    `rows` the new rows are a sequence (row t follows row t-1). With `rows` [T, K] (a tree: see
    gated_delta.TreeIndex) row t sees the rows of cat(window, x) that `rows[t]` names: its own
    ancestor chain, topped up from the committed window."""
    full = torch.cat([window, x], dim=0)
    if rows is None:
        return full.unfold(0, window.shape[0] + 1, 1).transpose(1, 2)
    return full[rows]


def causal_conv(windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(sum_j windows[:, j] * weight[:, j]): windows [T, K, C], weight [C, K] -> [T, C]. One
    formula for every path, so a prefill, a chain and a tree compute identical outputs."""
    out = (windows * weight.t().unsqueeze(0)).sum(dim=1)
    return F.silu(out)


def delta_inputs(proj: torch.Tensor, window: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, key_heads: int, key_dim: int, value_dim: int,
                 rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A Gated DeltaNet layer's delta-rule inputs from its in_proj output proj [T, C + Hv*Dv + 2 Hv]
    (C = 2 Hk*Dk + Hv*Dv conv channels, then z, b, a): the causal conv over `window` [K-1, C] and
    the new rows (along `rows` for a tree, as causal_conv_windows), SiLU, q and k L2-normed per
    head (q scaled by Dk^-0.5) and repeated to the value heads, g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b). Returns float32 q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv],
    and the conv windows after the rows (in proj's dtype): [K-1, C], or [T, K-1, C] for a tree."""
    t, heads = proj.shape[0], a_log.shape[0]
    keys = key_heads * key_dim
    channels = conv_weight.shape[0]
    qkv, b, a = proj[:, :channels], proj[:, -2 * heads:-heads], proj[:, -heads:]
    windows = causal_conv_windows(qkv, window.to(qkv.dtype), rows)
    mixed = causal_conv(windows, conv_weight).to(proj.dtype)
    new_windows = windows[:, 1:] if rows is not None else windows[-1, 1:]
    q, k, v = mixed.split([keys, keys, channels - 2 * keys], dim=-1)
    q, k = (x.float().view(t, key_heads, key_dim) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / key_dim ** 0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = heads // key_heads
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    beta = b.sigmoid().float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    v = v.float().reshape(t, heads, value_dim)
    return q.contiguous(), k.contiguous(), v.contiguous(), g, beta, new_windows


def gated_delta_update(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule, float32: state [H, Dk, Dv] decays by exp(g) and the
    key's prediction error (v - state^T k) is written back scaled by beta. k [H, Dk]
    (normalised), v [H, Dv], g, beta [H]. (The token's output is then state^T q.)"""
    state = state * g.exp()[:, None, None]
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, parents: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T new rows, float32: q, k [T, H, Dk], v [T, H, Dv], g, beta
    [T, H], `state` [H, Dk, Dv] the committed one. Returns (outputs [T, H, Dv], the final state).
    Without `parents` the rows are a sequence. With `parents` [T] (-1: the committed state,
    else an earlier row) each row continues its parent's state (a tree: the parent-indexed
    scan), and the state returned is the last row's; any node's state is the fold of its path
    (`gated_delta_fold`), which repeats these very steps."""
    outs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    current = state
    for t in range(q.shape[0]):
        if parents is not None:
            p = int(parents[t])
            current = state if p < 0 else states[p]
        current = gated_delta_update(current, k[t], v[t], g[t], beta[t])
        outs.append((current * q[t].unsqueeze(-1)).sum(dim=-2))
        if parents is not None:  # a tree's later rows may continue this one
            states.append(current)
    return torch.stack(outs), current


def gated_delta_fold(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """The state after the rows k, v [T, H, D], g, beta [T, H] in order (a tree's accepted
    path) from `state`: the same steps as gated_delta_rule, without the outputs."""
    for t in range(k.shape[0]):
        state = gated_delta_update(state, k[t], v[t], g[t], beta[t])
    return state


INT4_RUN = 128  # int4 codes are laid out in runs of this many along in_features (unpack_codes)


def int4_runs(in_features: int) -> list[tuple[int, int, int]]:
    """(start, length, run) of the spans of int4's layout along in_features: whole runs of
    INT4_RUN, then what remains (a multiple of 4) as one shorter run; empty spans left out."""
    whole = in_features - in_features % INT4_RUN
    spans = [(0, whole, INT4_RUN), (whole, in_features - whole, in_features - whole)]
    return [span for span in spans if span[1]]


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes [..., in or in / 2] -> one uint8 code per weight [..., in]. Int8 codes are
    stored as they are. Int4 codes are two per byte along in_features in runs of INT4_RUN (a
    shorter last run of T where in_features is no multiple of it): a run of T codes is T / 4
    little-endian 16-bit words, and word i holds the run's codes i, T/4 + i, 2T/4 + i, 3T/4 + i in
    its nibbles from the lowest (bits 0-3, 4-7, 8-11, 12-15). The GEMM's layout
    (kernels/triton_quant.py): nibble r of a run's words is T/4 consecutive codes."""
    if bits == 8:
        return codes
    lead = codes.shape[:-1]
    parts = []
    for start, length, run in int4_runs(2 * codes.shape[-1]):
        b = codes[..., start // 2:(start + length) // 2].reshape(*lead, length // run, run // 4, 2)
        nibbles = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # [..., runs, word, r]
        parts.append(nibbles.transpose(-1, -2).reshape(*lead, length))
    return torch.cat(parts, dim=-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor], bits: int, group: int,
               dtype: torch.dtype, table: Optional[torch.Tensor] = None,
               superscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight a group-wise quantized linear stands for, W[o, i] = code[o, i] * scale[o, i //
    group] + minimum[o, i // group], or with a `table` (float32 [16]; models/quant.py's table
    layout, no minimum) W[o, i] = table[code[o, i]] * scale[o, i // group], times
    superscale[o, i // group // S] where given (IQ4_XS's two levels, S groups a super-scale);
    computed in float32 (exact for float16 scales and codes below 2**11, and for the table's
    products, as gguf's dequantizer computes them) and cast to `dtype`."""
    out_f, groups = scale.shape
    s = scale.float()
    if superscale is not None:
        s = s * superscale.float().repeat_interleave(groups // superscale.shape[1], dim=1)
    s = s[..., None]
    if table is not None:  # the lookup's int32 indices are freed before the product, made in place
        w = table[unpack_codes(codes, bits).int()].view(out_f, groups, group).mul_(s)
    else:
        w = unpack_codes(codes, bits).float().view(out_f, groups, group) * s + minimum.float()[..., None]
    return w.view(out_f, groups * group).to(dtype)


TILE_ROWS = 64  # rows of a tile of the GEMM's tiled placement (tile_rows)


def tile_rows(a: torch.Tensor, unit: int, inverse: bool = False) -> torch.Tensor:
    """A matrix [N, C] (row major) with each block of TILE_ROWS rows (the last one R = N mod
    TILE_ROWS rows, if any) stored unit-major: the block's unit u (columns u * unit to (u + 1) *
    unit - 1) of all its rows, row after row, then unit u + 1. Same shape, same bytes, another
    order: one step of a GEMM program of 64 rows reads one contiguous piece instead of 64
    (int4 codes in units of a run, 64 bytes; scales and minima in units of a run's groups, int4_scale_unit; models/
    quant.py `tile_for_kernels`). A block of rows stays whole, so rows [a, b) with a and b
    multiples of TILE_ROWS (or b = N) are again a tiled matrix. `inverse` undoes it."""
    n, cols = a.shape
    out = torch.empty_like(a)
    full = n - n % TILE_ROWS
    for start, rows in ((0, full), (full, n - full)):
        if not rows:
            continue
        block = min(rows, TILE_ROWS)
        row_major = (rows // block, block, cols // unit, unit)
        tiled = (rows // block, cols // unit, block, unit)
        src = a[start:start + rows].reshape(tiled if inverse else row_major)
        out[start:start + rows] = src.transpose(1, 2).reshape(rows, cols)
    return out


def int4_scale_unit(group: int) -> int:
    """The scales (and minima) of tiled int4 in units of a run's groups (1 for groups of a run or
    more): the GEMM loads a run's as one contiguous piece a row, which Triton's pipeliner stages
    (read one group at a time, 2 bytes a row, they were synchronous loads in its loop)."""
    return max(1, INT4_RUN // group)


def tile_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
              inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """An int4 linear's codes (in units of a run, INT4_RUN / 2 bytes), scales and minima (in units
    of int4_scale_unit; a table layout has none) in tile_rows' order, or back with `inverse`."""
    unit = int4_scale_unit(2 * codes.shape[1] // scale.shape[1])
    return (tile_rows(codes, INT4_RUN // 2, inverse), tile_rows(scale, unit, inverse),
            None if minimum is None else tile_rows(minimum, unit, inverse))


DEQUANT_CHUNK = 1 << 24  # weights quant_linear dequantizes at a time


def dequant_scratch_bytes() -> int:
    """What quant_linear's dequantization of one chunk holds at its peak, three float32 copies of
    it (the codes as floats, their product with the scales, that plus the minimums); the memory
    plan counts it in prefill."""
    return DEQUANT_CHUNK * 3 * 4


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], bits: int, group: int, table: Optional[torch.Tensor] = None,
                 superscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W the dequantized weight (`dequantize`, with its `table` and
    `superscale` if any): the definition of the quantized GEMV/GEMM, the CPU path and the CUDA path of prefill
    chunks. W is dequantized DEQUANT_CHUNK weights (whole output rows) at a time: a 27B's
    gate/up projection in one piece would need 2 GB of float32 temporaries beside the weights."""
    out_f = scale.shape[0]
    rows = max(1, DEQUANT_CHUNK // (scale.shape[1] * group))
    if rows >= out_f:
        return F.linear(x, dequantize(codes, scale, minimum, bits, group, x.dtype, table, superscale), bias)
    out = x.new_empty(*x.shape[:-1], out_f)
    for start in range(0, out_f, rows):
        part = slice(start, min(start + rows, out_f))
        weight = dequantize(codes[part], scale[part], None if minimum is None else minimum[part], bits, group,
                            x.dtype, table, None if superscale is None else superscale[part])
        out[..., part] = F.linear(x, weight, None if bias is None else bias[part])
    return out
