"""The measurements of `flashtree bench` for one model pair: the device's ceilings, and our AR,
draft, tree-verify, full-step and prefill times through the engine's own decoder and runner.

Two kinds of time are taken. *Step* times are wall-clock around the decoder's real calls (host
work, the syncs that read the draft's top-k and the accepted path, commit and context append
included): what a user gets. *Device* times are CUDA-event times of one graph replay: what the
GPU spends, the number to hold against the bandwidth floor. Medians throughout.

The pair's draft may be of any kind (bench/models.py): the decoder drafts with it as the engine
would. A pair on the CPU (the tests' tiny presets) runs the same measurements eagerly; there the
host is the device, so a device time is the call's wall time and no busy time is taken.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..kernels.kv_storage import store_kv
from ..models.inputs import ForwardInput
from ..models.mtp import MTPDraft
from ..models.kv_cache import KVCache
from ..runtime.ddtree import build_tree
from ..runtime.decoding import Decoder, PlannedTree
from ..runtime.graphs import ModelRunner
from ..runtime.sampling import Sampler, SamplingParams
from ..runtime.sequence import SequenceState
from .models import RandomPair

BONUS = 123
LOOP_STEPS = 16  # steps a timed run of the pipelined loop takes


CUDA = torch.device("cuda")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU's is done already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], Any], iters: int, warmup: int = 3, device: torch.device = CUDA) -> float:
    """The median wall time of a call of `fn`, the device's work waited for around each."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def device_ms(fn: Callable[[], Any], iters: int, warmup: int = 3, device: torch.device = CUDA) -> float:
    """The median CUDA-event time of a call of `fn`; on the CPU its wall time."""
    if device.type != "cuda":
        return wall_ms(fn, iters, warmup, device)
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def ceilings(iters: int = 10) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate, on random
    data several times the L2 in size."""
    def copy_ms(n: int) -> float:
        src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        return device_ms(lambda: dst.copy_(src), iters)

    def matmul_ms(n: int) -> float:
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        return device_ms(lambda: a @ b, iters)

    elems, side = 1 << 30, 8192  # 2 GiB of bf16 each way; an 8192^3 product
    return {"copy_bandwidth_GBps": 2 * elems * 2 / copy_ms(elems) / 1e6,
            "bf16_matmul_TFLOPs": 2 * side ** 3 / matmul_ms(side) / 1e9}


def kernel_times(fn: Callable[[], Any], reps: int, top: int = 16) -> list[dict[str, Any]]:
    """The `top` costliest kernels of `fn` by device time per call, `fn` run with PDL off
    (triton_pdl.pdl_off) where it launches eagerly: a kernel launched with PDL is timed from
    when its programs are placed, before its predecessor ends, so each would count the wait for
    the one before it (a short kernel such as a verify's RMSNorm would show many times its own
    time). Graphs captured earlier replay as captured."""
    from ..kernels.triton_pdl import pdl_off
    with pdl_off():
        prof = _profiled(fn, reps)
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if total > 0:
            rows.append({"kernel": e.key[:90], "calls_per_forward": e.count / reps,
                         "us_per_forward": total / reps})
    return sorted(rows, key=lambda r: -r["us_per_forward"])[:top]


def busy_ms(fn: Callable[[], Any], reps: int) -> float:
    """The time the device spends running kernels and copies during one call of `fn` (as it runs,
    graphs and PDL included): the union of their intervals, so that kernels that overlap under PDL
    count once. A call's wall time minus this is the time the GPU sat idle waiting for the host."""
    from torch.autograd import DeviceType

    prof = _profiled(fn, reps)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return covered(spans) / reps / 1000


def _profiled(fn: Callable[[], Any], reps: int) -> Any:
    """The CUDA profile of `reps` calls of `fn`, after one untimed call (compiles, warm caches)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def covered(spans: Sequence[tuple[float, float]]) -> float:
    """The length of the union of intervals (start, end)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        total += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return total


def random_rows(cache: KVCache) -> None:
    """Random keys and values in every row, stored as the cache stores them (a quantized cache
    gets the codes of random values, so attention reads finite numbers), a layer at a time."""
    cache.ensure(cache.capacity)
    rows = torch.arange(cache.capacity, device=cache.k.device)
    shape = (cache.capacity, cache.k.shape[2], cache.head_dim)
    for i in range(cache.k.shape[0]):
        for side in cache.layer(i):
            store_kv(side, rows, torch.randn(shape, dtype=cache.dtype, device=cache.k.device))


class PairBench:
    """One pair, its sequence state (random KV up to the largest context), one decoder per mode
    sharing a runner that holds every verify size, and an AR decoder with its own state over the
    same target cache and an AR-only runner, as an AR engine has. The runners' static buffers are
    captured in CUDA graphs on a GPU and run eagerly on the CPU."""

    def __init__(self, pair: RandomPair, budgets: Sequence[int], max_ctx: int, iters: int,
                 kv_type: Optional[str] = None, dflash2_tree: str = "topk"):
        self.pair, self.iters, self.budgets = pair, iters, list(budgets)
        target, draft = pair.target, pair.draft
        cap = max_ctx + 256
        norm = target.model.norm.weight  # dense in the model dtype, quantized or not (the lm_head may be)
        dtype, device = norm.dtype, norm.device
        self.device = device
        capture = device.type == "cuda"
        nodes = max(max(self.budgets) + 1, draft.config.block_size)
        self.state = SequenceState(target.new_cache(cap, dtype, device, nodes, kv_type),
                                   draft.new_cache(cap, dtype, device), device)
        self.ar_state = SequenceState(self.state.target, None, device)
        for cache in (getattr(self.state.target, "kv", self.state.target), self.state.draft):
            random_rows(cache)
        bs = draft.config.block_size
        self.bs = bs
        sizes = sorted({1, bs, *(b + 1 for b in budgets)})
        t0 = time.perf_counter()
        self.runner = ModelRunner(target, draft, self.state, draft.config.target_layer_ids, sizes, bs, capture,
                                  static=True)
        self.ar_runner = ModelRunner(target, None, self.ar_state, (), [1], bs, capture, static=True)
        self.capture_s = time.perf_counter() - t0
        self.dec = {"chain": Decoder(target, draft, self.state, self.runner, "chain", 22, bs, True),
                    "ddtree": Decoder(target, draft, self.state, self.runner, "ddtree", 22, bs, True, dflash2_tree)}
        self.dec["ar"] = Decoder(target, None, self.ar_state, self.ar_runner, "ar", 22, bs, True)
        self.sampler = Sampler(SamplingParams(), target.config.vocab_size, device, [])

    def _at(self, length: int) -> None:
        """Both states at `length` committed rows: cut back where they are at or past it (a
        hybrid's recurrent states from a checkpoint kept there), else refilled from empty."""
        for state in (self.state, self.ar_state):
            kept = not state.recurrent or length in (state.length, *state.points())
            if state.length >= length and kept:
                state.truncate(length)
            else:
                state.truncate(0)
                state.commit([BONUS] * length)
                state.checkpoint()

    def context(self, length: int) -> dict[str, Any]:
        """Every per-step number at one context length. The draft's numbers are of what a ddtree
        is built from (Decoder._draft_candidates: the draft forward, the head and the top-k
        log-probs, or a DFlash2 selector tree's candidates), its step time with their read by the
        host, its device time that of one graph of all of it. The target's device times include
        the lm_head, which runs right after the replay, as in a step."""
        ar, dd, chain = self.dec["ar"], self.dec["ddtree"], self.dec["chain"]
        it, bs, dev = self.iters, self.bs, self.device

        def step(d: Decoder, emit: int) -> Callable[[], None]:
            def run() -> None:
                self._at(length)
                d.step(BONUS, self.sampler, emit)
            return run

        def candidates(budget: int) -> tuple[torch.Tensor, torch.Tensor]:
            self._at(length)
            dd.budget = budget
            vals, ids = dd._draft_candidates(BONUS)
            return vals.cpu(), ids.cpu()

        out: dict[str, Any] = {"context": length}
        out["ar_step_ms"] = wall_ms(step(ar, 2), it, device=dev)
        out["draft_step_ms"] = wall_ms(lambda: candidates(22), it, device=dev)
        out["chain_step_ms"] = wall_ms(step(chain, bs), it, device=dev)
        out["verify_ms"], out["step_ms"] = {}, {}
        for b in self.budgets:
            tree = build_tree(BONUS, *candidates(b), b, True, bs - 1)
            # its paths (one a leaf): the deterministic mode's tree attention reads the tree's key
            # blocks once a path
            out.setdefault("tree_paths", {})[str(b)] = sum(not kids for kids in tree.children())

            def verify(tree=tree) -> None:
                self._at(length)
                dd.verify_tree(PlannedTree(tree, None, None), self.sampler)
            out["verify_ms"][str(b)] = wall_ms(verify, it, device=dev)
            dd.budget = b
            out["step_ms"][str(b)] = wall_ms(step(dd, bs), it, device=dev)
            out.setdefault("loop_step_ms", {})[str(b)] = wall_ms(self.loop(dd, length), it, device=dev) / LOOP_STEPS
            if dev.type == "cuda":
                out.setdefault("loop_busy_ms", {})[str(b)] = busy_ms(self.loop(dd, length), 3) / LOOP_STEPS
        dd.budget = 22
        self._at(length)
        logits = self.pair.target.logits

        def with_head(run: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: logits(run()[0])
        draft = self.runner.graph(("bench draft", id(dd)), lambda: dd._draft_candidates(None, True))
        out["device_ms"] = {"ar_forward": device_ms(with_head(self.ar_runner.verify[1].run), it, device=dev),
                            "draft_forward": device_ms(draft, it, device=dev),
                            "verify_forward": {str(b): device_ms(with_head(self.runner.verify[b + 1].run), it,
                                                                 device=dev)
                                               for b in self.budgets}}
        return out

    def kernel_profile(self, length: int, reps: int = 10) -> list[dict[str, Any]]:
        """Device time per kernel of one AR forward + lm_head, run eagerly (the kernels the graph
        replays): where the time above the bandwidth floor goes."""
        state, dev = self.ar_state, self.ar_state.target.k.device
        self._at(length)
        ids = torch.full((1,), BONUS, device=dev)
        pos = torch.full((1,), length, device=dev)

        def forward() -> None:
            hidden, _ = self.pair.target(ForwardInput(ids=ids, positions=pos, cache=state.target,
                                                      lengths=state.length_dev))
            self.pair.target.logits(hidden)
        return kernel_times(forward, reps)

    def verify_kernel_profile(self, length: int, budget: int, reps: int = 10) -> list[dict[str, Any]]:
        """Device time per kernel of the verify graph's forward for `budget` + 1 rows + the
        lm_head, run eagerly over the graph's static inputs (the kernels the graph replays): what
        a tree costs beyond the AR step's kernels."""
        self._at(length)
        forward, logits = self.runner.verify[budget + 1].run.fn, self.pair.target.logits
        return kernel_times(lambda: logits(forward()[0]), reps)

    def loop_kernel_profile(self, length: int, budget: int) -> list[dict[str, Any]]:
        """Device time per kernel of one ddtree step of the engine's pipelined loop (its phases'
        graph replays as they run): beside the forwards' kernels, the small ones around them (the
        draft's top-k, the tree build, the walk, the compaction, the context append) that the
        "host ms" column holds."""
        dd = self.dec["ddtree"]
        dd.budget = budget
        rows = kernel_times(self.loop(dd, length), 2, top=48)
        for r in rows:
            r["calls_per_forward"] /= LOOP_STEPS
            r["us_per_forward"] /= LOOP_STEPS
        return rows

    def loop(self, d: Decoder, length: int) -> Callable[[], None]:
        """LOOP_STEPS steps from `length` run as the engine runs them: each one's successor
        drafted on the device before it is read, so the host's work between steps overlaps the
        GPU's."""
        def run() -> None:
            self._at(length)
            room, bonus, ahead = (LOOP_STEPS + 2) * self.bs, BONUS, None
            for _ in range(LOOP_STEPS):
                launched = d.launch(bonus, self.sampler, room, ahead=ahead)
                ahead = d.draft_ahead(launched, room)
                res = d.read(launched)
                room -= len(res.tokens)
                bonus = res.tokens[-1]
        return run

    def greedy_tokens(self, prompt: list[int], n: int) -> list[int]:
        """Our greedy AR continuation (the peers' outputs on the same weights are held to it)."""
        ar = self.dec["ar"]
        ar.state.truncate(0)
        for i in range(0, len(prompt), 512):
            logits = ar.prefill_chunk(prompt[i:i + 512])
        out = [int(logits.argmax())]
        while len(out) < n:
            out.extend(ar.step(out[-1], self.sampler, n - len(out)).tokens)
        return out

    def prefill(self, tokens: int, ubatch: int) -> dict[str, Any]:
        """Prompt processing through the engine's chunked prefill (target and draft context)."""
        dd = self.dec["ddtree"]
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, self.pair.target_cfg["vocab_size"] - 1, (tokens,), generator=gen).tolist()

        def run() -> None:
            dd.state.truncate(0)
            for i in range(0, tokens, ubatch):
                dd.prefill_chunk(ids[i:i + ubatch])
        ms = wall_ms(run, 2, warmup=1, device=self.device)
        flops = prefill_flops(self.pair, tokens)
        return {"tokens": tokens, "ubatch": ubatch, "ms": ms, "tokens_per_s": tokens / ms * 1000,
                "flops": flops, "TFLOPs": flops / ms / 1e9}


def prefill_flops(pair: RandomPair, tokens: int) -> float:
    """Matmul FLOPs of a prefill: target linears (logits for the last row only), causal attention,
    and the draft's context rows: a DFlash or DFlash2 draft projects each row's features (fc) and
    each layer's k/v; an MTP draft runs its whole layer over each row (fc and the layer's
    linears; its one layer's attention left out)."""
    c = pair.target.config
    per_layer = sum(p.numel() for n, p in pair.target.model.layers[0].named_parameters() if p.dim() == 2)
    linear = 2 * tokens * per_layer * c.num_layers + 2 * c.vocab_size * c.hidden_size
    attn = 4 * c.num_heads * c.head_dim * (tokens * (tokens + 1) / 2) * c.num_layers
    d = pair.draft
    if isinstance(d, MTPDraft):
        return float(linear + attn + 2 * tokens * sum(p.numel() for p in d.parameters() if p.dim() == 2))
    draft_attn = d.layers[0].self_attn
    kv = draft_attn.qkv_proj.weight[draft_attn.kv_rows()].numel()
    draft = 2 * tokens * (d.fc.weight.numel() + kv * len(d.layers))
    return float(linear + attn + draft)
