"""The draft's candidates in one pass (kernels/tree.draft_top_k, kernels/triton_topk.py): each
row's top k of log_softmax(logits), best first, equal values in index order, against the
definition (a stable descending sort of torch's log-softmax): under Triton's interpreter here,
compiled for sm_90 on this machine, and on CUDA in the `gpu` tests."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import run_interpreted

from flashtree.kernels.tree import draft_top_k


def definition(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def cases(device: str = "cpu") -> dict[str, tuple[torch.Tensor, int]]:
    """Logits and k: several chunks with a short last one, one chunk, k 1, ties (logits on a
    grid of halves, so equal values span chunks), bf16 logits, rows that are a strided slice."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 2 * 4096 + 321, generator=g) * 3
    out = {"three chunks, k 22": (wide, 22),
           "one chunk, k 5": (torch.randn(4, 1000, generator=g) * 4, 5),
           "k 1": (wide[:3], 1),
           "ties across chunks": ((torch.randn(5, 3 * 4096, generator=g) * 2).round() / 2, 22),
           "bf16 logits": (wide.bfloat16(), 22),
           "strided rows": (torch.randn(6, 2, 5000, generator=g)[:, 1], 8)}
    return {name: (x.to(device), k) for name, (x, k) in out.items()}


def mismatches(top_k, device: str = "cpu") -> dict[str, str]:
    """Each case where `top_k` differs from the definition: its tokens exactly, its log-probs
    to float32 rounding."""
    found = {}
    for name, (logits, k) in cases(device).items():
        vals, ids = top_k(logits, k)
        want_vals, want_ids = definition(logits.cpu(), k)
        if not torch.equal(ids.cpu(), want_ids):
            found[name] = f"tokens {ids.cpu()[:2].tolist()} != {want_ids[:2].tolist()}"
        elif not torch.allclose(vals.cpu(), want_vals, rtol=0, atol=1e-5):
            found[name] = f"log-probs off by {(vals.cpu() - want_vals).abs().max().item()}"
        elif vals.dtype != torch.float32 or ids.dtype != torch.long:
            found[name] = f"dtypes {vals.dtype}, {ids.dtype}"
    return found


def test_the_cpu_path_is_torchs_top_k():
    logits = torch.randn(5, 3000)
    vals, ids = draft_top_k(logits, 7)
    want = torch.log_softmax(logits, -1).topk(7, -1)
    assert torch.equal(vals, want.values) and torch.equal(ids, want.indices)


INTERPRETED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import torch
    from flashtree.kernels import use_triton
    from flashtree.kernels.tree import draft_top_k
    from test_draft_top_k import mismatches
    assert use_triton(torch.zeros(1))  # the kernels, not the definition
    print(json.dumps(mismatches(draft_top_k)))
""")


def test_the_kernels_under_the_interpreter_equal_the_definition():
    pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")
    assert run_interpreted(INTERPRETED, threads=1) == {}


def test_the_kernels_compile_for_sm90():
    """Triton's compiler is stricter than its interpreter (loop-carried types, reductions over
    int64): both kernels compile for the H100/H200, ptxas included."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashtree.kernels.triton_topk import _top_k_chunk_kernel, _top_k_merge_kernel

    for kernel, types, constants in (
            (_top_k_chunk_kernel, ["*fp32", "*fp32", "*i32", "*fp32", "*fp32", "i32", "i32", "i32"],
             {"K": 22, "KP": 32, "CHUNK": 4096}),
            (_top_k_chunk_kernel, ["*bf16", "*fp32", "*i32", "*fp32", "*fp32", "i32", "i32", "i32"],
             {"K": 22, "KP": 32, "CHUNK": 4096}),
            (_top_k_merge_kernel, ["*fp32", "*i32", "*fp32", "*fp32", "*fp32", "*i64", "i32"],
             {"K": 22, "KP": 32, "CP": 64, "NP": 2048})):
        runtime = [n for n in kernel.arg_names if n not in constants]
        signature = dict(zip(runtime, types, strict=True)) | {n: "constexpr" for n in constants}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm["cubin"]


@pytest.mark.gpu
def test_the_kernels_on_cuda_equal_the_definition():
    assert mismatches(draft_top_k, "cuda") == {}


@pytest.mark.gpu
def test_the_kernels_on_cuda_at_serving_shapes():
    """A shared draft phase's rows (8 blocks of 16) over Qwen3's and Qwen3.5's vocabularies."""
    g = torch.Generator().manual_seed(3)
    for vocab in (151936, 248320):
        logits = (torch.randn(128, vocab, generator=g) * 4).cuda()
        vals, ids = draft_top_k(logits, 22)
        want_vals, want_ids = definition(logits.cpu(), 22)
        assert torch.equal(ids.cpu(), want_ids), vocab
        # a row's values share its log-sum-exp, whose float32 sum of 248K exponentials the chunks
        # add in another order than torch's log_softmax: 2.6e-5 apart on an H100
        torch.testing.assert_close(vals.cpu(), want_vals, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,warps", [(4096, 1), (2048, 1), (1024, 1), (2048, 2)])
def test_other_chunk_launches_on_cuda_equal_the_definition(chunk, warps):
    """The chunk kernel's other launches (benchmarks/draft_topk.py times them) pick the same
    candidates as the definition at a draft block's rows over Qwen3.5's vocabulary."""
    from flashtree.kernels.triton_topk import top_k_log_probs

    logits = (torch.randn(16, 248320, generator=torch.Generator().manual_seed(5)) * 4).cuda()
    vals, ids = top_k_log_probs(logits, 22, chunk, warps)
    want_vals, want_ids = definition(logits.cpu(), 22)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(vals.cpu(), want_vals, rtol=0, atol=1e-4)
