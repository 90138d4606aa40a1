"""Markdown tables of a `flashtree bench` result, and the issue's targets checked against it.

The tables go between marker comments in docs/PERFORMANCE.md, so the prose around them (what
bounds each number) is kept when a new run replaces them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

ALS = (4.0, 6.5, 8.0)
TARGET_CONTEXT = 4096
DRAFT_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2", "mtp": "MTP"}


def _f(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def host_ms(ctx: dict[str, Any], budget: str = "22") -> Optional[float]:
    """What a ddtree step costs beyond its two graph replays (draft and verify device time): the
    host's launches, reads and Python, as the engine's loop pays them (its pipelined step where
    measured, else one step alone)."""
    step = ctx.get("loop_step_ms", {}).get(budget) or ctx["step_ms"].get(budget)
    verify = ctx["device_ms"]["verify_forward"].get(budget)
    if step is None or verify is None:
        return None
    return step - ctx["device_ms"]["draft_forward"] - verify


def idle_ms(ctx: dict[str, Any], budget: str = "22") -> Optional[float]:
    """The part of the engine's pipelined ddtree step in which the GPU runs nothing (its wall time
    minus the union of its kernels' and copies' device intervals): the host work the device waits
    for. host_ms less this is device work outside the two forwards (tree build, walk, commit)."""
    step, busy = ctx.get("loop_step_ms", {}).get(budget), ctx.get("loop_busy_ms", {}).get(budget)
    return None if step is None or busy is None else step - busy


def _row(ctx: dict[str, Any], budget: str = "22") -> dict[str, Optional[float]]:
    ar, draft = ctx["ar_step_ms"], ctx["draft_step_ms"]
    verify = ctx["verify_ms"].get(budget)
    return {"ar": ar, "draft": draft, "verify": verify,
            "verify_ratio": verify / ar if verify else None, "draft_ratio": draft / ar,
            "floor_pct": 100 * ctx["ar_floor_ms"] / ar,
            "device_floor_pct": 100 * ctx["ar_floor_ms"] / ctx["device_ms"]["ar_forward"]}


def _pick(run: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The context the targets are stated at (4K), else the nearest measured."""
    ctxs = run.get("contexts") or []
    return min(ctxs, key=lambda c: abs(c["context"] - TARGET_CONTEXT)) if ctxs else None


def targets(run: dict[str, Any], matmul_tflops: float) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows for the issue's targets."""
    out: list[tuple[str, str, str]] = []
    ctx = _pick(run)
    if ctx is None:
        return out
    r = _row(ctx)
    at = f" (ctx {ctx['context']})"
    out.append(("AR >= 85% of bandwidth floor", f"{r['floor_pct']:.0f}% step, "
                f"{r['device_floor_pct']:.0f}% device{at}", "met" if r["floor_pct"] >= 85 else "missed"))
    if r["verify_ratio"] is not None:
        out.append(("verify(22) <= 1.15x AR", f"{r['verify_ratio']:.2f}x{at}",
                    "met" if r["verify_ratio"] <= 1.15 else "missed"))
    out.append(("draft <= 0.25x AR", f"{r['draft_ratio']:.2f}x{at}", "met" if r["draft_ratio"] <= 0.25 else "missed"))
    long = [p for p in run.get("prefill", []) if p["tokens"] >= 16384]
    if long:
        best = max(long, key=lambda p: p["TFLOPs"])
        pct = 100 * best["TFLOPs"] / matmul_tflops
        out.append(("prefill 17K >= 50% of matmul rate", f"{pct:.0f}% (ubatch {best['ubatch']})",
                    "met" if pct >= 50 else "missed"))
    peers = run.get("peers") or {}
    hf = peers.get("hf_default", {}).get("ms_per_token")
    first = (run.get("contexts") or [None])[0]
    if hf and first:
        speed = hf / first["ar_step_ms"]
        out.append(("our AR >= 3x transformers generate", f"{speed:.1f}x (ctx {first['context']})",
                    "met" if speed >= 3 else "missed"))
    ref = peers.get("dflash", {}).get("ms_per_step")
    if ref and first:
        ours = first["chain_step_ms"]
        out.append(("our chain step faster than dflash's", f"{ours:.2f} vs {ref:.2f} ms",
                    "met" if ours < ref else "missed"))
    return out


def block_of(run: dict[str, Any]) -> int:
    """The draft's block (bonus included: the most tokens a step emits); a run saved before runs
    recorded it was a DFlash draft's, whose config holds it."""
    return int(run.get("block_size") or (run.get("draft_config") or {}).get("block_size") or 16)


def draft_title(run: dict[str, Any]) -> str:
    """Which draft a run measured: `DFlash2 draft (block 8, tree from its selector)`; a run saved
    before runs recorded it was a DFlash draft's."""
    kind = run.get("draft_kind", "dflash")
    tree = f", tree from its {run['dflash2_tree']}" if run.get("dflash2_tree") else ""
    return f"{DRAFT_NAMES[kind]} draft (block {block_of(run)}{tree})"


def accept_lengths(block: int) -> tuple[float, ...]:
    """The accept lengths (tokens a step) tokens/s are projected at: ALS, a DFlash draft's range,
    where the block reaches them, else half, three quarters and all of the block (an MTP chain of
    4: 2, 3 and 4)."""
    return ALS if block >= max(ALS) else (block / 2, 3 * block / 4, float(block))


def run_title(run: dict[str, Any], quantize: Optional[str], quantize_draft: Optional[str] = None) -> str:
    """The preset, what it was measured in and with which draft: `qwen3.5-27b, int4 weights, q4_0
    KV cache, DFlash draft (block 16)` (and `int4 draft` where the draft's linears were quantized
    too, `deterministic kernels` where the run was in that mode)."""
    kv = run.get("kv_type") or "auto"
    weights = f"{quantize} weights" if quantize else "bf16 weights"
    weights += f", {quantize_draft} draft" if quantize_draft else ""
    cache = "KV cache in the model dtype" if kv == "auto" else f"{kv} KV cache"
    mode = ", deterministic kernels" if run.get("deterministic") else ""
    return f"{run['preset']}, {weights}, {cache}, {draft_title(run)}{mode}"


def render_run(run: dict[str, Any], ceil: dict[str, float], quantize: Optional[str] = None,
               quantize_draft: Optional[str] = None) -> str:
    wb = run["weight_bytes"]
    lines = [f"#### {run_title(run, quantize, quantize_draft)}", "",
             f"Target weights {wb['target_total'] / 1e9:.2f} GB ({wb['target_read_per_forward'] / 1e9:.2f} GB "
             f"read per forward), draft {wb['draft'] / 1e9:.2f} GB, KV {run['kv_bytes_per_token'] / 1e3:.0f} KB/token; "
             f"graph capture {run['graph_capture_s']} s.", ""]
    budgets = list(run["contexts"][0]["verify_ms"]) if run["contexts"] else []
    head = ["ctx", "floor ms", "AR step ms", "AR device ms", "% floor (step/device)", "draft ms",
            *[f"verify b={b}" for b in budgets], "step b=22", "loop step b=22", "host ms", "GPU idle ms", "chain step",
            "verify22/AR", "draft/AR"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in run["contexts"]:
        r = _row(c)
        cells = [str(c["context"]), _f(c["ar_floor_ms"]), _f(c["ar_step_ms"]), _f(c["device_ms"]["ar_forward"]),
                 f"{r['floor_pct']:.0f}% / {r['device_floor_pct']:.0f}%", _f(c["draft_step_ms"]),
                 *[_f(c["verify_ms"][b]) for b in budgets], _f(c["step_ms"].get("22")),
                 _f(c.get("loop_step_ms", {}).get("22")), _f(host_ms(c)), _f(idle_ms(c)),
                 _f(c["chain_step_ms"]), _f(r["verify_ratio"]), _f(r["draft_ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Device time of one graph replay (ms): "
              + "; ".join(f"ctx {c['context']}: AR {_f(c['device_ms']['ar_forward'])}, draft "
                          f"{_f(c['device_ms']['draft_forward'])}, verify "
                          + "/".join(_f(v) for v in c["device_ms"]["verify_forward"].values())
                          for c in run["contexts"]), ""]
    als, block = accept_lengths(block_of(run)), block_of(run)
    lines += [f"Projected tokens/s = AL / (draft + verify b=22) (and AL / measured full step b=22), at assumed "
              f"accept lengths AL (tokens a step, at most the block of {block}; random weights accept about one, "
              "which says nothing of a trained draft):", "",
              "| ctx | AR tok/s | " + " | ".join(f"AL {a}" for a in als) + " |", "|---|---|" + "---|" * len(als)]
    for c in run["contexts"]:
        r = _row(c)
        denom = r["draft"] + (r["verify"] or float("nan"))
        step = c["step_ms"].get("22")
        cells = [f"{1000 * a / denom:.0f} ({1000 * a / step:.0f})" if step else f"{1000 * a / denom:.0f}" for a in als]
        lines.append(f"| {c['context']} | {1000 / r['ar']:.0f} | " + " | ".join(cells) + " |")
    if run.get("prefill"):
        lines += ["", "| prefill tokens | ubatch | ms | tokens/s | TFLOP/s | % of matmul |",
                  "|---|---|---|---|---|---|"]
    for p in run.get("prefill", []):
        lines.append(f"| {p['tokens']} | {p['ubatch']} | {p['ms']:.0f} | {p['tokens_per_s']:.0f} | "
                     f"{p['TFLOPs']:.0f} | {100 * p['TFLOPs'] / ceil['bf16_matmul_TFLOPs']:.0f}% |")
    if run.get("peers"):
        lines += ["", "| peer (same weights, 1K prompt) | result | greedy tokens equal to ours |",
                  "|---|---|---|"]
        ours = run.get("greedy_tokens") or []
        for name, res in run["peers"].items():
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
                     if k not in ("peer", "tokens")}
            theirs = res.get("tokens") or []
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            lines.append(f"| {name} | {shown} | " + (f"first {same} of {len(theirs)}" if theirs else "-") + " |")
    prof = [r for r in run.get("ar_kernel_profile") or [] if "kernel" in r]
    if prof:
        lines += ["", "Where one AR forward's device time goes (eager run of the same kernels, per forward):", "",
                  "| kernel | calls | us |", "|---|---|---|"]
        lines += [f"| `{r['kernel']}` | {r['calls_per_forward']:.0f} | {r['us_per_forward']:.1f} |" for r in prof]
    lines += verify_excess(prof, [r for r in run.get("verify_kernel_profile") or [] if "kernel" in r])
    lines += sessions_table(run.get("sessions"))
    rows = targets(run, ceil["bf16_matmul_TFLOPs"])
    if rows:
        lines += ["", "| target | measured | verdict |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def sessions_table(sessions: Optional[dict[str, Any]]) -> list[str]:
    """Markdown lines of a run's `--sessions` measurement (bench/sessions.py; [] where it has
    none): per count of sequences, a round's time in turn and shared (and shared with attention and
    recurrent scans a launch per sequence, where the run measured it), the speedup, each way's tokens/s, and whether
    they emitted the same tokens."""
    if not sessions:
        return []
    both = all("shared_per_sequence_ms" in r for r in sessions["rows"])  # runs before it timed one way
    lines = ["", f"Several sequences at once: one ddtree({sessions['budget']}) step of every sequence at ctx "
             f"{sessions['context']}, in turn (each its own step) and shared (runtime/batch_step.py"
             + ("; its attention and recurrent scans one launch for all, or a launch per sequence" if both else "")
             + f"), the median round of {sessions['rounds']}:", "",
             "| sessions | in turn, ms a round | shared, ms a round | "
             + ("shared, a launch per sequence | " if both else "")
             + "speedup | in turn tok/s | shared tok/s | same tokens |", "|---|---|---|" + "---|" * (5 if both else 4)]
    for r in sessions["rows"]:
        per_sequence = f"{_f(r['shared_per_sequence_ms'])} | " if both else ""
        lines.append(f"| {r['sessions']} | {_f(r['in_turn_ms'])} | {_f(r['shared_ms'])} | {per_sequence}"
                     f"{_f(r['speedup'])} | {r['in_turn_tokens_per_s']:.0f} | {r['shared_tokens_per_s']:.0f} | "
                     f"{'yes' if r['same_tokens'] else 'no'} |")
    for r in sessions["rows"]:
        if r.get("kernels"):
            lines += kernel_diff(f"Where a round of {r['sessions']} sequences spends its device time, in turn "
                                 "and shared, per kernel (graph replays, us a round):", ("in turn", "shared"),
                                 r["kernels"]["in_turn"], r["kernels"]["shared"])
    return lines


def _by_kernel(profile: list[dict[str, Any]]) -> dict[str, float]:
    """us a forward per kernel name; names the profile cut to the same prefix (templated torch
    kernels) are summed."""
    out: dict[str, float] = {}
    for r in profile:
        out[r["kernel"]] = out.get(r["kernel"], 0.0) + r["us_per_forward"]
    return out


def verify_excess(ar: list[dict[str, Any]], verify: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the verify forward's kernels beside the AR forward's (kernel_diff): where a
    tree costs more than one token."""
    return kernel_diff("What the verify forward (largest budget) adds to the AR forward, per kernel (eager runs, "
                       "PDL off):", ("AR", "verify"), ar, verify)


def kernel_diff(title: str, labels: tuple[str, str], first: list[dict[str, Any]], second: list[dict[str, Any]]
                ) -> list[str]:
    """Markdown lines: two kernel profiles side by side, the costliest excess of the second first,
    with their totals (each profile's costliest kernels; a kernel in only one counts 0 in the
    other; names cut to one prefix, one row). [] unless both are given."""
    if not (first and second):
        return []
    us_a, us_b = _by_kernel(first), _by_kernel(second)
    names = sorted(set(us_a) | set(us_b), key=lambda k: us_a.get(k, 0.0) - us_b.get(k, 0.0))
    a_label, b_label = labels
    lines = ["", title, "", f"| kernel | {a_label} us | {b_label} us | {b_label} - {a_label} |", "|---|---|---|---|"]
    for name in names:
        a, b = us_a.get(name, 0.0), us_b.get(name, 0.0)
        lines.append(f"| `{name}` | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    total_a, total_b = sum(us_a.values()), sum(us_b.values())
    lines.append(f"| all | {total_a:.1f} | {total_b:.1f} | {total_b - total_a:+.1f} |")
    return lines


def command_line(command: str) -> str:
    """The recorded command line as the `flashtree bench` command that repeats the run: the
    program's path becomes `flashtree bench`, an empty argument is written `""`, and where the run
    wrote its files (`--out-dir`, `--markdown`) is left out. Arguments are split at single spaces,
    as the run joined them."""
    args = command.split(" ")[1:]
    if args[:1] == ["bench"]:  # `flashtree bench ...`: the subcommand is the first argument
        args = args[1:]
    out, i = ["flashtree bench"], 0
    while i < len(args):
        if args[i] in ("--out-dir", "--markdown"):
            i += 2
            continue
        out.append(args[i] or '""')
        i += 1
    return " ".join(out)


def render_markdown(result: dict[str, Any]) -> str:
    m, ceil = result["machine"], result["ceilings"]
    settings = "".join(f", {k}={v}" for k, v in result.get("settings", {}).items())
    head = [f"`{command_line(result['command'])}`", "",
            f"Run `{result['name']}` on {m['gpu']} ({m['sms']} SMs, torch {m['torch']}, triton {m['triton']}, "
            f"{m['host_cpus']} host CPUs), commit {result['commit'][:12]}{settings}, {result['date']}. "
            f"Ceilings measured in the run: copy bandwidth {ceil['copy_bandwidth_GBps']:.0f} GB/s "
            f"(read + write), bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s.", ""]
    runs = [render_run(r, ceil, result.get("quantize"), result.get("quantize_draft")) + "\n"
            for r in result["runs"]]
    return "\n".join(head + runs)


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    """Replace (or append) this result's block between its markers, keeping everything else."""
    start, end = f"<!-- bench:{result['name']} start -->", f"<!-- bench:{result['name']} end -->"
    block = f"{start}\n{render_markdown(result)}\n{end}"
    text = path.read_text() if path.exists() else "# Performance\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
