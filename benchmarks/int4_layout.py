"""Does the int4 GEMM's bandwidth depend on where its bytes lie? The engine's int4 codes are row
major ([N, K/4] int16 words, a run of 128 codes = 64 bytes of a row), scales and minima [N, K/128]
float16 each, so one step of a 64-row program reads 64 scattered 64-byte pieces of codes and 128
scattered 2-byte scales. This times, on the 27B's linears at M = 1 and 23, the GEMM as it is
against the same arithmetic over a tiled layout (each program's step one contiguous 4 KB of codes
and 256 contiguous bytes of scale and minimum), and load-only kernels of both layouts (what the
access pattern alone allows), against the copy bandwidth of the same run. Every variant's output
is checked against the engine's (bit for bit: the same arithmetic in the same order) and the
definition. `totals` weights each shape by its layers in a 27B step.

Measured on the H200 (results/int4_layout_h200.json, docs/PERFORMANCE.md): over a 27B step's int4
linears the tiled layout at the engine's launches takes 5.98 ms against the engine's 6.79 at one
row (floor 3.04) and 7.32 against 8.11 at 23; loads alone reach 85% of the copy bandwidth tiled
and 42% row-major on gate_up's shape (76% and 34% over the step's shapes). `_tiled_gemm_kernel`
is the prototype of that layout for the engine's GEMM (group 128 only; not in the engine yet).

    python benchmarks/int4_layout.py [--iters 20]

Writes benchmarks/results/int4_layout_<device>.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gemv import SHAPES, make_weights, per_call_us, quant_bytes  # noqa: E402

from flashtree.bench.measure import ceilings  # noqa: E402
from flashtree.bench.provenance import provenance  # noqa: E402
from flashtree.kernels.reference import quant_linear as reference  # noqa: E402
from flashtree.kernels.triton_quant import (QUAD_PTX, SCALE_PTX, gemm, gemm_launch, quad_values,  # noqa: E402
                                            scaled_codes)
from flashtree.kernels.triton_split import MAX_SPLIT, split_for, split_outputs, store_split  # noqa: E402

TILE = 64  # rows of a tile of the tiled layout (the kernels' addresses are written for 64)
GROUP = 128


def tiled(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K/2] uint8 (row layout) -> int16 words [N/TILE, K/128, TILE, 32]; scale and minimum
    [N, K/128] -> [N/TILE, K/128, 2, TILE] (a step's scales, then its minima)."""
    n, steps = scale.shape
    words = codes.view(torch.int16).view(n // TILE, TILE, steps, 32).permute(0, 2, 1, 3).contiguous()
    sm = torch.stack([scale, minimum]).view(2, n // TILE, TILE, steps).permute(1, 3, 0, 2).contiguous()
    return words, sm


@triton.jit
def _scales(SM, rn, N, n_steps, t, t_hi, TILED: tl.constexpr):
    """Step t's scale and minimum of rows rn (zeros past t_hi)."""
    ok = (rn * 0 + t) < t_hi
    if TILED:
        at = ((rn // 64) * n_steps + t) * 128 + rn % 64
        return tl.load(SM + at, mask=ok, other=0.0), tl.load(SM + at + 64, mask=ok, other=0.0)
    ok = ok & (rn < N)
    return (tl.load(SM + rn * n_steps + t, mask=ok, other=0.0),
            tl.load(SM + N * n_steps + rn * n_steps + t, mask=ok, other=0.0))


@triton.jit
def _tiled_gemm_kernel(X, C, SM, OUT, P, LOCKS, M, N, K, stride_xm, stride_om, stride_p,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr, SPTX: tl.constexpr,
                       TILED: tl.constexpr):
    """The engine's int4 GEMM (group 128 = one run a step, inline PTX) with its codes, scales and
    minima at tiled addresses (TILED 1), its codes alone tiled (2) or all row-major (0: the engine's
    layout, for a same-code check)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    n_steps = K // 128
    per_split = tl.cdiv(n_steps, tl.num_programs(1))
    t_lo = tl.program_id(1) * per_split
    t_hi = tl.minimum(t_lo + per_split, n_steps)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    j = tl.arange(0, 32)
    s_next, m_next = _scales(SM, rn, N, n_steps, t_lo, t_hi, TILED == 1)
    for t in range(t_lo, t_hi):
        s = s_next.to(tl.float32)
        m = m_next.to(tl.float32)
        s_next, m_next = _scales(SM, rn, N, n_steps, t + 1, t_hi, TILED == 1)  # an iteration ahead, as the engine
        if TILED > 0:
            w = tl.load(C + (((rn // 64) * n_steps + t) * 2048 + (rn % 64) * 32)[:, None] + j[None, :])
        else:
            w = tl.load(C + rn[:, None] * (K // 4) + (t * 32 + j)[None, :], mask=n_ok[:, None], other=0)
        quads = quad_values(w, PTX, X.dtype.element_ty)
        for r in tl.static_range(4):
            xt = tl.load(X + rm[None, :] * stride_xm + (t * 128 + r * 32 + j)[:, None], mask=m_ok[None, :], other=0.0)
            acc = tl.dot(scaled_codes(quads[r], s, m, True, SPTX), xt, acc)
    store_split(acc, OUT, P, LOCKS, rm[None, :] * stride_om + rn[:, None], m_ok[None, :] & n_ok[:, None], stride_p)


@triton.jit
def _load_kernel(C, SM, OUT, N, K, BLOCK_N: tl.constexpr, TILED: tl.constexpr):
    """Reads what the GEMM reads (codes, scales, minima) in its grid and order, and does nothing
    with it but an xor, so that the loads are kept."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_steps = K // 128
    per_split = tl.cdiv(n_steps, tl.num_programs(1))
    t_lo = tl.program_id(1) * per_split
    t_hi = tl.minimum(t_lo + per_split, n_steps)
    acc = tl.zeros([BLOCK_N, 32], dtype=tl.int32)
    sacc = tl.zeros([BLOCK_N], dtype=tl.int32)
    j = tl.arange(0, 32)
    for t in range(t_lo, t_hi):
        if TILED:
            tile_step = (rn // 64) * n_steps + t
            w = tl.load(C + (tile_step * 2048 + (rn % 64) * 32)[:, None] + j[None, :])
            s = tl.load(SM + tile_step * 128 + rn % 64)
            m = tl.load(SM + tile_step * 128 + 64 + rn % 64)
        else:
            w = tl.load(C + rn[:, None] * (K // 4) + (t * 32 + j)[None, :])
            s = tl.load(SM + rn * n_steps + t)
            m = tl.load(SM + N * n_steps + rn * n_steps + t)
        acc ^= w.to(tl.int32)
        sacc ^= s.to(tl.int16, bitcast=True).to(tl.int32) ^ m.to(tl.int16, bitcast=True).to(tl.int32)
    tl.store(OUT + tl.program_id(1) * N + rn, tl.sum(acc, axis=1) ^ sacc)


def launch(x, words, sm, tiled_layout: int, block_n: int, num_warps: int, num_stages: int,
           split: int | None = None) -> torch.Tensor:
    rows, k = x.shape
    n = sm.numel() // 2 // (k // GROUP)
    programs = triton.cdiv(n, block_n)
    chosen = gemm_launch(4, rows)
    split = split_for(split, programs, k // GROUP, x.device, chosen["per_sm"], chosen["least_split"])
    out, partials, locks = split_outputs(rows, n, split, programs, x)
    _tiled_gemm_kernel[(programs, split)](
        x, words, sm, out, partials, locks, rows, n, k, x.stride(0), out.stride(0), rows * n,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, PTX=QUAD_PTX[1], SPTX=SCALE_PTX[1],
        TILED=tiled_layout, num_warps=num_warps, num_stages=num_stages)
    return out


def load_only(words, sm, k, block_n, split, tiled_layout, num_warps, num_stages, sink):
    n = sm.numel() // 2 // (k // GROUP)
    _load_kernel[(n // block_n, split)](words, sm, sink, n, k, BLOCK_N=block_n, TILED=tiled_layout,
                                        num_warps=num_warps, num_stages=num_stages)


def bench(n: int, k: int, m: int, bw: float, iters: int) -> dict:
    copies = max(2, int(4 * 60e6 // quant_bytes(n, k, 4)) + 1)
    weights = make_weights(n, k, 4, copies)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row_layout = [(w[0].view(torch.int16), torch.cat([w[1].reshape(-1), w[2].reshape(-1)])) for w in weights]
    tiles = [tiled(*w) for w in weights]
    floor_us = quant_bytes(n, k, 4) / bw / 1e3
    want = reference(x.float(), *weights[0], None, 4, GROUP)
    res: dict = {"floor_us": floor_us}
    chosen = gemm_launch(4, m)
    bn, nw, ns = chosen["block_n"], chosen["num_warps"], chosen["num_stages"]

    def check(name, got):
        res[f"{name} rel_err"] = ((got.float() - want).norm() / want.norm()).item()

    engine = gemm(x, *weights[0], None, 4, GROUP).float()
    check("engine", engine)
    res["engine max_abs"] = engine.abs().max().item()
    for name, got in (("row", launch(x, *row_layout[0], 0, bn, nw, ns)), ("tiled", launch(x, *tiles[0], 1, bn, nw, ns)),
                      ("tiled_codes", launch(x, tiles[0][0], row_layout[0][1], 2, bn, nw, ns))):
        check(name, got)
        res[f"{name} max_abs_diff_vs_engine"] = (got.float() - engine).abs().max().item()
    res["engine us"], _ = per_call_us([lambda w=w: gemm(x, *w, None, 4, GROUP) for w in weights], iters)
    codes_only = [(t[0], r[1]) for t, r in zip(tiles, row_layout)]
    for name, lay, flag in (("row", row_layout, 0), ("tiled", tiles, 1), ("tiled_codes", codes_only, 2)):
        for b, w_, s_, sp in ((bn, nw, ns, None), (64, 4, 3, None), (64, 4, 4, None), (32, 2, 3, None),
                              (64, 8, 3, None), (128, 8, 3, None), (64, 4, 3, 2), (64, 4, 3, 8)):
            key = f"{name} bn{b}w{w_}s{s_}" + (f"split{sp}" if sp else "")
            try:
                res[f"{key} us"], _ = per_call_us([lambda c=c: launch(x, *c, flag, b, w_, s_, sp) for c in lay], iters)
            except Exception as exc:  # noqa: BLE001
                res[f"{key} error"] = repr(exc)[:200]
    sink = torch.empty(MAX_SPLIT * n, dtype=torch.int32, device="cuda")  # any split's outputs
    for name, lay, flag in (("row", row_layout, False), ("tiled", tiles, True)):
        for b, w_, s_ in ((64, 2, 3), (64, 4, 1), (128, 4, 3)):
            sp = split_for(None, n // b, k // GROUP, x.device, 4, 4)
            res[f"load {name} bn{b}w{w_}s{s_} us"], _ = per_call_us(
                [lambda c=c: load_only(*c, k, b, sp, flag, w_, s_, sink) for c in lay], iters)
    for key in [key for key in res if key.endswith(" us")]:
        res[key.replace(" us", " of floor")] = floor_us / res[key]
    return res


LAYERS = {name: layers for name, _, _, layers in SHAPES["qwen3.5-27b"]}


def totals(rows: dict) -> dict:
    """Per row count, milliseconds of every timed variant (and the floor) over a 27B step's int4
    linears, each shape weighted by its layers."""
    out: dict = {}
    for key, row in rows.items():
        name, m = key.rsplit(" ", 1)
        step = out.setdefault(m, {})
        for what, us in [("floor", row["floor_us"])] + [(k[:-3], v) for k, v in row.items() if k.endswith(" us")]:
            step[what] = step.get(what, 0.0) + LAYERS[name] * us / 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ceil = ceilings()
    bw = ceil["copy_bandwidth_GBps"]
    out = {**provenance(), "ceilings": ceil, "rows": {}}
    for name, n, k, _ in SHAPES["qwen3.5-27b"]:
        n -= n % TILE  # deltanet_in's 16480 rows: the tiles' whole ones
        for m in (1, 23):
            out["rows"][f"{name} M{m}"] = r = bench(n, k, m, bw, args.iters)
            shown = {kk: round(v, 3) for kk, v in r.items() if "of floor" in kk or "err" in kk or "diff" in kk}
            print(name, m, shown, flush=True)
    out["totals_ms"] = totals(out["rows"])
    print(json.dumps({m: {k: round(v, 2) for k, v in t.items()} for m, t in out["totals_ms"].items()}))
    path = Path(__file__).parent / "results" / f"int4_layout_{torch.cuda.get_device_name().split()[-1].lower()}.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
