"""The attention kernel's read of a quantized cache (triton_kv_read.load_rows) gives the bits
kv_storage.dequantize_kv defines: q8_0 and q4_0 codes read as int32 words and turned into floats
by code_value, every code value, scales across float16's range (subnormal, zero, negative,
large), and q4_0 with bfloat16 scales (a bfloat16 model's cache) across bfloat16's. Run by
Triton's interpreter here in float32 (code times scale, exact; the interpreter truncates float32
to bfloat16 where the GPU rounds), and compiled with its inline PTX on a GPU (marked gpu) in
bfloat16, rounded once: q4_0 with bfloat16 scales then by packed bfloat16 arithmetic."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from interpreted import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import triton
    import triton.language as tl
    from flashtree.kernels.kv_storage import Q4, Q8, QuantRows, dequantize_kv
    from flashtree.kernels.triton_kv_read import code_words, load_rows

    @triton.jit
    def rows_kernel(CODES, SCALES, OUT, stride_n, stride_sn, n, D: tl.constexpr, BN: tl.constexpr,
                    KIND: tl.constexpr, ASM: tl.constexpr):
        DT: tl.constexpr = OUT.dtype.element_ty
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        d = tl.arange(0, D)
        ok = cols < n
        values = load_rows(CODES, SCALES, cols, stride_n, stride_sn, d, 0, ok, DT, KIND, True, ASM)
        tl.store(OUT + cols[:, None] * D + d[None, :], values, mask=ok[:, None])

    def loaded(rows, kind, device, dtype):
        codes = rows.codes.to(device)
        scale = rows.scale.to(device)
        words = code_words(codes, kind)
        n, dim = codes.shape[0], scale.shape[1] * 32
        out = torch.zeros(n, dim, dtype=dtype, device=device)
        rows_kernel[(triton.cdiv(n, 16),)](words, scale, out, words.stride(0), scale.stride(0), n, D=dim, BN=16,
                                          KIND=kind, ASM=device == "cuda")
        return out.cpu()

    def main(device):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        g = torch.Generator().manual_seed(0)
        n, dim = 300, 256
        # float16 scales of every kind: subnormal, zero, negative, tiny, large
        scale = torch.randn(n, dim // 32, generator=g).half()
        scale[:, 0] = torch.tensor(6e-8).half()
        scale[:, 1] = 0.0
        scale[:, 2] = -torch.rand(n, generator=g).half() * 1000
        scale[:, 3] = torch.tensor(65504.0).half() / 127
        out = {}
        q8 = torch.randint(-128, 128, (n, dim), generator=g, dtype=torch.int8)
        q8[0] = torch.arange(-128, 128, dtype=torch.int8)  # every code
        q4 = torch.randint(0, 256, (n, dim // 2), generator=g, dtype=torch.uint8)
        q4[:2] = torch.arange(256).to(torch.uint8).view(2, 128)  # every byte: every pair of codes
        # q4_0 scales in bfloat16 (a bfloat16 model's cache: kv_storage.scale_dtype), which the
        # compiled kernel dequantizes with packed bfloat16 arithmetic; on the GPU bfloat16
        # subnormals too (the interpreter widens a bfloat16 subnormal to a wrong float32)
        scale16 = scale.to(torch.bfloat16)
        scale16[:, 5] = torch.tensor(3e38).to(torch.bfloat16) / 16
        if device == "cuda":
            scale16[:, 4] = torch.tensor(1e-39).to(torch.bfloat16)
        for label, name, kind, codes, s in (("q8_0", "q8_0", Q8, q8, scale), ("q4_0", "q4_0", Q4, q4, scale),
                                            ("q4_0 bf16 scales", "q4_0", Q4, q4, scale16)):
            rows = QuantRows(name, codes, s)
            want = dequantize_kv(rows, dtype)
            got = loaded(rows, kind, device, dtype)
            out[label] = int((got != want).sum())  # no NaN: every scale is finite
        print(json.dumps(out))

    main(sys.argv[1])
""")


def test_the_kernel_reads_quantized_rows_as_their_definition_bit_for_bit():
    assert run_interpreted(SCRIPT, "cpu") == {"q8_0": 0, "q4_0": 0, "q4_0 bf16 scales": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_reads_quantized_rows_as_their_definition_bit_for_bit():
    assert run_interpreted(SCRIPT, "cuda", interpret=False) == {"q8_0": 0, "q4_0": 0, "q4_0 bf16 scales": 0}
