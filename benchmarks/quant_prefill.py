"""A prefill chunk through the quantized linears of one Qwen3.5-27B / Qwen3-8B layer stack: the
definition's path (reference.quant_linear: torch elementwise dequantization through float32, then
cuBLAS) against Triton's dequantization then cuBLAS (kernels/triton_dequant.py, what CUDA runs),
and the bf16 matmul on dense weights, the ceiling, all in the same run.

    python benchmarks/quant_prefill.py [--rows 512] [--iters 5]

Every linear of the shape once, times its count in the model; int4 at group 32 (GGUF's K-quant
sub-blocks) and 128. Writes benchmarks/results/quant_prefill_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from flashtree.bench.measure import ceilings, device_ms
from flashtree.bench.provenance import device_slug
from flashtree.kernels.reference import quant_linear as reference
from flashtree.kernels.triton_dequant import dequantized_linear
from flashtree.models.quant import QuantizedLinear

sys.path.insert(0, str(Path(__file__).parent))
from quant_gemv import SHAPES  # noqa: E402  (a sibling script: the layer shapes)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="tokens in the prefill chunk")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    ceil = ceilings()
    device = device_slug()
    rows, totals = [], {}
    for model, shapes in SHAPES.items():
        for group in (32, 128):
            step = {"definition_ms": 0.0, "triton_dequant_ms": 0.0, "bf16_ms": 0.0}
            for name, n, k, count in shapes:
                layer = QuantizedLinear.from_float(torch.randn(n, k, device="cuda") * 0.02, 4, group)
                x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
                q = (layer.codes, layer.scale, layer.minimum, None, 4, group)
                want = reference(x.float(), *q)
                got = dequantized_linear(x, *q).float()
                dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "layer": name, "N": n, "K": k, "M": args.rows, "group": group,
                       "rel_err_vs_definition": ((got - want).norm() / want.norm()).item(),
                       "definition_ms": device_ms(lambda: reference(x, *q), args.iters),
                       "triton_dequant_ms": device_ms(lambda: dequantized_linear(x, *q), args.iters),
                       "bf16_ms": device_ms(partial(F.linear, x, dense), args.iters)}
                for key in step:
                    step[key] += count * row[key]
                print(json.dumps(row), flush=True)
                rows.append(row)
                del layer, dense, want, got
                torch.cuda.empty_cache()
            tokens_per_s = {key.replace("_ms", "_tokens_per_s"): args.rows / (ms / 1e3) for key, ms in step.items()}
            totals[f"{model} int4 g{group}"] = {**step, **tokens_per_s,
                                                "triton_over_bf16": step["triton_dequant_ms"] / step["bf16_ms"]}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
              "rows": rows, "totals": totals}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant_prefill_{device}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(totals, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
