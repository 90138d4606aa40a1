"""Would a 3-bit KV type with a Hadamard rotation beat q4_0 on quality per byte? Measured before
building one: a 3-bit type is worth its code only if it does.

    PYTHONPATH=. python benchmarks/kv3_quality.py [benchmarks/results/kv3_quality_cpu.json]

The embedded target prefills the six held-out prompts of quality.py on the CPU in float32; every
layer's attention call is recorded (its queries, keys, values). Offline, each candidate format
stores the keys and values and the attention is computed again over what they decode to; the
report gives, per format, its bits per value and the relative error of the attention outputs
(all layers and prompts pooled), of the keys and of the values, against the float32 cache.

Formats: q8_0 and q4_0 as flashtree stores them (kernels/reference.py), `q3_0` (q4_0's scheme
with 3-bit codes: a float16 scale per 32 values, codes 0..7 for -4..3 scales), and q4_0 / q3_0
after a normalized Hadamard rotation of each head's vector (`+rot`, as llama.cpp's TQ3 types and
the system flashtree grew from rotate K; here K and V both, each rotated back after decoding).
Quality per byte: a format wins against q4_0 when it stores fewer bits and its attention error
is no larger.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from flashtree import Engine
from flashtree.kernels import attention
from flashtree.kernels.kv_storage import QBLOCK, QuantRows, dequantize_kv, quantize_kv
from flashtree.models.inputs import ForwardInput
from quality import prompts

FORMATS = {"q8_0": 8.5, "q4_0": 4.5, "q4_0+rot": 4.5, "q3_0": 3.5, "q3_0+rot": 3.5}


def hadamard(n: int) -> torch.Tensor:
    """The normalized n x n Hadamard matrix (n a power of two): orthogonal and symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def q3_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] stored with 3-bit codes and a float16 scale per 32 values, decoded again."""
    blocks = x.unflatten(-1, (-1, QBLOCK))
    hi, lo = blocks.amax(-1), blocks.amin(-1)
    scale = (torch.where(-lo > hi, lo, hi) / -4).half().float().unsqueeze(-1)
    divisor = torch.where(scale != 0, scale, 1.0)
    codes = torch.floor(blocks / divisor + 4.5).clamp(0, 7)
    return ((codes - 4) * scale).flatten(-2)


def stored(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What attention reads back from x [T, heads, D] kept in `fmt`."""
    kind, _, rot = fmt.partition("+")
    h = hadamard(x.shape[-1]) if rot else None
    y = x @ h if h is not None else x
    if kind == "q3_0":
        y = q3_0(y)
    else:
        codes, scale = quantize_kv(y, kind)
        y = dequantize_kv(QuantRows(kind, codes, scale), torch.float32)
    return y @ h if h is not None else y  # H is its own inverse


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    eng = Engine.from_pretrained(None, None, mode="ar", device="cpu", dtype="float32")
    calls: list[tuple] = []
    original = attention.reference_attention

    def recording(q, k_cache, v_cache, length, scale, block_mask, causal, window):
        end = length + q.shape[0]
        calls.append((q.clone(), k_cache[:end].clone(), v_cache[:end].clone(), length, scale, causal))
        return original(q, k_cache, v_cache, length, scale, block_mask, causal, window)

    attention.reference_attention = recording
    held_out = prompts(eng.tokenizer)
    with torch.inference_mode():
        for ids in held_out:
            cache = eng.target.new_cache(len(ids) + 1, eng.dtype, eng.device, 1)
            eng.target(ForwardInput.prefill(torch.tensor(ids), cache))
    attention.reference_attention = original
    exact = [original(q, k, v, length, scale, None, causal, None) for q, k, v, length, scale, causal in calls]

    report = {"model": "embedded target (flashtree-tiny), float32, CPU", "prompts": len(held_out),
              "attention_calls": len(calls), "formats": {}}
    for fmt, bits in FORMATS.items():
        errors = {"attention": [], "k": [], "v": []}
        for (q, k, v, length, scale, causal), ref in zip(calls, exact):
            kq, vq = stored(k, fmt), stored(v, fmt)
            errors["attention"].append(rel(original(q, kq, vq, length, scale, None, causal, None), ref))
            errors["k"].append(rel(kq, k))
            errors["v"].append(rel(vq, v))
        report["formats"][fmt] = {"bits_per_value": bits,
                                  **{f"{name}_rel_error": round(sum(e) / len(e), 5) for name, e in errors.items()}}
    base = report["formats"]["q4_0"]["attention_rel_error"]
    report["beats_q4_0_per_byte"] = [f for f, r in report["formats"].items()
                                     if r["bits_per_value"] < 4.5 and r["attention_rel_error"] <= base]
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
