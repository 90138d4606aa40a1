"""logprobs and logit_bias through a live server and the real `openai` client.

Shapes are checked by validating the raw JSON against the SDK's own response types; values by
what must hold whatever the weights: under greedy decoding the chosen token is the likeliest,
ar and ddtree (one server each) report the same logprobs for the same tokens, a streamed answer
carries the same logprobs as a whole one, and a stop string leaves out the tokens it cuts.
Under structured output the tokens the grammar forbids are no alternatives: every logprob is
finite and every answer is JSON (which has no -Infinity), streamed or not.
"""

import json
import math

import httpx
import pytest
from openai.types import Completion
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import ResponseOutputMessage

from flashtree.checkpoint import load_tokenizer
from flashtree.runtime.engine import ASSETS
from flashtree.serve.logprobs import Logprobs
from flashtree.serve.pipeline import GenerationSpec, OutputPipeline, TextDelta
from serve_harness import module_server

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The colors of the rainbow are"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
N = 24
JSON_FORMAT = {"type": "json_object"}
STRUCTURED = [  # top_logprobs 5: the grammar leaves fewer tokens drawable at the answer's first
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "response_format": JSON_FORMAT,
                              "logprobs": True, "top_logprobs": 5}),
    ("/v1/responses", {"input": MESSAGES[0]["content"], "max_output_tokens": 8,
                       "text": {"format": JSON_FORMAT}, "top_logprobs": 5}),
]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory)


@pytest.fixture(scope="module")
def ar_server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, "--mode", "ar")


def assert_same_logprobs(a, b):
    """Two lists of chat-style logprob entries (dicts): the same tokens and alternatives, the same
    numbers up to float noise (a prefix restored from the cache is computed in other chunks)."""
    assert [(x["token"], [t["token"] for t in x["top_logprobs"]]) for x in a] == \
        [(y["token"], [t["token"] for t in y["top_logprobs"]]) for y in b]
    flat = [[x["logprob"], *(t["logprob"] for t in x["top_logprobs"])] for x in a]
    assert flat == [pytest.approx([y["logprob"], *(t["logprob"] for t in y["top_logprobs"])], abs=1e-4) for y in b]


def raw_post(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def strict_json(text: str):
    """`text` parsed as the JSON specification has it (Python's parser also takes NaN, -Infinity)."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def logprob_entries(value) -> list[dict]:
    """Every token entry (a dict with `top_logprobs`) anywhere in a decoded answer or event."""
    if isinstance(value, list):
        return [e for item in value for e in logprob_entries(item)]
    if not isinstance(value, dict):
        return []
    own = [value] if "top_logprobs" in value and "logprob" in value else []
    return own + [e for item in value.values() for e in logprob_entries(item)]


def chat_body(**kw):
    return {"model": "x", "messages": MESSAGES, "temperature": 0, "ignore_eos": True, "max_tokens": N, **kw}


def test_chat_logprobs_validate_and_the_greedy_token_is_the_likeliest(server):
    data = raw_post(server, "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=4))
    response = ChatCompletion.model_validate(data)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == N
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.logprob == max(top.logprob for top in entry.top_logprobs)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0.0
        spelled = "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)  # part of a character
        assert entry.token in (bytes(entry.bytes).decode("utf-8", "replace"), spelled)
    plain = raw_post(server, "/v1/chat/completions", chat_body(logprobs=True))
    assert [e["top_logprobs"] for e in plain["choices"][0]["logprobs"]["content"]] == [[]] * N
    assert raw_post(server, "/v1/chat/completions", chat_body())["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path,body", STRUCTURED, ids=[path for path, _ in STRUCTURED])
def test_structured_output_logprobs_leave_out_the_tokens_the_grammar_forbids(server, path, body, stream):
    r = httpx.post(server.url + path, json={"model": "x", "temperature": 0, "stream": stream, **body}, timeout=120)
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: {")]
    payloads = [strict_json(line) for line in lines] if stream else [strict_json(r.text)]
    entries = logprob_entries(payloads)
    assert entries
    for entry in entries:
        assert all(math.isfinite(e["logprob"]) for e in [entry, *entry["top_logprobs"]]), entry
    assert any(len(entry["top_logprobs"]) < 5 for entry in entries)


def test_chat_streaming_carries_the_same_logprobs(server):
    client = server.client()
    whole = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, logprobs=True,
                                           top_logprobs=2, **GREEDY)
    streamed, text = [], ""
    for chunk in client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, logprobs=True,
                                                top_logprobs=2, stream=True, **GREEDY):
        ChatCompletionChunk.model_validate(chunk.model_dump())
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            streamed += choice.logprobs.content
    assert text == whole.choices[0].message.content
    assert_same_logprobs([e.model_dump() for e in streamed], [e.model_dump() for e in whole.choices[0].logprobs.content])


@pytest.mark.slow  # a second live server
def test_logprobs_are_the_same_in_ar_and_ddtree(server, ar_server):
    def run(srv):
        out = srv.client().completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=5, **GREEDY)
        return out.choices[0].logprobs

    tree, ar = run(server), run(ar_server)
    assert tree.tokens == ar.tokens
    assert tree.token_logprobs == pytest.approx(ar.token_logprobs, abs=1e-4)
    for a, b in zip(tree.top_logprobs, ar.top_logprobs):
        assert a.keys() == b.keys()
        assert [a[k] for k in a] == pytest.approx([b[k] for k in a], abs=1e-4)


def test_completions_logprobs_shape(server):
    data = raw_post(server, "/v1/completions", {"model": "x", "prompt": PROMPT, "max_tokens": N,
                                               "temperature": 0, "ignore_eos": True, "logprobs": 3})
    choice = Completion.model_validate(data).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == N
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):  # a token holding part of a character has no text of its own
            assert choice.text[offset:offset + len(token)] == token
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == logprob == max(top.values())
        assert 1 <= len(top) <= 4  # the 3 alternatives and the chosen token (one of them, greedy)


def test_completions_streaming_carries_the_same_logprobs(server):
    client = server.client()
    whole = client.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=2, **GREEDY)
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=2,
                                           stream=True, **GREEDY):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:  # (a chunk's finish_reason is null until the
            CompletionLogprobs.model_validate(chunk.choices[0].logprobs.model_dump())  # last: no Completion)
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert text == whole.choices[0].text
    assert (tokens, offsets) == (whole.choices[0].logprobs.tokens, whole.choices[0].logprobs.text_offset)


def stop_cases(text, tokens, offsets):
    """(stop, tokens kept) pairs on a greedy output: a token's whole text, and a string that spans
    the boundary of two tokens (it begins inside or at the start of the first); each the first
    occurrence of its text, of plain characters (no token holding part of a character)."""
    plain = [not t.startswith("bytes:") and "\ufffd" not in t for t in tokens]
    for k in range(1, len(tokens)):
        if plain[k] and tokens[k] and text.find(tokens[k]) == offsets[k]:
            yield tokens[k], k
            break
    for k in range(2, len(tokens)):
        span = text[offsets[k] - 1:offsets[k] + 1]
        if plain[k - 1] and plain[k] and tokens[k - 1] and text.find(span) == offsets[k] - 1:
            yield span, k - 1
            break


def test_a_stop_string_leaves_out_the_tokens_it_cuts(server):
    client = server.client()
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=0, **GREEDY).choices[0]
    cases = list(stop_cases(full.text, full.logprobs.tokens, full.logprobs.text_offset))
    assert len(cases) == 2
    for stop, kept in cases:
        out = client.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=0, stop=[stop],
                                        **GREEDY).choices[0]
        assert out.text == full.text[:full.text.find(stop)]
        assert out.logprobs.tokens == full.logprobs.tokens[:kept]
        assert out.logprobs.text_offset == full.logprobs.text_offset[:kept]


def test_a_stop_inside_a_token_cuts_that_token():
    """Through the pipeline, with the embedded tokenizer (real merges: " capital" is one token)."""
    tokenizer = load_tokenizer(ASSETS / "target")
    ids = tokenizer.encode("The capital of France is Paris")
    texts = [tokenizer.decode([i]) for i in ids]
    capital = texts.index(" capital")
    pipe = OutputPipeline(tokenizer, GenerationSpec(ids, {}, len(ids), stops=["pit"]))
    fake = [(-float(i), [(t, -float(i))]) for i, t in enumerate(ids)]
    items = pipe.push(ids[:1], fake[:1]) + pipe.push(ids[1:], fake[1:]) + pipe.finish()
    text = "".join(item.text for item in items if isinstance(item, TextDelta))
    entries = [e for item in items if isinstance(item, Logprobs) for e in item.entries]
    assert text == "".join(texts[:capital]) + " ca"
    assert capital >= 1 and [e.token for e in entries] == ids[:capital]
    assert [e.logprob for e in entries] == [lp for lp, _ in fake[:capital]]
    assert [e.offset for e in entries] == [len("".join(texts[:i])) for i in range(capital)]


def test_a_large_bias_makes_the_answer_that_token(server):
    tokenizer_vocab = server.get("/v1/models").json()["data"][0]["meta"]["n_vocab"]
    client = server.client()
    plain = client.completions.create(model="x", prompt=PROMPT, max_tokens=8, logprobs=0, **GREEDY)
    favourite = next(t for t in range(100, tokenizer_vocab) if t not in plain.choices[0].logprobs.tokens)
    out = client.completions.create(model="x", prompt=PROMPT, max_tokens=8, logprobs=0,
                                    logit_bias={str(favourite): 100}, **GREEDY).choices[0]
    assert len(set(out.logprobs.tokens)) == 1 and len(out.logprobs.tokens) == 8
    assert out.logprobs.tokens[0] not in plain.choices[0].logprobs.tokens
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, logprobs=True,
                                          logit_bias={str(favourite): 100}, **GREEDY)
    assert {e.token for e in chat.choices[0].logprobs.content} == {out.logprobs.tokens[0]}


def test_minus_100_on_the_first_greedy_token_changes_it(server, tiny_pair):
    client = server.client()

    def first_token(**kw):
        out = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=1, logprobs=True, **GREEDY, **kw)
        return out.choices[0].logprobs.content[0].token

    first = first_token()
    tokenizer = load_tokenizer(tiny_pair[0])
    same_text = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == first]
    assert same_text
    assert first_token(logit_bias={str(i): -100 for i in same_text}) != first


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": "much"}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1000000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past what int() converts
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
])
def test_bad_values_are_a_400_naming_the_field(server, path, body, param):
    base = {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": PROMPT}
    r = httpx.post(server.url + path, json={"model": "x", "max_tokens": 2, **base, **body}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in error["message"] or error["param"] == param
    assert error["code"] != "unsupported_parameter"


def test_responses_logprobs_match_chat_and_stream(server):
    client = server.client()
    chat = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, logprobs=True,
                                          top_logprobs=3, **GREEDY).choices[0].logprobs.content
    ask = dict(model="x", input=MESSAGES[0]["content"], max_output_tokens=N, top_logprobs=3,
               include=["message.output_text.logprobs"], **GREEDY)
    data = raw_post(server, "/v1/responses", {**ask, **ask.pop("extra_body")})
    [message] = [ResponseOutputMessage.model_validate(item) for item in data["output"] if item["type"] == "message"]
    part = message.content[0]
    assert_same_logprobs([e.model_dump() for e in part.logprobs], [e.model_dump() for e in chat])
    assert [e.bytes for e in part.logprobs] == [e.bytes for e in chat]
    assert all(e.logprob == max(t.logprob for t in e.top_logprobs) for e in part.logprobs)
    streamed, done = [], None
    for event in client.responses.create(stream=True, **ask):
        if event.type == "response.output_text.delta":
            streamed += [e.model_dump(exclude_none=True) for e in event.logprobs or []]
        elif event.type == "response.output_text.done":
            done = [e.model_dump(exclude_none=True) for e in event.logprobs]
    assert_same_logprobs(streamed, [e.model_dump() for e in part.logprobs])
    assert_same_logprobs(done, streamed)
