"""Programmatic dependent launch (kernels/triton_pdl.py): a chain of the decode step's kernels
(residual norm, int4 GEMMs with split-K sums at one row and at a tree's 23, SiLU) gives with PDL,
eagerly and replayed in a CUDA graph, the bits it gives with ordinary launches. A kernel that
read its input or wrote its output before its wait would race the kernel before it.

A CUDA graph keeps no tensor alive: the test holds `forward`, and with it the layers whose
memory the graph reads (a first version replayed through a closure that held only the graph and
its inputs; Python freed the weights, later allocations overwrote them, and replays after the
first read garbage, with PDL and without)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

from flashtree.kernels import triton_pdl  # noqa: E402
from flashtree.kernels.fused import rms_norm, silu_mul  # noqa: E402
from flashtree.models.quant import QuantizedLinear  # noqa: E402

DEV = "cuda"
HIDDEN, INTER = 2048, 5632


def pdl_supported() -> bool:
    return torch.cuda.is_available() and triton_pdl._HAS_GDC and torch.cuda.get_device_capability() >= (9, 0)


def set_pdl(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("FLASHTREE_PDL", "1" if on else "0")
    triton_pdl._pdl_on.cache_clear()


@pytest.fixture(autouse=True)
def fresh_pdl_decision():
    """Each test's FLASHTREE_PDL is read afresh, and the next tests read theirs (monkeypatch
    restores the environment; the cached decision goes with it), also after a failure."""
    yield
    triton_pdl._pdl_on.cache_clear()


def mlp_blocks(seed: int):
    """norm(x + residual) -> int4 gate_up -> SiLU -> int4 down, five times over, as a function of
    (x, residual)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    up = QuantizedLinear.from_float(torch.randn(2 * INTER, HIDDEN, device=DEV, generator=g) / 30, 4, 128).tile_()
    down = QuantizedLinear.from_float(torch.randn(HIDDEN, INTER, device=DEV, generator=g) / 60, 4, 128).tile_()
    norm_w = torch.rand(HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) + 0.5

    def forward(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h, r = x, res
        for _ in range(5):
            normed, r = rms_norm(h, norm_w, 1e-6, r)
            h = down(silu_mul(up(normed)))
        return h + r
    return forward


def inputs_for(rows: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(rows)
    return [(torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16),
             torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)) for _ in range(n)]


def replays(forward, inputs, x: torch.Tensor, res: torch.Tensor) -> list[torch.Tensor]:
    """`forward` captured in a CUDA graph over the static inputs x and res, replayed for each of
    `inputs` (copied into them). The caller holds `forward` (and its layers) while it runs."""
    forward(x, res)  # compiles, and zeroes the split-K counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(x, res)
    got = []
    for xi, ri in inputs:
        x.copy_(xi)
        res.copy_(ri)
        graph.replay()
        got.append(out.clone())
        torch.cuda.synchronize()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 23])
def test_pdl_gives_the_bits_of_ordinary_launches(monkeypatch, rows):
    if not pdl_supported():
        pytest.skip("PDL needs compute capability 9.0 and Triton's launch_pdl")
    forward = mlp_blocks(7)
    inputs = inputs_for(rows, 4)
    set_pdl(monkeypatch, False)
    assert triton_pdl.launch_options(torch.device(DEV)) == {"PDL": False}
    want = [forward(x, r) for x, r in inputs]
    set_pdl(monkeypatch, True)
    assert triton_pdl.launch_options(torch.device(DEV))["launch_pdl"] is True
    eager = [forward(x, r) for x, r in inputs]
    graph = replays(forward, inputs, *(t.clone() for t in inputs[0]))  # forward (its layers) held here
    for w, e, g in zip(want, eager, graph):
        assert torch.isfinite(w).all()
        assert torch.equal(e, w)
        assert torch.equal(g, w)


def test_pdl_is_off_on_the_cpu():
    assert triton_pdl.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.gpu
def test_pdl_is_off_by_environment(monkeypatch):
    set_pdl(monkeypatch, False)
    assert triton_pdl.launch_options(torch.device(DEV)) == {"PDL": False}


def test_pdl_off_holds_for_the_launches_inside_it_and_nests(monkeypatch):
    """What flashtree bench's kernel profiles launch under: no PDL inside, whatever the device
    says (here a device said to support it), and PDL again once the outermost block is left."""
    monkeypatch.setattr(triton_pdl, "_pdl_on", lambda index: True)
    cuda = torch.device("cuda", 0)
    assert triton_pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    with triton_pdl.pdl_off():
        assert triton_pdl.launch_options(cuda) == {"PDL": False}
        with triton_pdl.pdl_off():
            assert triton_pdl.launch_options(cuda) == {"PDL": False}
        assert triton_pdl.launch_options(cuda) == {"PDL": False}
    assert triton_pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    with pytest.raises(RuntimeError):
        with triton_pdl.pdl_off():
            raise RuntimeError("a profile that fails")
    assert triton_pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
