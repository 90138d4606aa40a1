"""benchmarks/card_24g.py at a small shape on the CPU: the random Q4_K_M hybrid GGUF it writes
(Q4_K, Q5_K and Q6_K tensors by llama-quantize's rules) and its draft are planned, loaded with
--quantize int4 (the wider slots rounded) and served to a growing tool-call conversation through
the openai client, each turn reusing the previous one as its cached prefix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import card_24g  # noqa: E402

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64}


def test_the_q4_k_m_mix_follows_llama_quantize():
    index = {"blk.0.attn_v.weight": (0, 16), "blk.5.attn_v.weight": (5, 16), "blk.12.ffn_down.weight": (12, 64),
             "blk.10.ffn_down.weight": (10, 64)}
    kind = card_24g.Q
    assert card_24g.q4_k_m_type("output.weight", (10, 256), index) == kind.Q6_K
    assert card_24g.q4_k_m_type("blk.0.attn_qkv.weight", (10, 256), index) == kind.Q5_K
    assert card_24g.q4_k_m_type("blk.0.attn_v.weight", (10, 256), index) == kind.Q6_K  # first eighth
    assert card_24g.q4_k_m_type("blk.5.attn_v.weight", (10, 256), index) == kind.Q4_K  # (5 - 2) % 3 == 0
    assert card_24g.q4_k_m_type("blk.12.ffn_down.weight", (10, 256), index) == kind.Q4_K  # (12 - 8) % 3 == 1
    assert card_24g.q4_k_m_type("blk.10.ffn_down.weight", (10, 256), index) == kind.Q6_K  # (10 - 8) % 3 == 2
    assert card_24g.q4_k_m_type("blk.0.ssm_conv1d.weight", (10, 4), index) == kind.F32
    assert card_24g.q4_k_m_type("blk.0.attn_norm.weight", (256,), index) == kind.F32


@pytest.mark.slow  # writes the files and serves three turns on the CPU: ~25 s
def test_a_small_card_run_serves_every_turn_from_the_cache(tmp_path):
    out = tmp_path / "card.json"
    assert card_24g.main(["--work", str(tmp_path / "files"), "--turns", "1500,2000,2600", "--max-ctx", "4096",
                          "--out", str(out), "--shape", json.dumps(SMALL), "--flags", "--quantize", "int4",
                          "--kv-type", "q4_0", "--quantize-draft", "int4", "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["plan"]["fits"] and set(result["target_bytes_by_type"]) == {"Q4_K", "Q5_K", "Q6_K", "F32"}
    turns = result["turns"]
    assert [t["completion_tokens"] for t in turns] == [64, 64, 64] and result["server_alive"]
    assert turns[0]["cached_tokens"] == 0
    for before, after in zip(turns, turns[1:]):
        assert before["prompt_tokens"] < after["prompt_tokens"]
        assert after["cached_tokens"] >= before["prompt_tokens"] - 1  # the previous turn, from the cache
    for turn in turns:  # the engine's own split of the turn's time, from /metrics
        assert turn["decode_steps"] >= 1 and 0 < turn["decode_s"] < turn["seconds"]
        assert turn["prefill_s"] > 0 and turn["ms_per_decode_step"] > 0
        assert 0 < turn["ms_inside_each_step"] <= turn["ms_per_decode_step"]
        assert turn["device_mallocs"] == turn["device_frees"] == 0  # the CPU has no CUDA allocator
