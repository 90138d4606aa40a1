"""Structured output in the engine (runtime/grammar.py): llguidance masks per tree node.

- A tree's masks are those of the grammar after each node's own path (checked against a fresh
  matcher fed the path), the nodes the grammar forbids are pruned with their subtrees, an end token
  ends its path, and the request's matcher is left where it was.
- Greedy constrained chain and ddtree decoding emit exactly the tokens of greedy constrained AR.
- Every output, greedy or sampled, in every mode, is JSON that validates against its schema.
- A forced tool call's grammar (structured.tools_grammar) is the call envelope, and chain and
  ddtree emit AR's tokens under it.

The embedded model runs in float32 (same numerics in every mode): it knows JSON, so its outputs
under a schema are meaningful and its draft proposes trees worth pruning.
"""

import json
import os
from types import SimpleNamespace

import jsonschema
import llguidance
import pytest
import torch

from flashtree import Engine, SamplingParams
from flashtree.checkpoint import render_chat
from flashtree.runtime.ddtree import Tree
from flashtree.errors import GrammarError
from flashtree.models.inputs import ForwardInput
from flashtree.runtime.grammar import GrammarCompiler, GrammarConstraint
from flashtree.serve.structured import ANY_OBJECT, JSON_OPTIONS, ToolSpec, tools_grammar
from flashtree.serve.toolcalls import forced_prefix
from flashtree.train.synth_tools import TOOLS

ASSETS = os.path.join(os.path.dirname(__file__), "..", "flashtree", "assets", "target")
pytestmark = pytest.mark.skipif(not os.path.isdir(ASSETS), reason="no embedded model in this checkout")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "temp"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"},
                          "temp": {"type": "integer", "minimum": -5, "maximum": 40}}}
VERDICT = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
           "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                          "score": {"type": "integer", "minimum": 0, "maximum": 9}}}
CASES = [("What's the weather like in Paris? Answer in JSON.", WEATHER),
         ("Is Python a programming language?", VERDICT),
         ("Tell me the current weather for Berlin.", WEATHER)]


def grammar_of(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


@pytest.fixture(scope="module")
def engines():
    return {mode: Engine.from_pretrained(mode=mode, dtype="float32", max_ctx=1024)
            for mode in ("ar", "chain", "ddtree")}


def prompt_ids(engine: Engine, question: str) -> list[int]:
    text = render_chat(engine.tokenizer, [{"role": "user", "content": question}], None, True,
                       {"enable_thinking": False})
    return engine.tokenizer.encode(text)


def assert_schema_outputs_equal_ar(engines: dict, question: str, schema: dict) -> None:
    """Each engine (by mode) answers `question` greedily under `schema`: every output completes
    and validates, and chain's and ddtree's tokens are AR's (also run on the GPU: test_gpu_grammar.py)."""
    outputs = {}
    for mode, engine in engines.items():
        result = engine.generate(prompt_ids(engine, question), max_tokens=120, grammar=grammar_of(schema))
        assert result.finish_reason == "stop"  # a bounded schema always completes
        jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids)), schema)
        outputs[mode] = result.token_ids
    assert outputs["chain"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]


@pytest.mark.parametrize("question,schema", CASES)
def test_greedy_constrained_speculation_equals_ar(engines, question, schema):
    assert_schema_outputs_equal_ar(engines, question, schema)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_sampled_outputs_validate(engines, mode):
    engine = engines[mode]
    ids = prompt_ids(engine, CASES[0][0])
    for seed in range(4):
        result = engine.generate(ids, SamplingParams(temperature=1.5, seed=seed), max_tokens=120,
                                 grammar=grammar_of(WEATHER))
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids)), WEATHER)


def test_ignore_eos_still_ends_a_complete_output(engines):
    engine = engines["ar"]
    result = engine.generate(prompt_ids(engine, CASES[1][0]), max_tokens=120, stop_token_ids=[],
                             grammar=grammar_of(VERDICT))
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids)), VERDICT)


@pytest.fixture(scope="module")
def compiler(engines):
    engine = engines["ar"]
    return GrammarCompiler(engine.tokenizer, engine.target.config.vocab_size)


def mask_after(compiler: GrammarCompiler, grammar: str, path: list[int], eos: int) -> torch.Tensor:
    """The mask a fresh matcher gives after `path`: the reference for one tree node."""
    fresh = compiler.constraint(grammar, {eos}, torch.device("cpu"))
    fresh.advance(path)
    return fresh.root_mask()[0]


def test_tree_masks_follow_each_path_and_prune_forbidden_nodes(engines, compiler):
    tok = engines["ar"].tokenizer
    eos = tok.eos_token_ids[0]
    grammar = grammar_of(ANY_OBJECT)
    one = lambda text: tok.encode(text)[0]  # noqa: E731
    # root "{" already emitted; below it: '"' (allowed) -> 'a' -> '"', 'x' (forbidden after "{"),
    # '}' (allowed: "{}" is complete) -> EOS (allowed) -> '"' (after EOS: pruned)
    brace, quote, letter_a, x, close = one("{"), one('"'), one("a"), one("x"), one("}")
    tree = Tree([brace, quote, letter_a, quote, x, x, close, eos, quote],
                [-1, 0, 1, 2, 0, 4, 0, 6, 7], [0, 1, 2, 3, 1, 2, 1, 2, 3])
    constraint = compiler.constraint(grammar, {eos}, torch.device("cpu"))
    constraint.advance([brace])
    before = constraint.root_mask()
    pruned, masks = constraint.tree_masks(tree)
    assert pruned.tokens == [brace, quote, letter_a, quote, close, eos]
    assert pruned.parents == [-1, 0, 1, 2, 0, 4]
    assert masks.shape == (6, engines["ar"].target.config.vocab_size)
    for node in range(5):  # every node but the end token: the grammar after its path
        path, n = [], node
        while n > 0:
            path.insert(0, pruned.tokens[n])
            n = pruned.parents[n]
        assert torch.equal(masks[node], mask_after(compiler, grammar, [brace] + path, eos)), node
    assert masks[4].nonzero().flatten().tolist() == [eos]  # "{}" is complete: only the end token
    assert masks[5].nonzero().flatten().tolist() == [eos]
    assert not masks[0, x] and masks[0, quote]
    assert torch.equal(constraint.root_mask(), before)  # the request's matcher did not move


def test_a_grammar_llguidance_refuses_is_a_config_error(compiler):
    with pytest.raises(GrammarError, match="grammar"):
        compiler.constraint('{"grammars": [{"lark_grammar": "start: undefined_rule"}]}', {2},
                            torch.device("cpu"))


def test_a_limit_hit_while_decoding_fails_the_request_cleanly(compiler):
    """llguidance can enter its error state at any mask (a parser or lexer limit): the request
    fails with a message, never a draw from a row of -inf."""
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar_of(ANY_OBJECT), log_level=0,
                                   limits=llguidance.LLParserLimits(step_max_items=2))
    constraint = GrammarConstraint(matcher, compiler, [2], torch.device("cpu"))
    with pytest.raises(GrammarError, match="structured output failed: .*Too many items"):
        constraint.root_mask()


# --- sampling under a grammar is the target's masked distribution, in every mode -----------------

from test_decoding import N_SAMPLES, SAMPLING, VOCAB, chi2_pvalue, tiny_vocab_pair  # noqa: E402,F401

# the three output positions, as token ids (0 and 2 are the tiny tokenizer's EOS ids: end tokens)
ALLOWED = [{1, 3, 4}, {4, 5}, {1, 3, 5}]
TOKEN_GRAMMAR = llguidance.LLMatcher.grammar_from_lark("start: <[1,3-4]> <[4-5]> <[1,3,5]>")


def masked_exact_distribution(eng):
    """P(t1 t2 t3) of AR sampling from the target's distribution masked to ALLOWED, by enumeration."""
    from flashtree.runtime.grammar import apply_mask
    from flashtree.runtime.sampling import Sampler
    sampler = Sampler(SAMPLING, VOCAB, torch.device("cpu"), [])
    probs = {(): 1.0}
    for allowed in ALLOWED:
        mask = torch.tensor([[t in allowed for t in range(VOCAB)]])
        nxt = {}
        for prefix, p in probs.items():
            seq = [1, 2, 3] + list(prefix)
            cache = eng.target.new_cache(64, torch.float32, "cpu")
            h, _ = eng.target(ForwardInput.prefill(torch.tensor(seq), cache))
            dist = sampler.probs(apply_mask(eng.target.logits(h[-1:]), mask))[0]
            for t in range(VOCAB):
                if dist[t] > 0:
                    nxt[prefix + (t,)] = p * dist[t].item()
        probs = nxt
    return probs


@pytest.mark.slow  # thousands of sampled steps: about a minute on two cores
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_sampled_distribution_under_a_grammar_equals_the_masked_target(tiny_vocab_pair, mode):
    target, draft = tiny_vocab_pair
    eng = Engine.from_pretrained(str(target), str(draft), mode=mode, budget=6, max_ctx=64)
    exact = masked_exact_distribution(eng)
    counts, steps, accepted = {}, 0, 0
    for seed in range(N_SAMPLES):
        params = SamplingParams(**{**SAMPLING.to_dict(), "seed": seed})
        res = eng.generate([1, 2, 3], params, max_tokens=3, grammar=TOKEN_GRAMMAR)
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        steps += len(res.stats.accept_lengths)
        accepted += sum(a > 1 for a in res.stats.accept_lengths)
    assert set(counts) <= set(exact)  # every output follows the grammar
    if mode != "ar":  # the speculative path is really exercised
        assert accepted / steps > 0.05
    assert chi2_pvalue(counts, exact, N_SAMPLES) > 1e-3


# --- a forced tool call (structured.tools_grammar): the call envelope, exact under speculation ----

def forced_grammar(tokenizer, choice: str, max_calls=None) -> str:
    """The grammar of a forced call over the embedded model's (non-strict) tools."""
    ctx = SimpleNamespace(tokenizer=tokenizer, tool_format="hermes",
                          templates=SimpleNamespace(check_grammar=lambda grammar, start=False: None))
    specs = [ToolSpec(t["function"]["name"], t["function"]["parameters"], False, "tools") for t in TOOLS]
    return tools_grammar(ctx, specs, choice, max_calls)


def test_a_forced_call_grammar_is_the_call_envelope(engines, compiler):
    """Named: the arguments (any object) close the call the prompt opened, then only more calls
    of that function or the end; never `<tool_call>` again inside the open call (the embedded
    model's mistake) nor text. Required: any declared function, no other name. One call when
    parallel calls are off."""
    tok = engines["ar"].tokenizer
    eos = tok.eos_token_ids[0]

    def accepts(grammar: str, text: str) -> tuple[bool, bool]:
        """(whether the grammar takes all of `text`, whether it may end there)"""
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tok.encode(text)), matcher.is_accepting()

    named = forced_grammar(tok, "get_weather")
    call = '{"city": "Paris", "days": [1, {"a": null}]}}\n</tool_call>'
    assert accepts(named, call) == (True, True)
    assert accepts(named, call + '\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>') == (True, True)
    assert not accepts(named, call + '\n<tool_call>\n{"name": "calculator"')[0]
    assert not accepts(named, '<tool_call>')[0]
    assert not accepts(named, '5, "unit": "celsius"}')[0]  # arguments are an object
    assert not accepts(named, call + "\nThe weather")[0]
    assert accepts(named, '{"city": "Paris"}')[1] is False  # the call is not closed yet
    one = forced_grammar(tok, "get_weather", max_calls=1)
    matcher = llguidance.LLMatcher(compiler.tokenizer, one, log_level=0)
    assert matcher.consume_tokens(tok.encode(call)) and matcher.is_accepting()
    mask = matcher.compute_bitmask()
    assert [i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1] == [eos]  # only the end
    required = forced_grammar(tok, "required")
    assert accepts(required, '{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>') == (True, True)
    assert not accepts(required, '{"name": "nope"')[0]
    assert eos not in tok.encode(call)


@pytest.mark.parametrize("question", ["What's the weather in Paris?", "Thanks!"])
def test_greedy_forced_call_speculation_equals_ar(engines, question):
    """Under a forced call's grammar (any-object arguments, where a tree explores many JSON
    values) chain and ddtree emit AR's tokens. "Thanks!" once failed in ddtree: llguidance's
    rollback left a matcher whose next masks were wrong (runtime/grammar.py copies instead)."""
    assert_forced_calls_equal_ar(engines, question)


def assert_forced_calls_equal_ar(engines: dict, question: str) -> None:
    """Each engine (by mode) continues a forced `get_weather` call after `question` greedily under
    the call's grammar: each output that ends closes a call of that function with object
    arguments, and chain's and ddtree's tokens are AR's (also run on the GPU: test_gpu_grammar.py)."""
    outputs = {}
    for mode, engine in engines.items():
        opened = forced_prefix("hermes", "get_weather")
        text = render_chat(engine.tokenizer, [{"role": "user", "content": question}], TOOLS, True,
                           {"enable_thinking": False}) + opened
        result = engine.generate(engine.tokenizer.encode(text), max_tokens=100,
                                 grammar=forced_grammar(engine.tokenizer, "get_weather"))
        if result.finish_reason == "stop":  # else max_tokens cut the arguments
            call = json.loads((opened + engine.tokenizer.decode(result.token_ids)).split("<tool_call>")[1]
                              .split("</tool_call>")[0])
            assert call["name"] == "get_weather" and isinstance(call["arguments"], dict)
        outputs[mode] = result.token_ids
    assert outputs["chain"] == outputs["ar"]
    assert outputs["ddtree"] == outputs["ar"]
