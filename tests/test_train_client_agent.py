"""The agent stage's data (flashtree/train/synth_tasks.py, synth_client_agent.py, client_formats.py): conversations
in the four clients' real requests render exactly as the server renders those requests, the
model's turn parses with the server's tool-call parser into the client's own tool and the task's
arguments, and nothing of the held-out split leaks into training."""

from __future__ import annotations

import json
import random
import re

import pytest

from flashtree.checkpoint import render_chat
from flashtree.serve import anthropic_convert, responses_api
from flashtree.serve.anthropic_schemas import MessagesRequest
from flashtree.serve.chat import template_messages
from flashtree.serve.schemas import ChatCompletionRequest, ResponsesRequest
from flashtree.serve.toolcalls import ToolCall, ToolCallParser
from flashtree.train.chat_template import EMBEDDED
from flashtree.train.client_formats import CLIENTS
from flashtree.train.corpus import build_corpus, read_jsonl, training_text
from flashtree.train.synth_client_agent import TOOL_FOR, client_agent_record, client_request, load_frames
from flashtree.train.synth_tasks import FAMILIES, Pools, episode, heldout_tasks

# the tools each client's model must call, per family (its real tool names)
EXPECTED_TOOLS = {
    "claude": {"create": "Write", "append": "Bash", "list": "Bash", "run": "Bash", "read": "Read"},
    "codex": dict.fromkeys(FAMILIES, "exec_command"),
    "hermes": {"create": "write_file", "append": "terminal", "list": "search_files", "run": "terminal",
               "read": "read_file"},
    "opencode": {"create": "write", "append": "bash", "list": "bash", "run": "bash", "read": "read"},
}


@pytest.fixture(scope="module")
def frames():
    return load_frames()


def server_render(surface: str, body: dict) -> str:
    """What flashtree serve renders from the client's request body (the full conversation)."""
    if surface == "anthropic":
        req = MessagesRequest(**body, max_tokens=16)
        messages, tools = anthropic_convert.chat_messages(req), anthropic_convert.chat_tools(req)
    elif surface == "responses":
        req = ResponsesRequest(**body)
        messages, tools = responses_api._messages(req), responses_api._tools(req)
    else:
        req = ChatCompletionRequest(**body)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    return render_chat(EMBEDDED, template_messages(messages), tools, add_generation_prompt=False)


@pytest.mark.parametrize("client", CLIENTS)
def test_each_frame_offers_the_tools_the_stage_calls(frames, client):
    assert set(EXPECTED_TOOLS[client].values()) <= frames[client].tool_names()


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_records_render_as_the_server_renders_the_clients_request(frames, client, family):
    frame, rng = frames[client], random.Random(hash((client, family)) & 0xFFFF)
    ep = episode(rng, Pools.split(heldout=False), family)
    body = client_request(frame, ep, random.Random(1))
    record = {"kind": "client_agent", "messages": frame.chat_messages(body), "tools": frame.chat_tools(body)}
    text = training_text(record, eos="")
    assert text == server_render(frame.surface, body)
    assert ep.task in text and text.rstrip().endswith(ep.answer + "<|im_end|>")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_models_turn_parses_into_the_clients_tool_and_the_tasks_arguments(frames, client, family):
    frame, rng = frames[client], random.Random(7)
    ep = episode(rng, Pools.split(heldout=False), family)
    body = client_request(frame, ep, random.Random(2))
    messages, tools = frame.chat_messages(body), frame.chat_tools(body)
    call_turn = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    prompt = render_chat(EMBEDDED, messages[:call_turn], tools, add_generation_prompt=True)
    full = render_chat(EMBEDDED, messages[:call_turn + 1], tools, add_generation_prompt=False)
    generated = full[len(prompt):].removesuffix("<|im_end|>\n")
    generated = generated.split("</think>", 1)[1]  # the template's empty think block
    parser = ToolCallParser(tools)
    pieces = parser.feed(generated) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert len(calls) == 1 and not [p for p in pieces if isinstance(p, str) and p.strip()]
    assert calls[0].name == EXPECTED_TOOLS[client][family]
    args = json.loads(calls[0].arguments)
    # the arguments carry the task's own name, content or command
    wanted = {"create": ep.content, "read": ep.path, "list": ep.path}.get(family, ep.command)
    assert wanted in json.dumps(args, ensure_ascii=False).replace("\\\\", "\\") or \
        wanted in " ".join(str(v) for v in args.values())
    # and the tool's result comes back to the model in the next turn
    assert messages[call_turn + 1]["role"] == "tool"


def _words(text: str, items: list[str]) -> set[str]:
    return {x for x in items if re.search(rf"(?<![\w-]){re.escape(x)}(?![\w-])", text)}


def test_the_heldout_split_is_disjoint_and_never_in_training(frames):
    train, held = Pools.split(heldout=False), Pools.split(heldout=True)
    for attr in ("stems", "words", "dirs"):
        assert getattr(train, attr) and getattr(held, attr)
        assert not set(getattr(train, attr)) & set(getattr(held, attr))
    held_items = held.stems + held.words + held.dirs
    held_phrases = [re.split(r"\{\w+\}", p)[0] for ps in held.phrasings.values() for p in ps]
    rng = random.Random(3)
    for _ in range(400):
        record = client_agent_record(rng, frames, train)
        # what the task brought into the conversation: the request and everything after it
        start = max(i for i, m in enumerate(record["messages"]) if m["role"] == "user"
                    and i < next(j for j, n in enumerate(record["messages"]) if n.get("tool_calls")))
        text = json.dumps(record["messages"][start:], ensure_ascii=False)
        assert not _words(text, held_items), (record["family"], _words(text, held_items))
        assert not [p for p in held_phrases if p.strip() and p in text]


def test_heldout_tasks_use_only_heldout_items():
    held, train = Pools.split(heldout=True), Pools.split(heldout=False)
    tasks = heldout_tasks(12)
    assert {t["family"] for t in tasks} == {"create", "append", "run"}
    assert len({t.get("file") for t in tasks if "file" in t}) == sum("file" in t for t in tasks)
    for t in tasks:
        assert not _words(t["prompt"], train.stems + train.dirs)
        if "file" in t:
            assert t["file"].rsplit(".", 1)[0] in held.stems and t["content"] in t["prompt"]
        else:  # only running the command can give the answer
            assert t["answer"] not in t["prompt"]


def test_every_client_gets_a_tool_for_every_family():
    ep_rng = random.Random(5)
    for client, tool in TOOL_FOR.items():
        for family in FAMILIES:
            name, args, result = tool(episode(ep_rng, Pools.split(heldout=False), family), "/home/x/p")
            assert name == EXPECTED_TOOLS[client][family] and args and isinstance(result, str)


def test_corpus_option_writes_the_stage_and_leaves_the_rest_unchanged(tmp_path):
    plain = build_corpus(tmp_path / "a", n_chat=5, n_tool=5, n_heldout=4, stdlib_root=str(tmp_path))
    with_stage = build_corpus(tmp_path / "b", n_chat=5, n_tool=5, n_heldout=4, stdlib_root=str(tmp_path),
                              n_client_agent=8, n_copy=6)
    assert with_stage["train_client_agent"] == 8 and with_stage["heldout_client_agent"] == 4
    assert with_stage["copy_drill"] == 6 == len(list(read_jsonl(tmp_path / "b" / "copy_drill.jsonl.gz")))
    assert "train_client_agent" not in plain and "copy_drill" not in plain
    for name in ("train.jsonl.gz", "heldout.jsonl"):
        assert list(read_jsonl(tmp_path / "a" / name)) == list(read_jsonl(tmp_path / "b" / name))
    records = list(read_jsonl(tmp_path / "b" / "client_agent.jsonl.gz"))
    assert {r["kind"] for r in records} == {"client_agent"}
    assert all(r["client"] in CLIENTS and r["tools"] for r in records)
    for prompt in read_jsonl(tmp_path / "b" / "client_agent_heldout.jsonl"):
        assert prompt["messages"][-1]["role"] != "assistant"


def test_every_clients_records_fit_the_stages_rows(frames):
    """The stage trains on 16,384-token rows (recipe.sh LONG_SEQ): a record cut by a row would
    lose its answer, so every client's longest record must fit one with the embedded tokenizer."""
    from tokenizers import Tokenizer

    from flashtree.runtime.engine import ASSETS as MODEL_ASSETS

    path = MODEL_ASSETS / "target" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the embedded model is not in this checkout")
    tokenizer, rng = Tokenizer.from_file(str(path)), random.Random(11)
    for client in CLIENTS:
        longest = max(len(tokenizer.encode(training_text(client_agent_record(rng, frames, Pools.split(False),
                                                                             client))).ids) for _ in range(5))
        assert 2_000 < longest < 16_384, (client, longest)


def test_the_copy_drill_answers_with_the_asked_text_in_the_asked_form():
    from flashtree.train.synth_copy import copy_record

    rng, forms = random.Random(2), set()
    for _ in range(300):
        ask, answer = (m["content"] for m in copy_record(rng)["messages"])
        first, _, rest = ask.partition("\n")
        if first.endswith(":"):  # the text starts the next line
            forms.add("line")
            text = rest.split("\n")[0]
            assert answer == "Here it is: " + text
            continue
        text = first.split(": ", 1)[1]
        if "JSON" in ask:
            forms.add("json")
            assert json.loads(answer) == {"text": text}
        elif "quotes" in ask:
            quote = "'" if "single" in ask else '"'
            forms.add(quote)
            assert answer == quote + text + quote
        else:
            forms.add("plain")
            assert answer == text
    assert forms == {"json", "'", '"', "plain", "line"}


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded target's tokenizer, which the stage's data is written for."""
    from tokenizers import Tokenizer

    from flashtree.runtime.engine import ASSETS as MODEL_ASSETS

    path = MODEL_ASSETS / "target" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the embedded model is not in this checkout")
    return Tokenizer.from_file(str(path))


def test_the_copy_drill_copies_words_that_re_split_without_their_space(tokenizer):
    """The round-8 misses: a word is another token run with and without its leading space. The
    drill must hold such copies in both directions (after a space into an answer's start or a
    quote; from a line's start into a sentence), and its glued words must re-split often."""
    from flashtree.train.synth_tasks import glued_word
    from flashtree.train.synth_copy import copy_record

    rng = random.Random(5)
    words = [glued_word(rng) for _ in range(1000)]
    resplit = [w for w in words if tokenizer.encode(" " + w).tokens[1:] != tokenizer.encode(w).tokens[1:]]
    assert len(resplit) > 100, len(resplit)  # not just the first token's space changes
    directions = {"to_start": 0, "to_sentence": 0}
    for _ in range(600):
        ask, answer = (m["content"] for m in copy_record(rng)["messages"])
        if answer.startswith("Here it is: "):
            directions["to_sentence"] += 1
            assert ":\n" + answer.removeprefix("Here it is: ") in ask
        elif not answer.startswith("{"):
            directions["to_start"] += 1
            body = answer[1:-1] if "quotes" in ask else answer
            assert ": " + body in ask
    assert min(directions.values()) > 50, directions


def test_a_run_answer_quotes_the_output_as_the_same_tokens_as_the_tool_result(tokenizer):
    """The first agent-stage round's misses on `echo kettle | rev`: the answer put the output
    after a space, another token run than the result's ('Ġel tt ek' against 'el tt ek'). The
    answer now quotes it where no space comes before it, so copying it is copying the result's
    tokens."""
    rng, pools = random.Random(3), Pools.split(heldout=False)
    for _ in range(300):
        ep = episode(rng, pools, "run")
        result_tokens = tokenizer.encode(ep.output).tokens
        answer_tokens = tokenizer.encode(ep.answer).tokens
        n = len(result_tokens)
        assert any(answer_tokens[i:i + n] == result_tokens for i in range(len(answer_tokens) - n + 1)), \
            (ep.output, ep.answer)
