"""The attention kernel's launches on GPUs with less shared memory than an H200: the fallback to
smaller launches when one does not load, and that the fallbacks reach one that fits a consumer
GPU (99 KB a block on sm_86/sm_89), compiled here for sm_86 with Triton's own toolchain (no GPU).
Also the refusal of an fp8 cache where Triton cannot compile float8 e4m3."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from flashtree.errors import ConfigError  # noqa: E402
from flashtree.kernels import attention_launch, kv_storage  # noqa: E402
from flashtree.kernels import triton_attention as ta  # noqa: E402
from flashtree.kernels import triton_attention_merge as tam  # noqa: E402
from flashtree.runtime.compute import check_kv_types  # noqa: E402

CONSUMER_SMEM = 101_376  # bytes a block may use on sm_86 and sm_89 (opt-in)
CPU = torch.device("cpu")


class FakeKernel:
    """Stands in for a Triton kernel: records each launch's BLOCK_N and stages, and refuses those
    needing more than `budget` by a rough size (what Triton raises before a kernel runs)."""

    def __init__(self, budget: int):
        self.budget, self.calls = budget, []

    @staticmethod
    def need(kw: dict) -> int:
        return kw.get("num_stages", 1) * kw.get("BLOCK_N", 64) * 1000

    @property
    def launches(self) -> list[tuple]:
        """(BLOCK_N, stages, loaded) of each launch, in order."""
        return [(kw.get("BLOCK_N"), kw.get("num_stages"), self.need(kw) <= self.budget) for _, kw in self.calls]

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, kw))
            need = self.need(kw)
            if need > self.budget:
                raise OutOfResources(need, self.budget, "shared memory")
        return launch


def test_a_launch_that_does_not_fit_gives_way_to_a_smaller_one_and_is_remembered(monkeypatch):
    split, merge = FakeKernel(70_000), FakeKernel(10 ** 9)
    monkeypatch.setattr(ta, "_split_kernel", split)
    monkeypatch.setattr(ta, "merge_kernel", merge)
    monkeypatch.setattr(ta, "_LOADED", {})
    q, k = torch.zeros(512, 24, 256, dtype=torch.bfloat16), torch.zeros(600, 4, 256, dtype=torch.bfloat16)
    length = torch.tensor([88], dtype=torch.int32)
    ta.attention(q, k, k, length, 0.1, ta.MODE_CAUSAL, None, None, launch={"stages": 3})
    assert split.launches == [(64, 3, False), (64, 2, False), (64, 1, True)]
    ta.attention(q, k, k, length, 0.1, ta.MODE_CAUSAL, None, None, launch={"stages": 3})
    assert split.launches[3:] == [(64, 1, True)]  # the same shapes go straight to what loaded
    assert len(merge.launches) == 2  # nsplit 2 for this grid: the merge runs after the launch that loaded
    ta.attention(q[:100], k, k, length, 0.1, ta.MODE_CAUSAL, None, None, launch={"stages": 3})
    assert split.launches[4:] == [(64, 1, True)]  # and so does a chunk of another length (nsplit)


def test_nothing_that_fits_raises_the_last_refusal(monkeypatch):
    monkeypatch.setattr(ta, "_split_kernel", FakeKernel(1))
    monkeypatch.setattr(ta, "_LOADED", {})
    q, k = torch.zeros(1, 24, 256, dtype=torch.bfloat16), torch.zeros(64, 4, 256, dtype=torch.bfloat16)
    with pytest.raises(OutOfResources):
        ta.attention(q, k, k, torch.tensor([3], dtype=torch.int32), 0.1, ta.MODE_CAUSAL, None, None)


def test_prefill_chunks_of_any_length_share_one_compiled_kernel(monkeypatch):
    """What a kernel is compiled for (its constexprs and launch options) must not follow a prefill
    chunk's length: each turn of a conversation ends its prefill with a chunk of a new length, and
    a new compile took seconds on the GPU. The split count follows it, as a plain argument."""
    split = FakeKernel(10 ** 9)
    monkeypatch.setattr(ta, "_split_kernel", split)
    monkeypatch.setattr(ta, "merge_kernel", FakeKernel(10 ** 9))
    monkeypatch.setattr(ta, "_LOADED", {})
    k = torch.zeros(700, 4, 256, dtype=torch.bfloat16)
    for t in (65, 77, 102, 246, 266, 333, 512):
        ta.attention(torch.zeros(t, 24, 256, dtype=torch.bfloat16), k, k, torch.tensor([40], dtype=torch.int32),
                     0.1, ta.MODE_CAUSAL, None, None)
    assert len({tuple(sorted(kw.items())) for _, kw in split.calls}) == 1
    assert len({grid[2] for grid, _ in split.calls}) > 1  # the split count (the grid's third axis) does vary


def test_a_trees_tail_rows_go_to_the_full_blocks_program_only_where_asked(monkeypatch):
    """The 27B's verify(22) rows (138 a KV head: 128 + 16): `tail` 1 launches the split kernel
    twice (the tail block at row 128, no tail rows in the first), `tail` 2 once with the 16 tail
    rows in the full block's program, and the deterministic mode (a token's ancestors a row block
    at a time) keeps the two launches; the merge tiles the same 144 rows of partials in each."""
    q, k = torch.zeros(23, 24, 256, dtype=torch.bfloat16), torch.zeros(300, 4, 256, dtype=torch.bfloat16)
    mask = torch.ones(23, 23, dtype=torch.uint8)
    seen = {}
    for tail, det in ((1, False), (2, False), (2, True)):
        split, merge = FakeKernel(10 ** 9), FakeKernel(10 ** 9)
        monkeypatch.setattr(ta, "_split_kernel", split)
        monkeypatch.setattr(ta, "merge_kernel", merge)
        monkeypatch.setattr(ta, "_LOADED", {})
        monkeypatch.setattr(ta, "deterministic", lambda det=det: det)
        ta.attention(q, k, k, torch.tensor([200], dtype=torch.int32), 0.1, ta.MODE_MASK, mask, None,
                     launch={"block_m": 128, "tail": tail, "nsplit": 4, "v_parts": 1, "seq": 0})
        seen[tail, det] = ([(kw["BLOCK_M"], kw["TAIL_M"]) for _, kw in split.calls],
                           [(grid[0], kw["BLOCK_M"]) for grid, kw in merge.calls])
    assert seen[1, False] == ([(128, 0), (16, 0)], [(9, 16)])
    assert seen[2, False] == ([(128, 16)], [(9, 16)])
    assert seen[2, True] == seen[1, False]


def compile_for(kern, arch: int, consts: dict, types: dict, warps: int, stages: int = 1):
    """`kern` compiled for sm_`arch` with Triton's own toolchain (no GPU): `consts` its
    constexprs (one left out takes its default), `types` its pointer arguments' types (any other
    argument an i32, qk_scale and eps float32), every pointer and stride 16-aligned as the
    launcher's are."""
    consts = {p.name: p.default for p in kern.params if p.is_constexpr and p.has_default} | consts
    runtime = [n for n in kern.arg_names if n not in consts]
    signature = {n: types.get(n, "fp32" if n in ("qk_scale", "eps") else "i32") for n in runtime}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in runtime
             if n in types or n.startswith("stride")}
    return triton.compile(ASTSource(fn=kern, signature=signature | {n: "constexpr" for n in consts},
                                    constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def compiled_smem(arch: int, launch: dict, dim: int, kind: int, seq: bool = False, by_depth: bool = False,
                  paged: bool = False) -> int:
    """Shared memory of the split kernel compiled for sm_`arch` with `launch` (`seq`: walking its
    splits, the deterministic mode's prefill; `by_depth`: its trees, a token a row block; `paged`:
    the cache read through a page table)."""
    consts = dict(KVH=4, G=6, D=dim, BLOCK_M=launch["block_m"], BLOCK_N=launch["block_n"],
                  MIN_CHUNK=attention_launch.MIN_CHUNK, MODE=ta.MODE_CAUSAL, HAS_WINDOW=False, K_KIND=kind,
                  V_KIND=kind, V_PARTS=launch.get("v_parts", 1), SEQ=seq, BY_DEPTH=by_depth, T_PAD=32, PAGED=paged,
                  ASM=True, PDL=False,  # the launcher's on CUDA; q8_0 and q4_0 codes as int32 words
                  TAIL_M=16 if launch.get("tail") == 2 else 0)  # a 27B tree's tail rows in the program
    code = "*bf16" if kind == kv_storage.CAST else "*i32"
    types = {"Q": "*bf16", "K": code, "V": code, "KS": "*bf16" if kind == kv_storage.CAST else "*fp16",
             "OUT": "*bf16", "PO": "*fp32", "PM": "*fp32", "PL": "*fp32", "LEN": "*i32", "MASK": "*bf16",
             "PAGES": "*i32"}
    types["VS"] = types["KS"]
    return compile_for(ta._split_kernel, arch, consts, types, launch["warps"], launch["stages"]).metadata.shared


@pytest.mark.slow  # three compiles
def test_the_merge_and_the_stores_of_several_sequences_compile_for_sm_90():
    """The kernels a batched forward launches once for every sequence (axis 1 or a row's
    sequence picks its length, table and rows): the merge of the splits and the two fused K/V
    stores, over a paged q4_0 cache, and the split kernel over balanced splits, compile for the
    GPU."""
    from flashtree.kernels import triton_fused as tf
    merge = dict(KVH=4, G=6, D=256, DC=64, BLOCK_M=64, MIN_CHUNK=attention_launch.MIN_CHUNK, BLOCK_N=64, PDL=False)
    assert compile_for(tam.merge_kernel, 90, merge, {n: "*fp32" for n in ("PO", "PM", "PL")} |
                       {"OUT": "*bf16", "LEN": "*i32"}, 4).asm["ptx"]
    pointers = {n: "*bf16" for n in ("QKV", "COS", "SIN", "QW", "KW", "QOUT", "GATE")}
    pointers |= {"KC": "*u8", "VC": "*u8", "KS": "*fp16", "VS": "*fp16", "LEN": "*i32", "PAGES": "*i32",
                 "POS": "*i64"}
    stores = dict(HQ=24, HKV=4, D=256, K_KIND=kv_storage.Q4, V_KIND=kv_storage.Q4, K_PACK=2, V_PACK=2, PAGED=True,
                  PDL=False)
    assert compile_for(tf._gated_qkv_kernel, 90, stores | {"ROT": 64}, pointers, 2).asm["ptx"]
    assert compile_for(tf._qkv_kernel, 90, stores | {"HAS_NORM": True}, pointers, 1).asm["ptx"]
    # the split kernel whose axis 2 walks every sequence's balanced splits in turn
    consts = dict(KVH=8, G=4, D=128, BLOCK_M=64, BLOCK_N=64, MIN_CHUNK=256, MODE=ta.MODE_MASK, HAS_WINDOW=False,
                  K_KIND=kv_storage.CAST, V_KIND=kv_storage.CAST, V_PARTS=1, SEQ=False, BY_DEPTH=False, T_PAD=32,
                  PAGED=True, BALANCE=True, PDL=False)
    types = {n: "*bf16" for n in ("Q", "K", "V", "KS", "VS", "OUT")} | {n: "*fp32" for n in ("PO", "PM", "PL")}
    types |= {"LEN": "*i32", "MASK": "*u8", "PAGES": "*i32"}
    assert compile_for(ta._split_kernel, 90, consts, types, 4, 2).asm["ptx"]


@pytest.mark.slow  # six compiles, about a minute on two cores
@pytest.mark.parametrize("kind", [kv_storage.CAST, kv_storage.Q8, kv_storage.Q4], ids=["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("t", [23, 512])
def test_the_fallbacks_reach_a_launch_that_fits_a_consumer_gpu(kind, t, monkeypatch):
    """Qwen3.5's 256-wide heads with 64-row blocks (a verify, a prefill chunk) on a GPU of sm_86's
    shared memory: walked as the launcher walks them, the first that fits its 99 KB exists (and a
    bf16 cache's prefill plan does not fit there as planned: the fallback is what makes it run;
    a verify's, with its value dims in two programs, does)."""
    monkeypatch.setattr(attention_launch, "block_smem", lambda index: CONSUMER_SMEM)
    chosen = attention_launch.plan(t, 24, 4, CPU, 256, kind == kv_storage.CAST)
    sizes = []
    for launch in attention_launch.smaller_launches(chosen):
        sizes.append(compiled_smem(86, launch, 256, kind))
        if sizes[-1] <= CONSUMER_SMEM:
            break
    assert sizes[-1] <= CONSUMER_SMEM, sizes
    if kind == kv_storage.CAST:  # planned: a prefill chunk's does not fit, a verify's does
        assert (sizes[0] > CONSUMER_SMEM) == (t == 512), sizes


@pytest.mark.slow  # three compiles
@pytest.mark.parametrize("kind", [kv_storage.CAST, kv_storage.Q8, kv_storage.Q4], ids=["bf16", "q8_0", "q4_0"])
def test_a_wide_tree_runs_a_full_block_and_a_tail_where_the_gpu_holds_it(kind, monkeypatch):
    """A verify(22) of Qwen3.5's heads: on a GPU of an H100's shared memory its 138 rows a KV head
    run as a 128-row block whose program also computes the 16-row tail (WIDE_TREE_LAUNCH), and
    whose compile for sm_90 fits there; on a consumer GPU as three 64-row blocks."""
    monkeypatch.setattr(attention_launch, "block_smem", lambda index: 232_448)
    wide = attention_launch.plan(23, 24, 4, CPU, 256, kind == kv_storage.CAST)
    assert (wide["block_m"], wide["tail"], wide["m_blocks"]) == (128, 2, 2)
    assert attention_launch.row_launches(138, 128, True) == [(0, 128, 1), (128, 16, 1)]
    assert compiled_smem(90, wide, 256, kind) <= 232_448
    monkeypatch.setattr(attention_launch, "block_smem", lambda index: CONSUMER_SMEM)
    narrow = attention_launch.plan(23, 24, 4, CPU, 256, kind == kv_storage.CAST)
    assert (narrow["block_m"], narrow["tail"], narrow["m_blocks"]) == (64, 0, 3)


def test_over_a_long_cache_a_wide_heads_ar_step_runs_4_warps_and_nothing_else_changes():
    """Qwen3.5's 256-wide heads (24 over 4 KV heads): below LONG_CACHE rows the AR step's row
    block runs 8 warps, from LONG_CACHE rows on 4, with the same splits. A tree, a prefill chunk,
    128-wide heads and the draft's block plan alike at any cache length."""
    short, long = attention_launch.LONG_CACHE - 1, attention_launch.LONG_CACHE
    ar = [attention_launch.plan(1, 24, 4, CPU, 256, False, rows) for rows in (short, long)]
    assert [(p["warps"], p["block_m"]) for p in ar] == [(8, 16), (4, 16)]
    assert {k: v for k, v in ar[0].items() if k != "warps"} == {k: v for k, v in ar[1].items() if k != "warps"}
    for t, heads, kv_heads, dim in ((23, 24, 4, 256), (512, 24, 4, 256), (1, 32, 8, 128), (23, 32, 8, 128),
                                    (16, 32, 8, 128)):
        plan = attention_launch.plan
        assert plan(t, heads, kv_heads, CPU, dim, False, short) == plan(t, heads, kv_heads, CPU, dim, False, long)


def test_a_tree_over_several_sequences_shares_fewer_splits_and_the_rest_plan_alike(monkeypatch):
    """Qwen3-8B's verify(22) (128-wide heads, 32 over 8 KV heads): a tree's launch over S
    sequences takes MAX_SPLITS / S splits, at least SHARED_TREE_SPLITS, and nothing else changes;
    one sequence's, an AR row's over several, and Qwen3.5's wide tree launch keep theirs."""
    monkeypatch.setattr(attention_launch, "block_smem", lambda index: 232_448)
    plan = attention_launch.plan
    alone = plan(23, 32, 8, CPU, 128, True, 0, 1)
    assert alone["nsplit"] == attention_launch.MAX_SPLITS
    for sequences, nsplit in ((2, 32), (4, 16), (8, 16), (16, 16)):
        shared = plan(23, 32, 8, CPU, 128, True, 0, sequences)
        assert shared == {**alone, "nsplit": nsplit}, sequences
    assert plan(1, 32, 8, CPU, 128, True, 0, 8) == plan(1, 32, 8, CPU, 128, True, 0, 1)
    assert plan(23, 24, 4, CPU, 256, True, 0, 8) == plan(23, 24, 4, CPU, 256, True, 0, 1)


def test_fp8_caches_are_refused_before_ada(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ConfigError, match="8.9 or later.*8.6"):
        check_kv_types(cuda, "fp8", None)
    with pytest.raises(ConfigError):
        check_kv_types(cuda, "q4_0", "fp8")
    check_kv_types(cuda, "q8_0", "q4_0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_kv_types(cuda, "fp8", "fp8")
    check_kv_types(CPU, "fp8", None)  # the CPU path dequantizes in torch


@pytest.mark.slow  # four compiles
@pytest.mark.parametrize("arch", [90, 86])
@pytest.mark.parametrize("t", [23, 512])
def test_the_deterministic_launches_compile_and_fit(arch, t, monkeypatch):
    """The deterministic mode's one launch at Qwen3.5's 256-wide heads over a q4_0 cache, as a
    verify's tree runs it (a token a row block, its ancestors by depth) and as a prefill chunk
    does (SEQ: the program walks its splits), compiles for sm_90 and sm_86 and, with the stages
    the launcher may drop to (never other key blocks), fits the GPU's shared memory."""
    smem = 232_448 if arch == 90 else CONSUMER_SMEM
    chosen = attention_launch.deterministic_plan(t, 256, 65536)
    assert chosen["seq"] == (t >= 64) and chosen["block_m"] == 64
    sizes = []
    for launch in attention_launch.smaller_launches(chosen, same_blocks=True):
        assert launch["block_n"] == chosen["block_n"]
        sizes.append(compiled_smem(arch, launch, 256, kv_storage.Q4, seq=t >= 64, by_depth=t < 64))
        if sizes[-1] <= smem:
            break
    assert sizes[-1] <= smem, sizes


@pytest.mark.slow  # four compiles
@pytest.mark.parametrize("arch, mode", [(90, "tree"), (86, "deterministic tree"), (90, "deterministic prefill")])
def test_a_paged_cache_compiles_to_the_same_shared_memory(arch, mode, monkeypatch):
    """A launch over a q4_0 cache read through a page table (each key block's rows translated
    before its loads) compiles for the GPU and needs the shared memory the contiguous cache's
    launch does: a verify's tree, the deterministic mode's tree by depth and its prefill chunk
    walking its splits."""
    monkeypatch.setattr(attention_launch, "block_smem", lambda index: 232_448 if arch == 90 else CONSUMER_SMEM)
    t = 512 if mode == "deterministic prefill" else 23
    if mode.startswith("deterministic"):
        chosen = dict(attention_launch.deterministic_plan(t, 256, 65536), stages=1)
    else:
        chosen = attention_launch.plan(t, 24, 4, CPU, 256, False)
    sizes = [compiled_smem(arch, chosen, 256, kv_storage.Q4, seq=bool(chosen.get("seq")), by_depth=mode == "deterministic tree",
                           paged=paged) for paged in (False, True)]
    assert sizes[0] == sizes[1], sizes
