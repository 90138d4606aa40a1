"""Structured output on the GPU: the embedded pair in bf16 with CUDA graphs and the deterministic
mode (a row's bits do not follow the rows beside it, so AR, chain and ddtree see the same logits),
under a JSON schema and under a forced tool call's grammar. The tree's masks (one grammar matcher
copy per path, runtime/grammar.py) prune the device-built trees; greedy chain and ddtree must emit
AR's tokens, and every output must validate. Needs llguidance (the server's grammar library)."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import jsonschema  # noqa: E402

from flashtree import Engine  # noqa: E402
from test_grammar import CASES, forced_grammar, grammar_of, prompt_ids  # noqa: E402

from flashtree.checkpoint import render_chat  # noqa: E402
from flashtree.serve.toolcalls import forced_prefix  # noqa: E402
from flashtree.train.synth_tools import TOOLS  # noqa: E402


@pytest.fixture(scope="module")
def engines():
    out = {mode: Engine.from_pretrained(mode=mode, device="cuda", dtype="bfloat16", max_ctx=1024,
                                        deterministic=True) for mode in ("ar", "chain", "ddtree")}
    yield out
    for engine in out.values():
        engine.close()


@pytest.mark.parametrize("question,schema", CASES)
def test_constrained_speculation_equals_ar_on_the_gpu(engines, question, schema):
    outputs = {}
    for mode, engine in engines.items():
        result = engine.generate(prompt_ids(engine, question), max_tokens=120, grammar=grammar_of(schema))
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids)), schema)
        outputs[mode] = result.token_ids
    assert outputs["chain"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]


@pytest.mark.parametrize("question", ["What's the weather in Paris?", "Thanks!"])
def test_forced_call_speculation_equals_ar_on_the_gpu(engines, question):
    outputs = {}
    for mode, engine in engines.items():
        text = render_chat(engine.tokenizer, [{"role": "user", "content": question}], TOOLS, True,
                           {"enable_thinking": False}) + forced_prefix("hermes", "get_weather")
        result = engine.generate(engine.tokenizer.encode(text), max_tokens=100,
                                 grammar=forced_grammar(engine.tokenizer, "get_weather"))
        call = json.loads((forced_prefix("hermes", "get_weather") + engine.tokenizer.decode(result.token_ids))
                          .split("<tool_call>")[1].split("</tool_call>")[0])
        assert call["name"] == "get_weather" and isinstance(call["arguments"], dict)
        outputs[mode] = result.token_ids
    assert outputs["chain"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]
