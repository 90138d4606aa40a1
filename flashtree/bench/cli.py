"""`flashtree bench`: how fast the engine decodes a named model shape on this GPU, held against the
device's own ceilings and, in the same run, against the peers on the same weights.

Batch-1 decode reads every weight once per forward, so the floor of one target forward is
(weights read + KV read) / copy bandwidth; speculative decoding pays off only if a draft + tree
verify step costs little more than that. The run measures the ceilings, our AR / draft / verify /
full-step times at several contexts and budgets, prefill, the peers, and with `--sessions` the
steps of several sequences in turn against shared (sessions.py); it writes everything to
benchmarks/results/<name>.json and a table to docs/PERFORMANCE.md. `--from-json` re-renders the
table from a saved result without a GPU.

A preset is drafted by its DFlash draft, or (`--draft-kind`) by a DFlash2 draft of the same
shape or the target's own MTP layer: the draft, verify and step rows then describe that draft,
and the run records which (`draft_kind`). The peers run the DFlash draft, so they run only then.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ..checkpoint.presets import BLOCK_SIZE, DRAFT_KINDS, check_draft_kind
from ..config import DFLASH2_TREES, KV_TYPES, QUANT_TYPES
from ..errors import ConfigError
from ..models.deterministic import make_deterministic
from ..models.quantize import quantize_model
from .models import PRESETS, RandomPair, build_pair
from .peers import PEERS, peer_prompt
from .report import render_markdown, write_markdown
from .provenance import provenance

CONTEXTS = (1024, 4096, 8192, 32768)
BUDGETS = (8, 16, 22, 32, 64)
PREFILL = (1024, 17408)
PEER_PROMPT, PEER_TOKENS = 1024, 32


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def near_4k(contexts: list[int]) -> int:
    """The context the profiles and the sessions are measured at: the one nearest 4K."""
    return min(contexts, key=lambda c: abs(c - 4096))


def loop_budget(budgets: list[int]) -> int:
    """The budget the loop profile and the sessions are measured at: 22, else the largest."""
    return 22 if 22 in budgets else max(budgets)


def max_positions(args: argparse.Namespace) -> int:
    """The positions a pair is built for: the longest context, prompt or peer run measured, and
    512 more for a step's tree and scratch rows; with --sessions, at least what their sequences
    reach (each round emitting a whole block of the presets' drafts)."""
    from .sessions import rows_needed

    most = max(args.contexts + args.prefill + [PEER_PROMPT + PEER_TOKENS]) + 512
    if args.sessions:
        most = max(most, rows_needed(near_4k(args.contexts), args.iters, BLOCK_SIZE, loop_budget(args.budgets)))
    return most


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashtree bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=sorted(PRESETS),
                   help="model shape with random weights (repeatable; default qwen3-8b)")
    p.add_argument("--target", help="a real target checkpoint instead of a preset")
    p.add_argument("--draft", help="its DFlash or DFlash2 draft (with --target)")
    p.add_argument("--draft-kind", choices=DRAFT_KINDS,
                   help="what drafts a preset: dflash (its 5-layer DFlash draft, block 16), dflash2 (a DFlash2 "
                        "draft of the same shape in the published layout: block 8, sliding-window layers, the "
                        "candidate selector), mtp (the target's own MTP layer, block 4: Qwen3.5-family presets) "
                        "(default: dflash; with --target the draft is --draft's)")
    p.add_argument("--dflash2-tree", choices=DFLASH2_TREES, default="topk",
                   help="what a DFlash2 draft's ddtree is built from, as serve's --dflash2-tree "
                        "(default: %(default)s)")
    p.add_argument("--contexts", type=_ints, default=list(CONTEXTS), help="context lengths, comma-separated")
    p.add_argument("--budgets", type=_ints, default=list(BUDGETS), help="DDTree budgets, comma-separated")
    p.add_argument("--prefill", type=_ints, default=list(PREFILL), help="prompt lengths for prefill")
    p.add_argument("--prefill-ubatch", type=_ints, default=[512, 2048], help="prefill chunk sizes")
    p.add_argument("--quantize", choices=QUANT_TYPES, help="quantize the target's decoder-layer linears "
                   "(as --quantize of generate/serve) before measuring (default: none)")
    p.add_argument("--deterministic", action="store_true",
                   help="the target's kernels in the deterministic mode (as --deterministic of generate/serve), "
                        "to measure its cost beside a run without it")
    p.add_argument("--quantize-draft", choices=QUANT_TYPES, help="quantize the draft's linears (as "
                   "--quantize-draft of generate/serve) before measuring (default: none)")
    p.add_argument("--kv-type", choices=KV_TYPES, default="auto",
                   help="the target's KV cache type, as serve's --kv-type (the draft's stays bf16)")
    p.add_argument("--iters", type=int, default=30, help="timed repetitions per number (median)")
    p.add_argument("--sessions", type=_ints, default=[], metavar="N[,N...]",
                   help="also measure a ddtree step of N sequences at once, in turn against shared "
                        "(runtime/batch_step.py), for each N, at the context nearest 4K and budget 22 (else "
                        "the largest), --iters rounds (default: not measured)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated subset of {','.join(PEERS)}; empty for none")
    p.add_argument("--peer-presets", default="qwen3-8b,qwen3-1.7b",
                   help="presets on which the peers run (they are slow)")
    p.add_argument("--peer-timeout", type=int, default=300, help="seconds per peer process")
    p.add_argument("--name", help="result name (default: the first preset)")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--markdown", default="docs/PERFORMANCE.md", help="file whose bench table is replaced")
    p.add_argument("--tree-attention", type=json.loads, metavar="JSON",
                   help="a JSON list of launches (objects of plan()'s keys, e.g. balance, block_m, nsplit) for "
                        "a tree's attention: each is measured as a run of its own on the same weights")
    p.add_argument("--from-json", nargs="+", metavar="JSON",
                   help="only re-render saved results into --markdown, each into its own block "
                        "(marked by its run name), in the order given")
    return p


def _machine() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count,
            "gpu_memory_GiB": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "host_cpus": os.cpu_count(), "python": platform.python_version()}


def _peer(which: str, preset: str, timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "flashtree.bench.peers", which, "--preset", preset,
           "--prompt-len", str(PEER_PROMPT), "--new-tokens", str(PEER_TOKENS)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"peer": which, "error": f"did not finish within {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"peer": which, "error": " | ".join(tail)[-400:], "wall_s": time.perf_counter() - t0}
    return {**json.loads(lines[-1]), "wall_s": round(time.perf_counter() - t0, 1)}


def _load_pair(target: str, draft: str, max_pos: int) -> RandomPair:
    """A real checkpoint pair in the shape the measurements take (bf16 on the GPU)."""
    from ..checkpoint import resolve_model
    from ..models.loader import draft_json, load_draft, load_target, read_configs

    tdir, ddir = resolve_model(target), resolve_model(draft)  # either may be a .gguf file
    raw, lm, dcfg = read_configs(tdir, ddir)
    cuda = torch.device("cuda")
    model = load_target(tdir, lm, torch.bfloat16, cuda, max_pos)
    d = load_draft(ddir, dcfg, torch.bfloat16, cuda, max_pos)
    return RandomPair(tdir.name, model, d, raw, draft_json(ddir)[0])


def bench_pair(pair: RandomPair, args: argparse.Namespace, ceil: dict[str, float]) -> dict[str, Any]:
    from ..kernels import attention_launch
    from .measure import PairBench
    from .sessions import measure_sessions

    t0 = time.perf_counter()
    max_ctx = max(args.contexts + args.prefill + [PEER_PROMPT + PEER_TOKENS])
    pb = PairBench(pair, args.budgets, max_ctx, args.iters, args.kv_type, args.dflash2_tree)
    res: dict[str, Any] = {"preset": pair.preset, "target_config": pair.target_cfg,
                           "draft_config": pair.draft_cfg, "draft_kind": pair.draft_kind, "block_size": pb.bs,
                           "weight_bytes": pair.weight_bytes(),
                           "graph_capture_s": round(pb.capture_s, 1),
                           "tree_attention": dict(attention_launch.WIDE_TREE_LAUNCH),
                           "tree_attention_trial": dict(attention_launch.TREE_LAUNCH_TRIAL)}
    if pair.draft_kind == "dflash2":
        res["dflash2_tree"] = args.dflash2_tree
    kv_per_token = pb.state.target.bytes_per_token()
    res["kv_bytes_per_token"], res["kv_type"] = kv_per_token, args.kv_type
    res["contexts"] = []
    for length in args.contexts:
        row = pb.context(length)
        read = res["weight_bytes"]["target_read_per_forward"] + kv_per_token * length
        row["ar_floor_ms"] = read / (ceil["copy_bandwidth_GBps"] * 1e6)
        res["contexts"].append(row)
        print(f"  {pair.preset} ctx {length}: AR {row['ar_step_ms']:.2f} ms "
              f"(device {row['device_ms']['ar_forward']:.2f}, floor {row['ar_floor_ms']:.2f}), "
              f"draft {row['draft_step_ms']:.2f}, verify22 {row['verify_ms'].get('22', float('nan')):.2f}",
              flush=True)
    at = near_4k(args.contexts)
    profiles = {"ar_kernel_profile": partial(pb.kernel_profile, at),
                "verify_kernel_profile": partial(pb.verify_kernel_profile, at, max(args.budgets)),
                "loop_kernel_profile": partial(pb.loop_kernel_profile, at, loop_budget(args.budgets))}
    for key, take in profiles.items():
        try:  # the profiler needs CUPTI; a machine without it still gets every other number
            res[key] = take()
            print(f"  {key}:", flush=True)
            for r in res[key]:
                print(f"  {r['us_per_forward']:9.1f} us  x{r['calls_per_forward']:5.0f}  {r['kernel']}", flush=True)
        except Exception as e:  # noqa: BLE001 - report, do not lose the run
            res[key] = [{"error": repr(e)[:300]}]
    prompt = peer_prompt(pair.target_cfg["vocab_size"], PEER_PROMPT, 0, pb.device)[0].tolist()
    res["greedy_tokens"] = pb.greedy_tokens(prompt, PEER_TOKENS)
    res["prefill"] = [pb.prefill(n, ub) for n in args.prefill for ub in args.prefill_ubatch]
    for p in res["prefill"]:
        print(f"  {pair.preset} prefill {p['tokens']} (ubatch {p['ubatch']}): "
              f"{p['tokens_per_s']:.0f} tok/s, {p['TFLOPs']:.0f} TFLOP/s", flush=True)
    del pb
    torch.cuda.empty_cache()
    if args.sessions:
        res["sessions"] = measure_sessions(pair.target, pair.draft, args.sessions, at, loop_budget(args.budgets),
                                           args.iters, args.kv_type, args.dflash2_tree)
        for row in res["sessions"]["rows"]:
            print(f"  {pair.preset} {row['sessions']} session(s): in turn {row['in_turn_ms']:.2f} ms a round, "
                  f"shared {row['shared_ms']:.2f} ({row['speedup']:.2f}x; a launch per sequence "
                  f"{row['shared_per_sequence_ms']:.2f}), same tokens {row['same_tokens']}",
                  flush=True)
    res["bench_s"] = round(time.perf_counter() - t0, 1)
    return res


@contextmanager
def tree_attention(launch: Optional[dict[str, Any]]) -> Iterator[None]:
    """Inside: a tree's attention runs plan()'s launch with `launch`'s keys replaced
    (kernels.attention_launch.TREE_LAUNCH_TRIAL; the engine's forwards are captured in there)."""
    from ..kernels import attention_launch

    attention_launch.TREE_LAUNCH_TRIAL.update(launch or {})
    try:
        yield
    finally:
        attention_launch.TREE_LAUNCH_TRIAL.clear()


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `flashtree bench`; returns the exit code."""
    if args.from_json:
        for saved in args.from_json:
            result = json.loads(Path(saved).read_text())
            write_markdown(Path(args.markdown), result)
            print(render_markdown(result))
        return 0
    presets = args.preset or ["qwen3-8b"]
    kind = args.draft_kind or "dflash"
    try:
        if args.target and args.draft_kind:
            raise ValueError("--draft-kind picks what drafts a preset; with --target the draft is --draft's")
        for preset in presets:
            check_draft_kind(preset, kind)
    except ValueError as e:
        print(f"flashtree bench: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flashtree bench needs a CUDA GPU", file=sys.stderr)
        return 2
    from ..models.dflash2 import check_dflash2_tree
    from .measure import ceilings

    name = args.name or (Path(args.target).name if args.target else presets[0])
    result: dict[str, Any] = {"name": name, **provenance(), "machine": _machine(),
                              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "quantize": args.quantize, "quantize_draft": args.quantize_draft}
    result["ceilings"] = ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_bandwidth_GBps']:.0f} GB/s, "
          f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    result["runs"] = []
    sources: list[tuple[str, Optional[tuple[str, str]]]] = [(p, None) for p in presets]
    if args.target:
        sources = [(name, (args.target, args.draft))]
    for label, real in sources:
        max_pos = max_positions(args)
        with torch.inference_mode():
            pair = _load_pair(*real, max_pos) if real else build_pair(label, "cuda", max_pos=max_pos, draft_kind=kind)
            try:
                check_dflash2_tree(args.dflash2_tree, "ddtree", pair.draft.config)
            except ConfigError as e:
                print(f"flashtree bench: {e}", file=sys.stderr)
                return 2
            if args.quantize:
                quantize_model(pair.target, args.quantize)
            if args.quantize_draft:
                quantize_model(pair.draft, args.quantize_draft)
            norm = pair.target.model.norm.weight
            make_deterministic(pair.target, norm.device, norm.dtype, args.deterministic)
            for launch in args.tree_attention or [None]:
                with tree_attention(launch):
                    run = bench_pair(pair, args, ceil)
                run["deterministic"] = args.deterministic
                result["runs"].append(run)
                _save(result, args)
        del pair
        torch.cuda.empty_cache()
        if real is None and label in args.peer_presets.split(",") and kind == "dflash":
            run["peers"] = {}
            for which in (p for p in args.peers.split(",") if p):
                run["peers"][which] = _peer(which, label, args.peer_timeout)
                print(f"  peer {which}: {run['peers'][which]}", flush=True)
                _save(result, args)
    print(render_markdown(result))
    return 0


def _save(result: dict[str, Any], args: argparse.Namespace) -> None:
    out = Path(args.out_dir) / f"{result['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    write_markdown(Path(args.markdown), result)


def main(argv: Optional[list[str]] = None) -> int:
    """`flashtree bench ...` (flashtree.cli hands over the rest of its command line) and
    `python -m flashtree.bench ...`."""
    return run_bench(build_parser().parse_args(argv))
