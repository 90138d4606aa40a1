"""Quantized weights on the CUDA path: the compiled GEMV/GEMM against the float32 definition at
real layer shapes in bf16 (GGUF's IQ4 weights in their 4-bit table layout too, IQ4_XS in its two
levels at 4.3125 bits a weight, dequantized to gguf's weights bit for bit), a quantized
linear captured in a CUDA graph, and greedy speculative
decoding of an int4/int8 1.7B-shaped random target through the graphs emitting greedy AR's tokens
(or first diverging at a bf16 tie of the quantized model's own float32 logits)."""

import numpy as np
import pytest
import torch

from flashtree.bench.models import build_pair
from flashtree.kernels.reference import quant_linear
from flashtree.models.quant import QuantizedLinear
from flashtree.models.quantize import quantize_model
from test_gpu_decode import greedy, make, same_or_tie

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (16480, 5120)])
@pytest.mark.parametrize("rows", [1, 8, 23, 64, 200])  # 200: a prefill chunk (dequantized, cuBLAS)
def test_kernels_match_the_definition_in_bf16(bits, group, n, k, rows):
    torch.manual_seed(rows + n)
    layer = QuantizedLinear.from_float(torch.randn(n, k, device=DEV) * 0.02, bits, group,
                                       torch.randn(n, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    got = layer(x)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), bits, group)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert rel(got, want) < 1e-2


@torch.inference_mode()
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (16480, 5120), (40, 1024)])  # whole tiles, one ragged, one only
@pytest.mark.parametrize("rows", [1, 23, 64, 200])
def test_a_tiled_int4_layer_gives_the_row_major_ones_bits(group, n, k, rows):
    """Tiling (reference.tile_rows) moves bytes, not arithmetic: the GEMM at one row and at a
    tree's, and prefill's dequantization, give exactly what they give over the rows in order."""
    torch.manual_seed(rows + n)
    layer = QuantizedLinear.from_float(torch.randn(n, k, device=DEV) * 0.02, 4, group,
                                       torch.randn(n, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    want = layer(x)
    layer.tile_()
    assert torch.equal(layer(x), want)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 23])
@pytest.mark.parametrize("nbytes", [16, 4096, 1 << 24, 1 << 40])  # up to past the next layer's end
def test_a_gemm_that_prefetches_the_next_layer_gives_the_same_bits(rows, nbytes):
    """The L2 prefetch of the next linear's codes (kernels/triton_prefetch.py) is a hint: in a
    CUDA graph, alone and as its own launch, the outputs are those without it."""
    from flashtree.kernels.triton_prefetch import prefetch_l2

    torch.manual_seed(rows)
    layer, after = (QuantizedLinear.from_float(torch.randn(n, k, device=DEV) * 0.02, 4, 128).tile_()
                    for n, k in ((6144, 4096), (4096, 12288)))
    x = torch.randn(rows, 4096, device=DEV, dtype=torch.bfloat16)
    want = layer(x)
    layer.prefetch = (after.codes, nbytes)
    assert torch.equal(layer(x), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        prefetch_l2(after.codes, nbytes)
    graph.replay()
    assert torch.equal(out, want)


GEMM_LAUNCHES = [dict(split=1), dict(split=3), dict(block_n=128, num_warps=8, num_stages=5), dict(asm=True),
                 dict(asm=True, split=2, block_n=128, num_warps=8),
                 dict(asm=True, block_n=32, num_warps=2, num_stages=3), dict(split=3, block_n=16, num_warps=1),
                 dict(asm=False, block_n=32, num_warps=4)]


@pytest.mark.parametrize("rows", [1, 23])
@pytest.mark.parametrize("bits,group", [(4, 128), (8, 128), (8, 16)])  # int8 in 16s scales its codes
@pytest.mark.parametrize("config", GEMM_LAUNCHES)
def test_every_gemm_launch_matches_the_definition_in_bf16(bits, group, config, rows):
    """The benchmark's GEMM sweep knobs (benchmarks/quant_gemv.py) all compute the same
    function, for a tree's rows and for one row padded to a tile of 16; asm=True (the kernel's
    inline PTX) runs nowhere else."""
    from flashtree.kernels.triton_quant import gemm

    torch.manual_seed(bits)
    layer = QuantizedLinear.from_float(torch.randn(5120, 6144, device=DEV) * 0.02, bits, group,
                                       torch.randn(5120, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(rows, 6144, device=DEV, dtype=torch.bfloat16)
    got = gemm(x, layer.codes, layer.scale, layer.minimum, layer.bias, bits, group, **config)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), bits, group)
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("rows", [1, 23])
def test_the_int4_gemm_in_float16(rows):
    """float16 activations: the GEMM's float16 dequantization and packed fmas (f16x2) against
    the definition."""
    from flashtree.kernels.triton_quant import gemm

    torch.manual_seed(rows)
    layer = QuantizedLinear.from_float(torch.randn(4096, 6144, device=DEV) * 0.02, 4, 128,
                                       torch.randn(4096, device=DEV, dtype=torch.float16))
    x = torch.randn(rows, 6144, device=DEV, dtype=torch.float16)
    got = gemm(x, layer.codes, layer.scale, layer.minimum, layer.bias, 4, 128)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), 4, 128)
    assert got.dtype == torch.float16 and rel(got, want) < 5e-3


GEMV_LAUNCHES = [dict(), dict(num_stages=1), dict(block_n=32, num_warps=8), dict(split=3), dict(block_n=8, split=5),
                 dict(block_words=64, asm=False), dict(block_words=256, num_stages=2, asm=False),
                 dict(regroup=False), dict(regroup=False, num_stages=4, block_n=32)]


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("config", GEMV_LAUNCHES)
def test_every_gemv_launch_matches_the_definition_in_bf16(group, config):
    """kernels/triton_gemv.py's knobs (the benchmark's GEMV sweep), at a ragged row count (N = 5000 is no multiple of a row
    tile) and K = 6144 (48 groups of 128: 6 tiles of 8; 192 of 32: 6 of 32)."""
    from flashtree.kernels.triton_gemv import gemv

    bits = 8  # the GEMV's only width
    torch.manual_seed(bits + group)
    layer = QuantizedLinear.from_float(torch.randn(5000, 6144, device=DEV) * 0.02, bits, group,
                                       torch.randn(5000, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(1, 6144, device=DEV, dtype=torch.bfloat16)
    got = gemv(x, layer.codes, layer.scale, layer.minimum, layer.bias, bits, group, **config)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), bits, group)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 5000)
    assert rel(got, want) < 1e-2


def iq4_blocks(qtype: str, n: int, k: int) -> np.ndarray:
    """Random valid GGUF blocks of `qtype` (IQ4_NL or IQ4_XS) for an [n, k] weight."""
    from gguf import GGMLQuantizationType as Q
    from gguf_convert import random_blocks

    return random_blocks(n, k, Q[qtype], np.random.default_rng(n + k))


def table_layer(qtype: str, n: int, k: int, bias: bool = True, order=None) -> QuantizedLinear:
    """A linear of iq4_blocks in the table layout, as the GGUF loader builds it (row major, on the
    GPU; `order`: the HF columns' stored ones, which the loader applies), with a bf16 bias."""
    from flashtree.checkpoint.gguf_codes import group_codes
    from flashtree.checkpoint.gguf_tensors import QuantizedTensor

    c = group_codes(QuantizedTensor("w", qtype, iq4_blocks(qtype, n, k), (n, k), order))
    b = torch.randn(n, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(k)) if bias else None
    return QuantizedLinear.from_codes(c.codes, c.scale, None, c.group, c.bits, b, c.lookup, c.superscale).to(DEV)


def check_table(layer: QuantizedLinear, rows: int) -> None:
    """The layer's forward over `rows` random bf16 rows against the float32 definition, and the
    same bits once tiled as the engine places it."""
    x = torch.randn(rows, layer.in_features, device=DEV, dtype=torch.bfloat16,
                    generator=torch.Generator(DEV).manual_seed(rows))
    got = layer(x)
    want = quant_linear(x.float(), layer.codes, layer.scale, None, layer.bias.float(), 4, 32, layer.values,
                        layer.superscale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, layer.out_features)
    assert rel(got, want) < 1e-2
    layer.tile_()
    assert torch.equal(layer(x), got)


@torch.inference_mode()
@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ4_NL"])
@pytest.mark.parametrize("n,k", [(17408, 5120), (5120, 17408)])  # a 27B's MLP up (half its gate_up) and down
@pytest.mark.parametrize("rows", [1, 23, 200])  # 200: a prefill chunk (dequantized, cuBLAS)
def test_the_table_layout_matches_the_definition_in_bf16(qtype, n, k, rows):
    """IQ4 weights kept 4-bit (models/quant.py's table layout; IQ4_XS in its two levels): the
    GEMM at one row and at a tree's, and prefill's dequantization, against the float32
    definition; tiled as the engine places them, the same bits as row major."""
    layer = table_layer(qtype, n, k)
    assert layer.super_groups == (8 if qtype == "IQ4_XS" else None)
    check_table(layer, rows)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 23, 200])
def test_a_reordered_iq4_xs_out_proj_matches_the_definition_in_bf16(rows):
    """A 27B's DeltaNet out_proj [5120, 6144] in IQ4_XS: the loader's value-head order (16 key
    heads of 3 value heads of 128) brings groups of two super-blocks together, so a super-scale
    covers 4 groups; the kernels read it as they read 8."""
    from flashtree.checkpoint.gguf_tensors import grouped_heads

    layer = table_layer("IQ4_XS", 5120, 6144, order=grouped_heads(16, 3, 128))
    assert layer.super_groups == 4
    check_table(layer, rows)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_iq4_xs_holds_4_3125_bits_a_weight_and_dequantizes_to_ggufs_weights(dtype):
    """IQ4_XS on the GPU, tiled as the engine places it: codes, an int8 sub-scale per 32 and a
    float16 super-scale per 256 (4.3125 bits a weight, and the table's 64 bytes), and prefill's
    dequantization gives gguf's dequantized weights rounded once to x's dtype, bit for bit."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from flashtree.kernels.triton_dequant import dequantize_into

    n, k = 5120, 17408
    layer = table_layer("IQ4_XS", n, k, bias=False).tile_()
    assert layer.nbytes == n * k * 4.3125 / 8 + 64
    got = dequantize_into(torch.empty(n, k, dtype=dtype, device=DEV), layer.codes, layer.scale, None, 4, 32,
                          True, layer.values, layer.superscale)
    want = torch.from_numpy(dequantize(iq4_blocks("IQ4_XS", n, k), Q.IQ4_XS).reshape(n, k)).to(dtype)
    assert torch.equal(got.cpu(), want)


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 23])
@pytest.mark.parametrize("qtype", [None, "IQ4_XS"])
def test_a_quantized_linear_replays_in_a_cuda_graph(rows, qtype):
    if qtype is None:
        layer = QuantizedLinear.from_float(torch.randn(1024, 2048, device=DEV) * 0.02, 4, 128)
    else:
        layer = table_layer(qtype, 1024, 2048, bias=False).tile_()
    x = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16)
    layer(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    for seed in range(3):
        x.copy_(torch.randn(rows, 2048, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, layer(x))


@torch.inference_mode()
@pytest.mark.parametrize("bits,rows,group", [(4, 1, 128), (4, 23, 128), (8, 1, 128), (8, 23, 128), (8, 23, 16)])
def test_split_k_adds_its_partials_in_the_kernel_the_same_every_launch(bits, rows, group):
    """K split 8 ways: the last program of each output tile adds the float32 partials in split
    order (kernels/triton_split.py), so every launch gives the same bits whichever program
    finishes last, eagerly and replayed from a CUDA graph (each launch leaves its counters at
    zero for the next), and the definition's values."""
    from flashtree.kernels.quant import kernel_for

    torch.manual_seed(bits + rows)
    layer = QuantizedLinear.from_float(torch.randn(5120, 6144, device=DEV) * 0.02, bits, group)
    x = torch.randn(rows, 6144, device=DEV, dtype=torch.bfloat16)
    kernel = kernel_for(rows, bits)
    run = lambda: kernel(x, layer.codes, layer.scale, layer.minimum, None, bits, group, split=8)  # noqa: E731
    first = run()
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, None, bits, group)
    assert rel(first, want) < 1e-2
    for _ in range(30):
        assert torch.equal(run(), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(30):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)


@pytest.fixture(scope="module", params=["int4", "int8"])
def pair(request):
    quantized = build_pair("qwen3-1.7b", DEV, max_pos=4096, seed=0, head_std=0.05)
    quantize_model(quantized.target, request.param)
    torch.cuda.empty_cache()
    linears = [m for m in quantized.target.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.tiled == (m.bits == 4) for m in linears)  # placed on CUDA: int4 tiled (the head is int8)
    return quantized


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_equals_ar_on_a_quantized_target(pair, prompt, ref32, mode):
    """ref32 is the quantized model in float32: the same codes, dequantized by the definition."""
    assert isinstance(pair.target.model.layers[0].mlp.down_proj, QuantizedLinear)
    ar, _ = greedy(make(pair, "ar"), prompt, 128)
    spec, _ = greedy(make(pair, mode), prompt, 128)
    assert same_or_tie(ref32, prompt, ar, spec)
