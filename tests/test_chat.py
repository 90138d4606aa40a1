"""Chat rendering with the checkpoint's own template, OpenAI -> template message conversion, and
the incremental detokenizer (never a broken character, specials hidden but markers kept)."""

import json
from types import SimpleNamespace

import pytest

from flashtree.checkpoint import ChatTemplateError, load_tokenizer, render_chat
from flashtree.checkpoint.chat_template import RENDER_VARIABLES, template_functions
from flashtree.serve.chat import IncrementalDetokenizer, template_messages
from tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def reference_render(tok_dir):
    """transformers' apply_chat_template on the same files: the renderer we must agree with."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))

    def render(messages, tools=None, **kwargs):
        return hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    return render


TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "find <b>things</b> & 'stuff'",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_render_matches_transformers(tokenizer, reference_render):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u2603"}]
    text = render_chat(tokenizer, messages, template_kwargs={"enable_thinking": False})
    assert text == reference_render(messages, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat(tokenizer, messages).endswith("<|im_start|>assistant\n")


def test_tools_and_tool_history_render_without_html_escaping(tokenizer, reference_render):
    openai_messages = [
        {"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "text", "text": "up"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x<y"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
    ]
    messages = template_messages(openai_messages)
    assert messages[0]["content"] == "look up"
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"q": "x<y"}
    text = render_chat(tokenizer, messages, tools=TOOLS)
    assert "find <b>things</b> & 'stuff'" in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x<y"}}\n</tool_call>' in text
    assert "<tool_response>\nfound\n</tool_response>" in text
    assert text == reference_render(messages, tools=TOOLS, add_generation_prompt=True)


def test_unparsable_arguments_are_passed_through_as_text():
    msg = template_messages([{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "not json"}}]}])
    assert msg[0]["tool_calls"][0]["function"]["arguments"] == "not json"


def test_template_file_wins_over_the_config_like_transformers(tok_dir, tmp_path):
    """transformers saves chat_template.jinja and reads it over tokenizer_config.json's copy."""
    import shutil
    from transformers import AutoTokenizer
    model = tmp_path / "m"
    shutil.copytree(tok_dir, model)
    (model / "chat_template.jinja").write_text("FILE{{ messages[0]['content'] }}")
    ours = load_tokenizer(model)
    assert ours.chat_template_source == str(model / "chat_template.jinja")
    assert ours.chat_template == AutoTokenizer.from_pretrained(str(model)).chat_template
    assert render_chat(ours, [{"role": "user", "content": "x"}]) == "FILEx"


def test_template_errors_are_chat_template_errors():
    strict = SimpleNamespace(chat_template="{{ raise_exception('roles must alternate') }}",
                             bos_token=None, eos_token=None)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(strict, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(SimpleNamespace(chat_template=None), [])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat(SimpleNamespace(chat_template="{% if %}", bos_token=None, eos_token=None), [])
    sandboxed = SimpleNamespace(chat_template="{{ messages.__class__.__mro__ }}", bos_token=None, eos_token=None)
    with pytest.raises(ChatTemplateError):
        render_chat(sandboxed, [])


def test_template_helpers_exist(tokenizer):
    tpl = SimpleNamespace(chat_template="{{ strftime_now('%Y') }}|{{ {'a': '<&>'} | tojson }}|{{ bos_token }}",
                          bos_token="<s>", eos_token=None)
    year, payload, bos = render_chat(tpl, []).split("|")
    assert year.isdigit() and json.loads(payload) == {"a": "<&>"} and bos == "<s>"


def test_render_variables_are_what_render_chat_sets():
    """The names the server refuses in chat_template_kwargs are the ones render_chat overwrites."""
    seen = {}
    tpl = SimpleNamespace(chat_template="x", bos_token="<s>", eos_token="</s>")
    render_chat(tpl, [], template_kwargs={"enable_thinking": True}, render=lambda _, v: seen.update(v) or "")
    assert set(seen) - {"enable_thinking"} == set(RENDER_VARIABLES)
    assert {"raise_exception", "strftime_now", "namespace", "range"} <= template_functions()


def test_detokenizer_never_splits_a_character(tokenizer):
    text = "caf\u00e9 \U0001f98a fox \u4f60\u597d \u2603 ok"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1], "the 4-byte emoji spans several tokens, so some step must hold back"


def test_detokenizer_hides_specials_but_keeps_parser_markers(tokenizer):
    ids = (tokenizer.encode("<think>x</think>") + [tokenizer.token_to_id("<|im_start|>")]
           + tokenizer.encode("<tool_call>y</tool_call>"))
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == "<think>x</think><tool_call>y</tool_call>"


GENERATION_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FEATURES_TEMPLATE = (
    "{%- set ns = namespace(users=0, first=none) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% continue %}{% endif %}"
    "{%- if m.role == 'stop' %}{% break %}{% endif %}"
    "{%- set ns.users = ns.users + 1 %}"
    "{%- if ns.first is none %}{% set ns.first = m.content %}{% endif %}"
    "{%- endfor %}"
    "users={{ ns.users }} first={{ ns.first }}\n"
    "{{ tools | tojson(indent=2) }}\n"
    "{{ {'b': '\u00e9', 'a': '<x>'} | tojson(ensure_ascii=True, sort_keys=True) }}\n"
    "{{ {'k': [1, 2]} | tojson(separators=(',', ':')) }}\n"
    "{{ strftime_now('%Y') | length }}\n"
    "{%- if messages | length > 9 %}{{ raise_exception('too many messages') }}{% endif %}")


def test_generation_blocks_render_their_body_like_transformers(tokenizer, reference_render):
    """`{% generation %}` (assistant-mask markers) compiles and renders its body unchanged."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"}]
    source = SimpleNamespace(chat_template=GENERATION_TEMPLATE, bos_token=None, eos_token=None)
    text = render_chat(source, messages)
    assert "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nmore" in text
    assert text == reference_render(messages, chat_template=GENERATION_TEMPLATE, add_generation_prompt=True)


def test_hf_template_features(tokenizer, reference_render):
    """namespace, loop controls, tojson's json.dumps options, strftime_now and raise_exception,
    rendered as transformers renders them."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "user", "content": "u2"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "u3"}]
    source = SimpleNamespace(chat_template=FEATURES_TEMPLATE, bos_token=None, eos_token=None)
    text = render_chat(source, messages, tools=TOOLS)
    lines = text.split("\n")
    assert lines[0] == "users=2 first=u1"
    assert json.loads("\n".join(lines[1:-3])) == TOOLS and lines[2].startswith('  {')
    assert lines[-3] == '{"a": "<x>", "b": "\\u00e9"}'
    assert lines[-2] == '{"k":[1,2]}' and lines[-1] == "4"
    assert text == reference_render(messages, tools=TOOLS, chat_template=FEATURES_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="too many messages"):
        render_chat(source, messages * 2)


def test_detokenizer_pushes_of_several_ids_and_flush_of_a_cut_character(tokenizer):
    text = "x = '\u00e9\U0001f98a' # \u4f60\u597d"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush() == text
    cut = tokenizer.encode("ok \U0001f98a")[:-1]  # generation stopped inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer)
    head = detok.push(cut)
    tail = detok.flush()
    assert "\ufffd" not in head and tail.endswith("\ufffd")
    assert head + tail == tokenizer.decode(cut) and detok.flush() == ""
