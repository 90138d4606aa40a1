"""`flashtree bench --sessions` on the CPU: a tiny random pair's rounds of 1 and 2 sequences, in
turn and shared, emit the same greedy tokens; the rows a run records have their fields and
render as the markdown table. No timing is asserted: only that there are times."""

import json

import pytest
import torch

from flashtree.bench.cli import build_parser, max_positions
from flashtree.bench.report import sessions_table
from flashtree.bench.sessions import (WARMUP, launches_per_sequence, measure_sessions, open_sessions,
                                      rows_needed, run_pass)
from flashtree.models.loader import load_draft, load_target, read_configs
from flashtree.runtime.sampling import Sampler, SamplingParams

CPU = torch.device("cpu")
CONTEXT, BUDGET, ROUNDS = 40, 6, 3
ROW_KEYS = {"sessions", "in_turn_ms", "shared_ms", "shared_per_sequence_ms", "speedup", "in_turn_tokens_per_s",
            "shared_tokens_per_s", "same_tokens"}


@pytest.fixture(scope="module")
def models(tiny_pair):
    """The tiny pair's target and draft, float32 on the CPU (block 8)."""
    target_dir, draft_dir = tiny_pair
    _, lm, dcfg = read_configs(target_dir, draft_dir)
    return (load_target(target_dir, lm, torch.float32, CPU, 256),
            load_draft(draft_dir, dcfg, torch.float32, CPU, 256))


def test_the_rows_of_one_and_two_sessions_hold_both_ways_and_the_same_tokens(models):
    result = json.loads(json.dumps(measure_sessions(*models, [1, 2], CONTEXT, BUDGET, ROUNDS)))
    assert {k: result[k] for k in ("context", "budget", "rounds")} == {"context": CONTEXT, "budget": BUDGET,
                                                                       "rounds": ROUNDS}
    assert [r["sessions"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row) == ROW_KEYS
        assert row["same_tokens"] is True, "a shared step changed what a sequence emits"
        assert all(isinstance(row[k], float) for k in ROW_KEYS - {"sessions", "same_tokens"})
    lines = sessions_table(result)
    assert lines[1].startswith("Several sequences at once: one ddtree(6) step of every sequence at ctx 40")
    assert [line.split(" | ")[0] for line in lines[-2:]] == ["| 1", "| 2"]
    assert all(line.endswith("| yes |") for line in lines[-2:])
    assert "| shared, a launch per sequence |" in lines[3] and lines[-1].count("|") == 9
    old = {**result, "rows": [{k: v for k, v in r.items() if k != "shared_per_sequence_ms"} for r in result["rows"]]}
    assert "per sequence" not in "".join(sessions_table(old)[1:4])  # a run before the column: as it was
    assert sessions_table(None) == []


def test_shared_rounds_emit_each_sequences_tokens_in_turn(models):
    """The outputs themselves: every round's tokens of each of two sequences (different prompts),
    the shared pass's equal to the in-turn pass's, from the same prefilled start."""
    sessions = open_sessions(*models, 2, CONTEXT, BUDGET, ROUNDS)
    sampler = Sampler(SamplingParams(), models[0].config.vocab_size, CPU, [])
    turn = run_pass(sessions, False, ROUNDS, sampler)
    shared = run_pass(sessions, True, ROUNDS, sampler)
    assert shared.tokens == turn.tokens and turn.tokens[0] != turn.tokens[1]
    assert all(len(out) >= WARMUP + ROUNDS for out in turn.tokens), "at least a token a round"
    assert turn.timed_tokens == shared.timed_tokens > 0


def test_the_flag_takes_counts_and_the_pair_holds_their_positions():
    args = build_parser().parse_args(["--contexts", "1024,4096", "--budgets", "16,22", "--sessions", "1,2,4"])
    assert args.sessions == [1, 2, 4]
    assert max_positions(args) >= rows_needed(4096, args.iters, 16, 22) > 4096 + args.iters * 16
    assert build_parser().parse_args([]).sessions == []


def test_the_sessions_share_their_pools_so_a_shared_forward_attends_in_one_launch(models):
    """As the engine's live sequences do: every sequence's target and draft caches are page tables
    over the same two pools, so a batch of their rows qualifies for one attention launch a layer."""
    from flashtree.models.inputs import ForwardInput
    sessions = open_sessions(*models, 3, CONTEXT, BUDGET, ROUNDS)
    caches = [s.decoder.state.kv_caches() for s in sessions]
    assert all(c[0].pool is caches[0][0].pool and c[1].pool is caches[0][1].pool for c in caches)
    assert caches[0][0].pool is not caches[0][1].pool
    parts = [ForwardInput(ids=torch.zeros(4, dtype=torch.long), cache=c[0], lengths=s.decoder.state.length_dev)
             for s, c in zip(sessions, caches)]
    together = ForwardInput.batch(parts).attention_at_once([c[0] for c in caches])
    assert together is not None and together.table.shape == (3, caches[0][0].table.numel())
    assert together.lengths.tolist() == [CONTEXT] * 3
    with launches_per_sequence():  # the same run's baseline: a launch a sequence
        assert ForwardInput.batch(parts).attention_at_once([c[0] for c in caches]) is None
    assert ForwardInput.batch(parts).attention_at_once([c[0] for c in caches]) is not None
