"""The Triton kernels against their definitions (the PyTorch fallbacks), on fresh random bf16
inputs: attention in every mask mode, GQA ratio, split count and length regime; the fused norm,
RoPE/KV-store and SiLU ops bit-for-bit up to the last bf16 place."""

import pytest
import torch

from flashtree.kernels.attention import cache_attention, reference_attention
from flashtree.kernels.fused import qkv_rope_store, rms_norm, silu_mul
from flashtree.kernels.kv_storage import QuantRows, quantize_kv
from flashtree.models.rope import RotaryTable
from flashtree.runtime.ddtree import build_tree

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tree_mask(n, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(15, 100, generator=g), -1).sort(-1, descending=True)
    tree = build_tree(1, logp.values, logp.indices, n - 1, True, 15)
    assert tree.size == n
    return tree.ancestor_mask(DEV)


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 8)])
@pytest.mark.parametrize("t,mode", [(1, "causal"), (16, "all"), (23, "mask"), (65, "mask"),
                                    (16, "causal"), (512, "causal")])
@pytest.mark.parametrize("length", [0, 200, 33000])
def test_attention_matches_reference(heads, kv_heads, t, mode, length):
    if t == 512 and length == 33000:
        pytest.skip("covered by the shorter prefill case; the fp32 reference is slow")
    torch.manual_seed(length * 7 + t)
    cap = length + t + 17
    k = torch.randn(cap, kv_heads, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(cap, kv_heads, 128, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(t, heads, 128, device=DEV, dtype=torch.bfloat16)
    mask = tree_mask(t, length) if mode == "mask" else None
    causal = mode == "causal"
    lt = torch.tensor([length], dtype=torch.int32, device=DEV)
    out = cache_attention(q, k, v, lt, 128 ** -0.5, mask, causal)
    ref = reference_attention(q.float(), k.float(), v.float(), length, 128 ** -0.5, mask, causal, None)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("length", [3, 300, 5000])
def test_attention_window_matches_reference(length):
    torch.manual_seed(length)
    k = torch.randn(length + 40, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(16, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = cache_attention(q, k, v, length, 0.1, window=100)
    ref = reference_attention(q.float(), k.float(), v.float(), length, 0.1, None, False, 100)
    assert rel(out, ref) < 1e-2


def test_attention_reads_length_from_the_device():
    """One launch configuration, many lengths: the result follows the tensor's value."""
    torch.manual_seed(0)
    k = torch.randn(3000, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(23, 32, 128, device=DEV, dtype=torch.bfloat16)
    mask = tree_mask(23, 1)
    lt = torch.zeros(1, dtype=torch.int32, device=DEV)
    for length in (5, 900, 2900):
        lt.fill_(length)
        out = cache_attention(q, k, v, lt, 0.09, mask)
        ref = reference_attention(q.float(), k.float(), v.float(), length, 0.09, mask, False, None)
        assert rel(out, ref) < 1e-2


def test_rms_norm_matches_eager():
    torch.manual_seed(1)
    x = torch.randn(7, 4096, device=DEV, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).bfloat16()
    out, total = rms_norm(x, w, 1e-6, r)
    ref_total = x + r
    ref = w * (ref_total.float() * torch.rsqrt(ref_total.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(total, ref_total)
    assert rel(out, ref) < 2e-3 and (out.float() - ref.float()).abs().max() <= 0.07


def test_silu_mul_matches_eager():
    torch.manual_seed(2)
    gu = torch.randn(5, 2 * 12288, device=DEV, dtype=torch.bfloat16)
    ref = torch.nn.functional.silu(gu[:, :12288]) * gu[:, 12288:]
    assert rel(silu_mul(gu), ref) < 2e-3


@pytest.mark.parametrize("heads,norm", [(32, True), (0, True), (32, False)])
def test_qkv_rope_store_matches_eager(heads, norm):
    torch.manual_seed(3)
    t, kv, d = 9, 8, 128
    rope = RotaryTable(d, {"rope_type": "default", "rope_theta": 1e6}, 4096).to(DEV)
    qkv = torch.randn(t, (heads + 2 * kv) * d, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device=DEV)
    qn = (1 + 0.1 * torch.randn(d, device=DEV)).bfloat16() if norm and heads else None
    kn = (1 + 0.1 * torch.randn(d, device=DEV)).bfloat16() if norm else None
    length = torch.tensor([100], dtype=torch.int32, device=DEV)
    caches = [torch.full((120, kv, d), float("nan"), device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    q_gpu = qkv_rope_store(qkv, pos, rope.cos, rope.sin, qn, kn, 1e-6, caches[0], caches[1], length, heads, kv)
    cpu = [c.cpu() for c in caches[2:]]
    q_cpu = qkv_rope_store(qkv.cpu(), pos.cpu(), rope.cos.cpu(), rope.sin.cpu(),
                           qn.cpu() if qn is not None else None, kn.cpu() if kn is not None else None,
                           1e-6, cpu[0], cpu[1], length.cpu(), heads, kv)
    assert torch.isnan(caches[0][:100].float()).all() and torch.isnan(caches[0][109:].float()).all()
    assert rel(caches[0][100:109].cpu(), cpu[0][100:109]) < 4e-3  # within one bf16 ulp
    assert torch.equal(caches[1][100:109].cpu(), cpu[1][100:109])
    if heads:
        assert rel(q_gpu.cpu(), q_cpu) < 4e-3


def quantized(kind, x):
    return QuantRows(kind, *quantize_kv(x, kind))


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("fp8", "q4_0")])
@pytest.mark.parametrize("t,mode,length", [(1, "causal", 4000), (23, "mask", 1000), (512, "causal", 0)])
def test_attention_over_a_quantized_cache_matches_reference(k_type, v_type, t, mode, length):
    """The split kernel dequantizes codes + scales in registers: the attention of the values
    they stand for."""
    torch.manual_seed(t + length)
    cap = length + t + 17
    k = quantized(k_type, torch.randn(cap, 8, 128, device=DEV, dtype=torch.bfloat16))
    v = quantized(v_type, torch.randn(cap, 8, 128, device=DEV, dtype=torch.bfloat16))
    q = torch.randn(t, 32, 128, device=DEV, dtype=torch.bfloat16)
    mask = tree_mask(t, length) if mode == "mask" else None
    lt = torch.tensor([length], dtype=torch.int32, device=DEV)
    out = cache_attention(q, k, v, lt, 128 ** -0.5, mask, mode == "causal")
    ref = reference_attention(q.float(), k, v, length, 128 ** -0.5, mask, mode == "causal", None)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


@pytest.mark.parametrize("kv_type", ["bf16", "q4_0"])
@pytest.mark.parametrize("t,mode,length,long_cache", [(23, "mask", 3000, False), (512, "causal", 3000, False),
                                                      (1, "causal", 9000, True)])
def test_attention_over_256_wide_heads_matches_reference(kv_type, t, mode, length, long_cache):
    """Qwen3.5's heads (256 wide, 24 over 4 KV heads): the launches plan() picks for a verify and
    a prefill chunk (split in two, three stages ahead for a bf16 cache), and for an AR step over
    a long-context server's cache (LONG_CACHE rows: 4 warps)."""
    from flashtree.kernels.attention_launch import LONG_CACHE, plan
    torch.manual_seed(t)
    cap = LONG_CACHE if long_cache else length + t + 17
    k, v = (torch.randn(cap, 4, 256, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    if kv_type != "bf16":
        k, v = quantized(kv_type, k), quantized(kv_type, v)
    if long_cache:
        assert plan(t, 24, 4, torch.device(DEV), 256, kv_type == "bf16", cap)["warps"] == 4
    q = torch.randn(t, 24, 256, device=DEV, dtype=torch.bfloat16)
    mask = tree_mask(t, length) if mode == "mask" else None
    lt = torch.tensor([length], dtype=torch.int32, device=DEV)
    out = cache_attention(q, k, v, lt, 256 ** -0.5, mask, mode == "causal")
    ref = reference_attention(q.float(), k if kv_type != "bf16" else k.float(), v if kv_type != "bf16" else v.float(),
                              length, 256 ** -0.5, mask, mode == "causal", None)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


@pytest.mark.parametrize("tail", [1, 2])
@pytest.mark.parametrize("length", [3000, 40000])
def test_a_trees_tail_rows_in_their_own_launch_or_in_the_full_blocks_program(tail, length):
    """The 27B's tree rows (23 tokens of 6 query heads a KV head: 128 + 16) over a q4_0 cache,
    the tail block launched on its own (tail 1) or computed by the full block's program over the
    same key blocks (tail 2): both the definition's attention."""
    from flashtree.kernels.triton_attention import MODE_MASK, attention
    torch.manual_seed(length)
    k, v = (quantized("q4_0", torch.randn(length + 40, 4, 256, device=DEV, dtype=torch.bfloat16)) for _ in range(2))
    q = torch.randn(23, 24, 256, device=DEV, dtype=torch.bfloat16)
    mask = tree_mask(23, length)
    lt = torch.tensor([length], dtype=torch.int32, device=DEV)
    launch = {"block_m": 128, "tail": tail, "v_parts": 1, "nsplit": 64, "warps": 8, "stages": 2, "min_chunk": 64}
    out = attention(q, k, v, lt, 256 ** -0.5, MODE_MASK, mask.view(torch.uint8), None, launch)
    ref = reference_attention(q.float(), k, v, length, 256 ** -0.5, mask, False, None)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-2


@pytest.mark.parametrize("kind", ["fp8", "q8_0", "q4_0"])
def test_qkv_rope_store_quantizes_like_eager(kind):
    """The quantizing store writes the codes the definition makes of the rows the plain store
    writes, bit for bit (the GPU's K rows differ from the CPU's by bf16 ulps after RoPE, which
    a comparison with CPU codes would confuse with the quantization), and V rows' codes equal
    the CPU's (they are stored as they come)."""
    torch.manual_seed(4)
    t, kv, d, heads = 9, 8, 128, 32
    rope = RotaryTable(d, {"rope_type": "default", "rope_theta": 1e6}, 4096).to(DEV)
    qkv = torch.randn(t, (heads + 2 * kv) * d, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device=DEV)
    kn = (1 + 0.1 * torch.randn(d, device=DEV)).bfloat16()
    length = torch.tensor([100], dtype=torch.int32, device=DEV)
    gpu = [quantized(kind, torch.zeros(120, kv, d, device=DEV)) for _ in range(2)]
    untouched = gpu[0].codes.clone()  # (q4_0 stores a zero as code 8)
    plain = [torch.zeros(120, kv, d, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    cpu = [quantized(kind, torch.zeros(120, kv, d)) for _ in range(2)]
    qkv_rope_store(qkv, pos, rope.cos, rope.sin, kn, kn, 1e-6, *gpu, length, heads, kv)
    qkv_rope_store(qkv, pos, rope.cos, rope.sin, kn, kn, 1e-6, *plain, length, heads, kv)
    qkv_rope_store(qkv.cpu(), pos.cpu(), rope.cos.cpu(), rope.sin.cpu(), kn.cpu(), kn.cpu(), 1e-6, *cpu,
                   length.cpu(), heads, kv)
    codes, scale = quantize_kv(plain[0][100:109], kind)
    assert torch.equal(gpu[0].codes[100:109], codes)
    if scale is not None:
        assert torch.equal(gpu[0].scale[100:109], scale)
    assert torch.equal(gpu[0].codes[:100], untouched[:100]) and torch.equal(gpu[0].codes[109:], untouched[109:])
    assert torch.equal(gpu[1].codes.cpu(), cpu[1].codes)
