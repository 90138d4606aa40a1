"""Structured output on the GPU: the embedded pair in bf16 with CUDA graphs and the deterministic
mode (a row's bits do not follow the rows beside it, so AR, chain and ddtree see the same logits),
under a JSON schema and under a forced tool call's grammar. The tree's masks (one grammar matcher
copy per path, runtime/grammar.py) prune the device-built trees; greedy chain and ddtree must emit
AR's tokens, and every output must validate (test_grammar.py's checks, which run the pair in float32
on the CPU). Needs llguidance (the server's grammar library)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flashtree import Engine  # noqa: E402
from test_grammar import CASES, assert_forced_calls_equal_ar, assert_schema_outputs_equal_ar  # noqa: E402


@pytest.fixture(scope="module")
def engines():
    out = {mode: Engine.from_pretrained(mode=mode, device="cuda", dtype="bfloat16", max_ctx=1024,
                                        deterministic=True) for mode in ("ar", "chain", "ddtree")}
    yield out
    for engine in out.values():
        engine.close()


@pytest.mark.parametrize("question,schema", CASES)
def test_constrained_speculation_equals_ar_on_the_gpu(engines, question, schema):
    assert_schema_outputs_equal_ar(engines, question, schema)


@pytest.mark.parametrize("question", ["What's the weather in Paris?", "Thanks!"])
def test_forced_call_speculation_equals_ar_on_the_gpu(engines, question):
    assert_forced_calls_equal_ar(engines, question)
