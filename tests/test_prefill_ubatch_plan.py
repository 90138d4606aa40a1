"""The prefill ubatch the memory plan chooses where --prefill-ubatch is not given: on a GPU the
largest of 2048 and 1024 that leaves the prefix cache's device tier all it wants (after the live
sequences), else 512; on the CPU 512; as given where given. The engine prefills in the chunks the
plan counted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashtree import Engine
from flashtree.config import EngineConfig
from flashtree.models.loader import read_configs
from flashtree.runtime.memory_plan import GiB, auto_settings, planner
from test_memory_plan import config_only, plan_json


def scratch_name(plan) -> str:
    return next(name for name, _ in plan.items if name.startswith("prefill scratch"))


def test_the_plan_takes_the_largest_ubatch_that_leaves_the_device_tier_whole(tmp_path):
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    _, lm, dcfg = read_configs(target, draft)
    cfg = EngineConfig(max_ctx=65536, quantize="int4", kv_type="q4_0", quantize_draft="int4", max_sequences=1)

    def plan_with(available, device="cuda", **kw):
        plan_for = planner(lm, dcfg, torch.bfloat16, device, "int4", available, None, "int4")
        chosen = auto_settings(replace(cfg, **kw), plan_for, device)
        return chosen, plan_for(chosen)

    chosen, plan = plan_with(40 * GiB)
    assert chosen.prefill_ubatch == 2048 and scratch_name(plan) == "prefill scratch (ubatch 2048)"
    # just room for 1024 with the tier whole, then for none of the larger ones
    need = {n: plan_with(None, prefill_ubatch=n)[1] for n in (512, 1024, 2048)}
    whole = {n: p.required + p.prefix_cache_wanted for n, p in need.items()}
    assert whole[512] < whole[1024] < whole[2048]
    chosen, plan = plan_with(whole[1024])
    assert chosen.prefill_ubatch == 1024 and plan.layout.prefill_ubatch == 1024
    chosen, plan = plan_with(whole[1024] - 1)
    assert chosen.prefill_ubatch is None and plan.layout.prefill_ubatch == 512
    assert plan.prefix_cache_bytes == plan.prefix_cache_wanted
    chosen, plan = plan_with(whole[512] - GiB)  # the tier shrinks, and the ubatch stays the smallest
    assert plan.layout.prefill_ubatch == 512 and plan.fits and plan.prefix_cache_bytes < plan.prefix_cache_wanted
    # given, it is kept however much memory there is; on the CPU and where memory is unknown: 512
    assert plan_with(40 * GiB, prefill_ubatch=300)[1].layout.prefill_ubatch == 300
    assert plan_with(40 * GiB, device="cpu")[1].layout.prefill_ubatch == 512
    assert plan_with(None)[1].layout.prefill_ubatch == 512


def test_plan_cli_shows_the_chosen_ubatch(tmp_path, capsys):
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    args = ["--target", str(target), "--draft", str(draft), "--max-ctx", "65536", "--quantize", "int4",
            "--kv-type", "q4_0", "--quantize-draft", "int4"]
    for extra, want in ((["--gpu-memory", "80G"], "ubatch 2048"), (["--gpu-memory", "80G", "--prefill-ubatch", "64"],
                                                                  "ubatch 64"), (["--device", "cpu"], "ubatch 512")):
        _, plan = plan_json(capsys, *args, *extra)
        assert any(row["name"] == f"prefill scratch ({want})" for row in plan["items"]), (extra, plan["items"])
        assert f"ubatch {plan['prefill_ubatch']}" == want


@pytest.mark.parametrize("given", [None, 7])
def test_the_engine_prefills_in_the_chunks_its_plan_counted(tiny_pair, given):
    """On the CPU the plan chooses 512; a given ubatch is the one the engine's prefill uses."""
    eng = Engine.from_pretrained(*tiny_pair, device="cpu", max_ctx=256, mode="ar", prefill_ubatch=given,
                                 prefix_cache_slots=0, host_cache_bytes=0)
    assert eng.config.prefill_ubatch == eng.layout.prefill_ubatch == (given or 512)
    result = eng.generate(list(range(20, 60)), max_tokens=1)
    assert result.stats.prefill_chunks == (1 if given is None else -(-40 // given))
