"""Quantized weights on the CUDA path: the compiled GEMV/GEMM against the float32 definition at
real layer shapes in bf16, a quantized linear captured in a CUDA graph, and greedy speculative
decoding of an int4/int8 1.7B-shaped random target through the graphs emitting greedy AR's tokens
(or first diverging at a bf16 tie of the quantized model's own float32 logits)."""

import pytest
import torch

from flashtree.bench.models import build_pair
from flashtree.kernels.reference import quant_linear
from flashtree.models.quant import QuantizedLinear, quantize_model
from test_gpu_decode import greedy, make, same_or_tie

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (16480, 5120)])
@pytest.mark.parametrize("rows", [1, 8, 23, 64])
def test_kernels_match_the_definition_in_bf16(bits, group, n, k, rows):
    torch.manual_seed(rows + n)
    layer = QuantizedLinear.from_float(torch.randn(n, k, device=DEV) * 0.02, bits, group,
                                       torch.randn(n, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    got = layer(x)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), bits, group)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert rel(got, want) < 1e-2


LAUNCHES = [("gemv", dict(split=1)), ("gemv", dict(split=3, groups=4)), ("gemv", dict(regroup=False)),
            ("gemv", dict(block_n=256, num_warps=8)), ("gemv", dict(asm=True)), ("gemv", dict(prefetch=True)),
            ("gemv", dict(prefetch=True, asm=True, split=3)), ("gemm", dict(split=1)), ("gemm", dict(split=3)),
            ("gemm", dict(block_n=128, num_warps=8, num_stages=5)), ("gemm", dict(asm=True)),
            ("gemm", dict(asm=True, split=2, block_n=128, num_warps=8))]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel,config", LAUNCHES)
def test_every_launch_configuration_matches_the_definition_in_bf16(bits, kernel, config):
    """The benchmark's sweep knobs (benchmarks/quant_gemv.py) all compute the same function;
    asm=True (the kernels' inline PTX) runs nowhere else."""
    from flashtree.kernels import triton_quant

    torch.manual_seed(bits)
    layer = QuantizedLinear.from_float(torch.randn(5120, 6144, device=DEV) * 0.02, bits, 128,
                                       torch.randn(5120, device=DEV, dtype=torch.bfloat16))
    x = torch.randn(1 if kernel == "gemv" else 23, 6144, device=DEV, dtype=torch.bfloat16)
    got = getattr(triton_quant, kernel)(x, layer.codes, layer.scale, layer.minimum, layer.bias, bits, 128, **config)
    want = quant_linear(x.float(), layer.codes, layer.scale, layer.minimum, layer.bias.float(), bits, 128)
    assert rel(got, want) < 1e-2


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 23])
def test_a_quantized_linear_replays_in_a_cuda_graph(rows):
    layer = QuantizedLinear.from_float(torch.randn(1024, 2048, device=DEV) * 0.02, 4, 128)
    x = torch.randn(rows, 2048, device=DEV, dtype=torch.bfloat16)
    layer(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    for seed in range(3):
        x.copy_(torch.randn(rows, 2048, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, layer(x))


@pytest.fixture(scope="module", params=["int4", "int8"])
def pair(request):
    quantized = build_pair("qwen3-1.7b", DEV, max_pos=4096, seed=0, head_std=0.05)
    quantize_model(quantized.target, request.param)
    torch.cuda.empty_cache()
    return quantized


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_greedy_spec_equals_ar_on_a_quantized_target(pair, prompt, ref32, mode):
    """ref32 is the quantized model in float32: the same codes, dequantized by the definition."""
    assert isinstance(pair.target.model.layers[0].mlp.down_proj, QuantizedLinear)
    ar, _ = greedy(make(pair, "ar"), prompt, 128)
    spec, _ = greedy(make(pair, mode), prompt, 128)
    assert same_or_tie(ref32, prompt, ar, spec)
