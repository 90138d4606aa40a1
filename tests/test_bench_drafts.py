"""`flashtree bench --draft-kind` on the CPU: a tiny dense and a tiny hybrid preset (shapes of the
table's kind, too small to mean a speed), each drafted by a DFlash, a DFlash2 (its tree from the
top-k or the selector) or the target's MTP draft, run through the bench's whole per-pair
measurement; the run records the draft and the markdown says which, and projects tokens/s at
accept lengths its block can reach, saying that random weights measure none. A preset without an
MTP layer is refused naming it. No timing is asserted: only that there are times."""

import json
import math
from pathlib import Path

import pytest
import torch

from flashtree.bench.cli import bench_pair, build_parser, max_positions, run_bench
from flashtree.bench.models import build_pair
from flashtree.bench.report import render_markdown, render_run
from flashtree.checkpoint.presets import PRESETS
from flashtree.models.dflash2 import DFlash2Draft
from flashtree.models.mtp import MTPDraft

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
TINY = {"tiny-dense": dict(PRESETS["qwen3-8b"], **SMALL),
        "tiny-hybrid": dict(PRESETS["qwen3.5-4b"], **SMALL, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16)}
CEILINGS = {"copy_bandwidth_GBps": 100.0, "bf16_matmul_TFLOPs": 10.0}
ARGS = ["--contexts", "64", "--budgets", "4,22", "--prefill", "32", "--prefill-ubatch", "32", "--iters", "1"]


@pytest.fixture
def tiny_presets(monkeypatch):
    for name, cfg in TINY.items():
        monkeypatch.setitem(PRESETS, name, cfg)


@pytest.mark.parametrize("preset,kind,tree,block,draft_class", [
    ("tiny-dense", "dflash", "topk", 16, None),
    ("tiny-dense", "dflash2", "topk", 8, DFlash2Draft),
    ("tiny-hybrid", "dflash2", "selector", 8, DFlash2Draft),
    ("tiny-hybrid", "mtp", "topk", 4, MTPDraft),
])
def test_every_draft_kind_measures_and_says_which_it_was(tiny_presets, preset, kind, tree, block, draft_class):
    args = build_parser().parse_args([*ARGS, "--preset", preset, "--draft-kind", kind, "--dflash2-tree", tree])
    with torch.inference_mode():
        pair = build_pair(preset, "cpu", torch.float32, max_pos=max_positions(args), draft_kind=kind)
        assert pair.draft_kind == kind and (draft_class is None or isinstance(pair.draft, draft_class))
        run = json.loads(json.dumps(bench_pair(pair, args, CEILINGS), default=str))
    assert (run["draft_kind"], run["block_size"], run.get("dflash2_tree")) == (kind, block,
                                                                               tree if kind == "dflash2" else None)
    (ctx,) = run["contexts"]
    times = [ctx["ar_step_ms"], ctx["draft_step_ms"], ctx["chain_step_ms"], *ctx["verify_ms"].values(),
             *ctx["step_ms"].values(), *ctx["loop_step_ms"].values(), ctx["device_ms"]["draft_forward"],
             *ctx["device_ms"]["verify_forward"].values()]
    assert set(ctx["verify_ms"]) == {"4", "22"} and all(t > 0 and math.isfinite(t) for t in times)
    assert 1 <= ctx["tree_paths"]["4"] <= 4 and 1 <= ctx["tree_paths"]["22"] <= 22  # a path ends at each leaf
    assert "loop_busy_ms" not in ctx, "no device busy time on the CPU"
    assert len(run["greedy_tokens"]) == 32 and run["prefill"][0]["tokens"] == 32
    text = render_run(run, CEILINGS)
    name = {"dflash": "DFlash", "dflash2": "DFlash2", "mtp": "MTP"}[kind]
    tree_said = f", tree from its {tree}" if kind == "dflash2" else ""
    assert text.splitlines()[0] == f"#### {preset}, bf16 weights, KV cache in the model dtype, {name} draft " \
                                   f"(block {block}{tree_said})"
    als = ["AL 2.0", "AL 3.0", "AL 4.0"] if block == 4 else ["AL 4.0", "AL 6.5", "AL 8.0"]
    assert f"| ctx | AR tok/s | {' | '.join(als)} |" in text
    assert f"at most the block of {block}; random weights accept about one" in text


def test_a_preset_without_an_mtp_layer_is_refused_naming_it(capsys):
    with pytest.raises(ValueError, match="--draft-kind mtp: preset 'llama3.1-8b' .* has no MTP layer; the "
                                         "presets with one: qwen3.5-27b, qwen3.5-4b"):
        build_pair("llama3.1-8b", "cpu", draft_kind="mtp")
    assert run_bench(build_parser().parse_args(["--preset", "qwen3.5-4b", "--preset", "qwen3-8b",
                                                "--draft-kind", "mtp"])) == 2
    assert "preset 'qwen3-8b' (model_type 'qwen3') has no MTP layer" in capsys.readouterr().err
    assert run_bench(build_parser().parse_args(["--target", "t", "--draft", "d", "--draft-kind", "dflash2"])) == 2
    assert "with --target the draft is --draft's" in capsys.readouterr().err


def test_a_run_saved_before_the_draft_kind_was_recorded_renders_as_the_dflash_run_it_was():
    result = json.loads((RESULTS / "qwen3-8b.json").read_text())
    assert "draft_kind" not in result["runs"][0]
    text = render_markdown(result)
    assert "#### qwen3-8b, bf16 weights, KV cache in the model dtype, DFlash draft (block 16)" in text
    assert "| ctx | AR tok/s | AL 4.0 | AL 6.5 | AL 8.0 |" in text


def test_a_runs_settings_are_recorded_and_shown_in_its_header(monkeypatch):
    """An A/B of a launch by an environment setting (FLASHTREE_L2_PREFETCH_MB) says which side a
    result file and its block are; FLASHTREE_COMMIT is the commit's own field."""
    from flashtree.bench.provenance import provenance

    import os

    for key in [k for k in os.environ if k.startswith("FLASHTREE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FLASHTREE_L2_PREFETCH_MB", "16")
    monkeypatch.setenv("FLASHTREE_COMMIT", "abc123")
    recorded = provenance()
    assert recorded["commit"] == "abc123" and recorded["settings"] == {"FLASHTREE_L2_PREFETCH_MB": "16"}
    result = {**json.loads((RESULTS / "qwen3-8b.json").read_text()), **recorded}
    assert "commit abc123, FLASHTREE_L2_PREFETCH_MB=16, " in render_markdown(result)
