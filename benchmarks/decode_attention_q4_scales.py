"""A decode step's attention over a q4_0 cache whose block scales are float16 (the float32
dequantization) against one whose scales are in the model's bfloat16 (kv_storage.scale_dtype:
the packed dequantization of triton_kv_read._q4_packed), for the Qwen3.5-27B and Qwen3-8B heads,
an AR row and a 22-node tree's 23 rows (27B: also in 64-row blocks), at 4K and 61K of context.

    python benchmarks/decode_attention_q4_scales.py [--out benchmarks/results/decode_attention_q4_scales.json]

Each time is one call's, in a CUDA graph that runs the call over LAYERS caches in turn (more
bytes than L2 holds, as a forward's layers are), the median of 20 replays. Each side's error is
against the same kernel over the bf16 values its codes stand for (equal errors: the two
dequantizations give the same values)."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefill_attention import calls_ms  # noqa: E402
from quant_gemv import rel_err  # noqa: E402
from flashtree.kernels.kv_storage import QuantRows, dequantize_kv, quantize_kv  # noqa: E402
from flashtree.kernels.triton_attention import MODE_CAUSAL, attention  # noqa: E402

LAYERS = 8
SHAPES = [(24, 4, 256, "27b"), (32, 8, 128, "8b")]  # query heads, KV heads, head dim
TREE_64 = {"block_m": 64, "nsplit": 64, "v_parts": 1, "warps": 4, "stages": 2, "tail": 0, "min_chunk": 64}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/decode_attention_q4_scales.json")
    args = ap.parse_args()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    for heads, kv_heads, dim, label in SHAPES:
        for ctx in (4096, 61440):
            for t in (1, 23):
                torch.manual_seed(ctx + t)
                caches = []  # per layer: K, V with float16 scales, then with bfloat16 ones
                for _ in range(LAYERS):
                    k = torch.randn(ctx + t, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                    v = torch.randn_like(k)
                    kc, vc = QuantRows("q4_0", *quantize_kv(k, "q4_0")), QuantRows("q4_0", *quantize_kv(v, "q4_0"))
                    caches.append((kc, vc, QuantRows("q4_0", kc.codes, kc.scale.to(torch.bfloat16)),
                                   QuantRows("q4_0", vc.codes, vc.scale.to(torch.bfloat16))))
                q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16)
                length = torch.tensor([ctx], dtype=torch.int32, device="cuda")
                run = partial(attention, q, length=length, scale=dim ** -0.5, mode=MODE_CAUSAL, mask=None,
                              window=None)
                errors = {}
                for name, (ki, vi) in (("fp16", (0, 1)), ("model_dtype", (2, 3))):
                    kq, vq = caches[0][ki], caches[0][vi]
                    plain = run(k_cache=dequantize_kv(kq, torch.bfloat16), v_cache=dequantize_kv(vq, torch.bfloat16))
                    errors[f"err_{name}_scales"] = rel_err(run(k_cache=kq, v_cache=vq), plain.float())
                for launch in [None, TREE_64] if t == 23 and dim == 256 else [None]:
                    row = {"model": label, "ctx": ctx, "t": t, "launch": launch, **errors}
                    for name, (ki, vi) in (("fp16_scales", (0, 1)), ("bf16_scales", (2, 3))):
                        row[name + "_ms"] = round(calls_ms([partial(run, k_cache=c[ki], v_cache=c[vi], launch=launch)
                                                            for c in caches], 20), 4)
                    row["speedup"] = round(row["fp16_scales_ms"] / row["bf16_scales_ms"], 3)
                    print(json.dumps(row), flush=True)
                    out["rows"].append(row)
                del caches
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
