"""Programmatic dependent launch (kernels/triton_pdl.py): a chain of the decode step's kernels
(residual norm, int4 GEMMs at one row and at a tree's 23, SiLU, split-K sums) captured in a CUDA
graph and replayed over fresh inputs gives the bits it gives with ordinary launches. A kernel
that read its input or wrote its output before its wait would race the kernel before it, and
the replays would differ."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from flashtree.kernels import triton_pdl  # noqa: E402
from flashtree.kernels.fused import rms_norm, silu_mul  # noqa: E402
from flashtree.models.quant import QuantizedLinear  # noqa: E402

DEV = "cuda"
HIDDEN, INTER = 2048, 5632


def pdl_supported() -> bool:
    return triton_pdl._HAS_GDC and torch.cuda.get_device_capability() >= (9, 0)


def set_pdl(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("FLASHTREE_PDL", "1" if on else "0")
    triton_pdl._pdl_on.cache_clear()


def layer_chain(rows: int, seed: int):
    """A captured MLP block: norm(x + residual) -> gate_up -> SiLU -> down, five times over, and
    the function that replays it for new inputs and returns the outputs."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    up = QuantizedLinear.from_float(torch.randn(2 * INTER, HIDDEN, device=DEV, generator=g) / 30, 4, 128).tile_()
    down = QuantizedLinear.from_float(torch.randn(HIDDEN, INTER, device=DEV, generator=g) / 60, 4, 128).tile_()
    norm_w = torch.rand(HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        h, r = x, res
        for _ in range(5):
            normed, r = rms_norm(h, norm_w, 1e-6, r)
            h = down(silu_mul(up(normed)))
        return h + r

    forward()  # compiles, and zeroes the split-K counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()

    def run(inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        got = []
        for xi, ri in inputs:
            x.copy_(xi)
            res.copy_(ri)
            graph.replay()
            got.append(out.clone())
        return got
    return run


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 23])
def test_graphs_with_pdl_give_the_bits_of_ordinary_launches(monkeypatch, rows):
    if not pdl_supported():
        pytest.skip("PDL needs compute capability 9.0 and Triton's launch_pdl")
    torch.manual_seed(rows)
    inputs = [(torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16),
               torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)) for _ in range(8)]
    set_pdl(monkeypatch, False)
    assert triton_pdl.launch_options(torch.device(DEV)) == {"PDL": False}
    want = layer_chain(rows, 7)(inputs)
    set_pdl(monkeypatch, True)
    assert triton_pdl.launch_options(torch.device(DEV))["launch_pdl"] is True
    run = layer_chain(rows, 7)
    for _ in range(3):  # repeated replays: a race would not show every time
        got = run(inputs)
        for a, b in zip(got, want):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b)
    triton_pdl._pdl_on.cache_clear()


def test_pdl_is_off_on_the_cpu():
    assert triton_pdl.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.gpu
def test_pdl_is_off_by_environment(monkeypatch):
    set_pdl(monkeypatch, False)
    assert triton_pdl.launch_options(torch.device(DEV)) == {"PDL": False}
    triton_pdl._pdl_on.cache_clear()
