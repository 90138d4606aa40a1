"""The launch of the attention kernels (triton_attention.py): rows a block, keys a block and a
split, warps, stages, the value dims' parts, for each shape of a forward, and for the
deterministic mode one launch for every shape. Plain Python, chosen from the shapes alone, so a
captured graph keeps its launch for every context length."""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton

from .attention import deterministic_chunk

BLOCK_N = 64  # keys per inner-loop block
MIN_CHUNK = 256  # keys per split at least (a prefill chunk's): short contexts use few splits
DECODE_ROWS = 64  # fewer new tokens than this: a decode step's launch (plan)
MAX_SPLITS = 64  # splits at most (at long contexts; short ones use fewer)
# A tree's launch over several sequences shares MAX_SPLITS / sequences splits among them, but at
# least this many (plan() says why)
SHARED_TREE_SPLITS = 16
DECODE_CHUNK_WORK = 32768  # keys x head dims of a decode step's split at least (decode_chunk)
# Over a cache of this many rows or more (a server for long contexts) an AR step at 256-wide heads
# runs 4 warps, not 8 (plan() says why)
LONG_CACHE = 16384
# A tree's launch at heads wider than 128 (plan() says why), where a block may use WIDE_TREE_SMEM
# bytes of shared memory (its 128-row block with the tail's rows needs 138 KB over a bf16 cache,
# 202 KB over q8_0 and 218 KB over q4_0, compiled for sm_90: an H100 or H200 gives 227 KB, a
# consumer GPU's 99 KB does not; a GPU between takes a launch of fewer stages); `flashtree
# bench --tree-attention` replaces it for one run, to time another launch inside the engine's forwards
WIDE_TREE_LAUNCH = {"block_m": 128, "nsplit": 64, "v_parts": 1, "warps": 8, "stages": 2, "tail": 2,
                    "min_chunk": 64}
WIDE_TREE_SMEM = 200 * 1024
# Keys of a tree's launch replaced at any head width, after WIDE_TREE_LAUNCH: empty but inside
# `flashtree bench --tree-attention`, which times other launches inside the engine's forwards
TREE_LAUNCH_TRIAL: dict[str, int] = {}


@lru_cache(maxsize=None)
def block_smem(device_index: int) -> int:
    """The shared memory a block may opt into on this CUDA device; Triton's interpreter (no CUDA)
    has no limit."""
    if torch.cuda.is_available():
        return getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)
    return 1 << 30


@lru_cache(maxsize=None)
def _target_programs(device_index: int) -> int:
    """About two programs per multiprocessor keep every SM busy while a split waits on memory."""
    if torch.cuda.is_available():
        return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count
    return 264


def plan(t: int, heads: int, kv_heads: int, device: torch.device, dim: int = 128,
         cast: bool = True, cache_rows: int = 0, sequences: int = 1) -> dict[str, int]:
    """The launch for t new tokens (block_m, m_blocks, nsplit, block_n, warps, stages, min_chunk,
    v_parts):
    a function of the shapes only, so a captured graph keeps its launch configuration for every
    context length. Heads wider than 128 (Qwen3.5's 256) take at most 64 rows a block, so the
    tiles fit in shared memory. A grid of fewer programs than two an SM splits its keys at least
    in two, and a prefill chunk (t >= 64) over a cache of plain values (`cast`) with 64-row blocks
    loads three key blocks ahead, which hides the key loads over a long context (faster than two
    stages for a chunk of Qwen3.5-27B's heads over a bf16 cache); a q4_0 cache, whose
    dequantizing needs the registers, keeps two (`python benchmarks/prefill_attention.py` sweeps
    the stages).

    A decode step (t < DECODE_ROWS: the AR step, a tree, a draft block) takes at most 64 rows a
    block and splits of at least decode_chunk(dim) keys, a tree (more than one row block) up to
    MAX_SPLITS of them; at 256-wide heads an AR step's one row block runs 8 warps. The step's few
    rows leave most SMs idle unless the keys are split finely: over a q4_0 cache, split + merge
    per forward, Qwen3.5-27B's AR step and 23-row tree are faster on 128-key splits than on
    256-key ones, and Qwen3-8B's tree on two 64-row blocks than on one of 128; Qwen3-8B's AR step
    stays at 32 splits, faster than 64 (`flashtree bench --quantize int4 --kv-type q4_0`'s kernel
    profiles; `python benchmarks/prefill_attention.py --decode` sweeps the launches alone). At
    256-wide heads a tree runs WIDE_TREE_LAUNCH where the GPU's shared memory holds it: its rows a
    KV head (138 in Qwen3.5-27B's verify(22)) as one full block of 128 rows at 8 warps whose
    program also computes the 16 rows of the tail block (row_launches; `tail` 2), so that each key
    block is dequantized once for all of them and few padded rows are computed (144, not 192),
    one program for all 256 value dims, over 64 splits of at least 64 keys (faster than the tail
    in a launch of its own, which loads and dequantizes every key again: by most at short
    contexts, where that second pass is most of the tail's time; docs/PERFORMANCE.md, "Attention
    at long context"). Its float32 accumulator spills a little, and yet, measured in the
    engine's verify forward (`flashtree bench --tree-attention`, which times other launches on the
    same weights), it beats the value dims in two programs (which compute every score twice) at 4K
    and by more over a 61K q4_0 context, where attention is most of what verify adds, and beats
    64-row blocks at both. Elsewhere (a smaller shared memory) a tree's rows run as 64-row blocks
    over 32 splits, the value dims of 256-wide heads in two programs.

    A launch over several sequences (`balance`) sizes its splits from all of their keys
    (triton_attention_merge.split_chunk): the nsplit splits are shared among the sequences, and a
    long sequence beside short ones keeps most of them. The sequences' rows fill the grid, so a
    tree's launch over several of them takes MAX_SPLITS / sequences splits, at least
    SHARED_TREE_SPLITS: 8 sequences of 4K in Qwen3-8B's tree launch then write and merge the
    partials of 2 splits each, rather than 8 of 64 splits, in 384 programs, and the
    rounds of 4 and 8 sessions ran 4% and 7% faster than over 64 (`flashtree bench --sessions
    4,8 --tree-attention '[{}, {"nsplit": 16}]'`). WIDE_TREE_LAUNCH keeps its splits (its
    sessions are not measured with fewer). A sequence's bits then follow the lengths beside it,
    as its GEMMs' bits follow the rows beside it; the deterministic mode's splits stay at fixed
    positions.

    Over a cache of LONG_CACHE rows or more (`cache_rows`, a shape too: a server's --max-ctx),
    each split walks many key blocks, and the AR step at 256-wide heads runs 4 warps instead of
    8: faster for the 27B's AR forward over a long q4_0 context, at a small cost at 4K on such a
    cache. A tree keeps its launch: the alternative, its value dims in one program over 64
    splits, faster alone over a long context (`python benchmarks/prefill_attention.py --decode
    --quick --contexts 61440 --models qwen3.5-27b --splits 32,64,128,256`, which replays one
    layer's keys and values, likely partly from L2), made the engine's verify(22) slower at long
    context and at 4K (`flashtree bench --contexts 4096,61440` measures both)."""
    rows = (heads // kv_heads) * t
    decode = t < DECODE_ROWS
    largest = 128 if dim <= 128 and not decode else 64
    block_m = next(b for b in (16, 32, 64, 128) if rows <= b or b == largest)
    m_blocks = triton.cdiv(rows, block_m)
    target = _target_programs(device.index or 0)
    want = target // (kv_heads * m_blocks)
    if kv_heads * m_blocks < target:
        want = max(want, 2)
    nsplit = min(MAX_SPLITS, 1 << int(math.log2(max(1, want))))
    tree = decode and m_blocks > 1
    v_parts = 2 if tree and dim > 128 else 1
    if tree:  # the value dims' parts take the place of as many splits
        nsplit = MAX_SPLITS // v_parts
        if sequences > 1:
            nsplit = max(SHARED_TREE_SPLITS, nsplit // sequences)
    min_chunk = decode_chunk(dim) if decode else MIN_CHUNK
    stages = 3 if block_m == 128 or (t >= 64 and block_m == 64 and cast) else 2
    warps = 8 if block_m == 128 or (decode and dim > 128 and block_m == 16 and cache_rows < LONG_CACHE) else 4
    chosen = {"block_m": block_m, "nsplit": nsplit, "block_n": BLOCK_N, "warps": warps, "stages": stages,
              "min_chunk": min_chunk, "v_parts": v_parts, "tail": 0, "balance": 1}
    if tree and dim > 128 and block_smem(device.index or 0) >= WIDE_TREE_SMEM:
        chosen.update(WIDE_TREE_LAUNCH)
    if tree:
        chosen.update(TREE_LAUNCH_TRIAL)
    chosen["m_blocks"] = sum(n for _, _, n in row_launches(rows, chosen["block_m"], bool(chosen["tail"])))
    return chosen


def deterministic_plan(t: int, dim: int, cache_rows: int) -> dict[str, int]:
    """The deterministic mode's launch for t new tokens over a cache of `cache_rows` rows: one
    for every t, so that a row's scores, softmax sums and splits never follow the rows beside it.
    Rows in blocks of 64 at 4 warps (the reductions of a row's scores follow the tile's layout),
    keys in blocks of BLOCK_N, the value dims in halves at heads wider than 128 (the decode launch
    of those), and the keys split at fixed positions: splits of `min_chunk` keys, a function of
    the cache's size alone (attention.deterministic_chunk), merged in order. A
    decode step (t < DECODE_ROWS) runs its splits in parallel and merges them; a prefill chunk
    (`seq`) walks them in one program a row block, which gives the same bits without a chunk's
    partials in memory."""
    chunk = deterministic_chunk(cache_rows, BLOCK_N)
    nsplit = max(1, triton.cdiv(cache_rows, chunk))
    return {"block_m": 64, "nsplit": nsplit, "block_n": BLOCK_N, "warps": 4, "stages": 2, "min_chunk": chunk,
            "v_parts": 2 if dim > 128 else 1, "tail": 0, "seq": int(t >= DECODE_ROWS), "balance": 0}


def decode_chunk(dim: int) -> int:
    """Keys a decode step's split takes at least: about the same work a split at any head width
    (256 keys at 128-wide heads, 128 at 256-wide)."""
    return max(BLOCK_N, DECODE_CHUNK_WORK // dim)


def smaller_launches(chosen: dict[str, int], same_blocks: bool = False) -> list[dict[str, int]]:
    """`chosen`, then launches needing less shared memory: fewer stages of loads ahead, then
    (unless `same_blocks`: the deterministic mode keeps its key blocks, which its reductions
    follow) half the keys a block (down to 16) from the chosen stages again. Consumer GPUs give a block
    99 KB where an H200 gives 227: at Qwen3.5's 256-wide heads a 64-row block's bf16 keys and
    values, two stages ahead, need 104 KB there (tests/test_attention_smem.py compiles these for
    sm_86 on the CPU)."""
    out = []
    block_n = chosen["block_n"]
    while block_n >= 16:
        out += [dict(chosen, block_n=block_n, stages=st) for st in range(chosen["stages"], 0, -1)]
        block_n = 0 if same_blocks else block_n // 2
    return out


def row_launches(rows: int, block_m: int, tail: bool) -> list[tuple[int, int, int]]:
    """The row-block launches (first row, rows a block, blocks) that cover `rows` query rows of a
    KV head: blocks of block_m, or with `tail` whole blocks of block_m and the rest in one block
    of the smallest power of two from 16 that holds it (a 27B tree's 138 rows as 128 + 16 rather
    than 2 x 128, or 64 + 64 + 16 rather than 3 x 64: fewer padded rows to compute). Returns the
    launches and, as their last block's end, the rows the partials are laid out for."""
    if not tail or rows <= block_m:
        return [(0, block_m, triton.cdiv(rows, block_m))]
    full, rest = divmod(rows, block_m)
    out = [(0, block_m, full)]
    if rest:
        out.append((full * block_m, max(16, triton.next_power_of_2(rest)), 1))
    return out
