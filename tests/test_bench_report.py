"""flashtree bench's markdown: the verify forward's kernels beside the AR forward's."""

import json
from pathlib import Path

from flashtree.bench.report import command_line, verify_excess, write_markdown

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def test_verify_excess_orders_kernels_by_what_a_tree_adds_and_totals_both():
    ar = [{"kernel": "_gemm_kernel", "calls_per_forward": 256, "us_per_forward": 5800.0},
          {"kernel": "_gemv_kernel", "calls_per_forward": 1, "us_per_forward": 300.0},
          {"kernel": "_scan_kernel", "calls_per_forward": 48, "us_per_forward": 150.0}]
    verify = [{"kernel": "_gemm_kernel", "calls_per_forward": 257, "us_per_forward": 8000.0},
              {"kernel": "_scan_kernel", "calls_per_forward": 48, "us_per_forward": 780.0}]
    lines = verify_excess(ar, verify)
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == ["| `_gemm_kernel` | 5800.0 | 8000.0 | +2200.0 |",
                    "| `_scan_kernel` | 150.0 | 780.0 | +630.0 |",
                    "| `_gemv_kernel` | 300.0 | 0.0 | -300.0 |"]
    assert lines[-1] == "| all | 6250.0 | 8780.0 | +2530.0 |"
    assert verify_excess(ar, []) == [] and verify_excess([], verify) == []


def test_a_committed_runs_profiles_render():
    """The committed 27B int4 run with PDL-off profiles: its table's total is the
    difference of the two profiles' sums."""
    run = json.loads((RESULTS / "q27-int4-q4_0_h200_profile_nopdl.json").read_text())["runs"][0]
    lines = verify_excess(run["ar_kernel_profile"], run["verify_kernel_profile"])
    want = (sum(r["us_per_forward"] for r in run["verify_kernel_profile"])
            - sum(r["us_per_forward"] for r in run["ar_kernel_profile"]))
    assert lines[-1].endswith(f"| {want:+.1f} |")
    assert "`_gemm_kernel`" in lines[5]  # the largest excess first


def test_kernels_whose_names_were_cut_alike_are_one_row():
    cut = "void at::native::index_elementwise_kernel<128, 4"
    ar = [{"kernel": cut, "calls_per_forward": 1, "us_per_forward": 4.0},
          {"kernel": cut, "calls_per_forward": 2, "us_per_forward": 3.0}]
    verify = [{"kernel": cut, "calls_per_forward": 1, "us_per_forward": 10.0}]
    lines = verify_excess(ar, verify)
    assert [line for line in lines if line.startswith("| `")] == [f"| `{cut}` | 7.0 | 10.0 | +3.0 |"]
    assert lines[-1] == "| all | 7.0 | 10.0 | +3.0 |"


def test_the_command_line_is_the_bench_command_that_repeats_the_run():
    recorded = ("/work/main/flashtree/bench/__main__.py --preset qwen3.5-27b --quantize int4 --prefill  "
                "--iters 5 --peers  --name q27 --out-dir /root/out --markdown /root/out/PERF.md")
    assert command_line(recorded) == ('flashtree bench --preset qwen3.5-27b --quantize int4 --prefill "" '
                                      '--iters 5 --peers "" --name q27')
    assert command_line("/usr/bin/flashtree bench --preset qwen3-8b") == "flashtree bench --preset qwen3-8b"


def test_several_saved_runs_each_keep_their_own_block(tmp_path):
    """`flashtree bench --from-json A B`: each result replaces the block of its run name and leaves
    the prose and the other blocks as they were."""
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("# Performance\n\nprose one\n\n<!-- bench:qwen3-8b-recheck start -->\nold\n"
                   "<!-- bench:qwen3-8b-recheck end -->\n\nprose two\n")
    names = ["qwen3-8b-recheck", "q27-int4-q4_0_h200_profile_nopdl"]
    for name in names:
        write_markdown(doc, json.loads((RESULTS / f"{name}.json").read_text()))
    text = doc.read_text()
    assert "old" not in text and text.count("prose one") == 1 and text.count("prose two") == 1
    assert text.index("prose one") < text.index(names[0]) < text.index("prose two") < text.index(names[1])
    for name in names:
        assert text.count(f"<!-- bench:{name} start -->") == 1 and text.count(f"<!-- bench:{name} end -->") == 1
    assert "#### qwen3.5-27b, int4 weights, q4_0 KV cache" in text
    assert "#### qwen3-8b, bf16 weights, KV cache in the model dtype" in text
    before = text
    write_markdown(doc, json.loads((RESULTS / f"{names[0]}.json").read_text()))
    assert doc.read_text() == before  # rendering the same result again changes nothing


def test_the_gpu_idle_column_is_the_loop_step_less_the_device_busy_time():
    """Intervals that overlap (kernels under PDL) count once, gaps not at all; a saved run
    without the busy time renders a dash rather than a made-up number."""
    from flashtree.bench.measure import covered
    from flashtree.bench.report import idle_ms

    assert covered([(0, 4), (2, 6), (10, 11), (3, 5)]) == 7
    assert covered([]) == 0
    ctx = {"loop_step_ms": {"22": 12.9}, "loop_busy_ms": {"22": 12.4}}
    assert abs(idle_ms(ctx) - 0.5) < 1e-9
    assert idle_ms({"loop_step_ms": {"22": 12.9}}) is None


def test_a_sessions_row_with_kernel_profiles_renders_its_round_in_turn_beside_shared():
    from flashtree.bench.report import sessions_table
    in_turn = [{"kernel": "_split_kernel", "calls_per_forward": 144, "us_per_forward": 2260.0},
               {"kernel": "_merge_kernel", "calls_per_forward": 144, "us_per_forward": 1464.0}]
    shared = [{"kernel": "_split_kernel", "calls_per_forward": 144, "us_per_forward": 2100.0}]
    row = {"sessions": 4, "in_turn_ms": 28.9, "shared_ms": 14.5, "speedup": 2.0, "in_turn_tokens_per_s": 138.0,
           "shared_tokens_per_s": 277.0, "same_tokens": False, "kernels": {"in_turn": in_turn, "shared": shared}}
    lines = sessions_table({"context": 4096, "budget": 22, "rounds": 10, "rows": [row]})
    at = next(i for i, line in enumerate(lines) if line.startswith("Where a round of 4 sequences"))
    assert lines[at + 2] == "| kernel | in turn us | shared us | shared - in turn |"
    assert lines[at + 4:] == ["| `_split_kernel` | 2260.0 | 2100.0 | -160.0 |",
                              "| `_merge_kernel` | 1464.0 | 0.0 | -1464.0 |",
                              "| all | 3724.0 | 2100.0 | -1624.0 |"]
