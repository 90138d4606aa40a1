"""A chat template is a program from a downloaded file, and the server bounds it: a rendering that
runs past --chat-template-timeout or allocates past the memory limit is a 400 for its request
while the server goes on serving, a SIGTERM does not wait for one, and a template that does so
for a one-message conversation (from tokenizer_config.json or a GGUF file) is refused at start-up
with the template's source named. A client's JSON schema whose grammar takes longer than that
limit to check (an `allOf` of many patterns) is a 400 in the same way, and at once when sent
again."""

import json
import shutil
import signal
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest

from flashtree.checkpoint import ChatTemplateError, load_tokenizer
from flashtree.config import ServerConfig
from flashtree.serve.template_sandbox import RenderLimits, TemplateSandbox, check_template
from flashtree.train.chat_template import CHAT_TEMPLATE
from gguf_convert import convert
from serve_harness import FlashtreeServer, Server
from tiny_models import make_target

TIMEOUT_S = 2
SLACK_S = 8  # a render process to start again, a loaded CI machine
RANGE_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
STRING_BOMB = "{{ 'A' * 3000000000 }}"
# the embedded model's template, but for a final message that says `hang` or `grow`
TRIGGERED = ("{%- if messages[-1].content == 'hang' %}" + RANGE_BOMB +
             "{%- elif messages[-1].content == 'grow' %}" + STRING_BOMB + "{%- endif %}" + CHAT_TEMPLATE)


def with_template(src, out, template):
    """A copy of the checkpoint `src` whose tokenizer_config.json holds `template`."""
    shutil.copytree(src, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    return out


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("triggered")
    target = with_template(tiny_pair[0], root / "target", TRIGGERED)
    srv = Server(target, tiny_pair[1], root / "server.log", "--chat-template-timeout", str(TIMEOUT_S))
    try:
        yield srv
    finally:
        srv.stop()


def chat(srv, content, timeout=60):
    return srv.client().with_options(timeout=timeout).chat.completions.create(
        model="x", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)


def test_a_template_past_its_time_limit_gets_400_while_other_requests_are_served(server):
    failure, started = [], time.monotonic()

    def hang():
        try:
            chat(server, "hang", timeout=TIMEOUT_S + SLACK_S + 30)
        except openai.APIError as e:
            failure.append((e, time.monotonic() - started))

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(0.5)  # the hanging rendering holds one render process now
    completion = server.client().completions.create(model="x", prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].text is not None
    assert chat(server, "Say hello.").choices[0].finish_reason in ("stop", "length")
    thread.join(TIMEOUT_S + SLACK_S + 40)
    assert failure, "the hanging rendering never ended"
    error, elapsed = failure[0]
    assert isinstance(error, openai.BadRequestError), error
    assert f"exceeded its time limit of {TIMEOUT_S} s" in error.message
    assert elapsed < TIMEOUT_S + SLACK_S
    assert server.get("/health").status_code == 200
    assert chat(server, "Say hello again.").choices[0].finish_reason in ("stop", "length")


def test_a_schema_past_its_time_limit_gets_400_while_other_requests_are_served(server):
    """llguidance's check of an `allOf` of 22 patterns takes minutes (each pattern doubles it)."""
    schema = {"type": "string", "allOf": [{"pattern": f".*{chr(97 + i)}.*"} for i in range(22)]}
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    answers = []

    def send():
        started = time.monotonic()
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S + SLACK_S + 30)
        answers.append((answer, time.monotonic() - started))

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.5)  # the check holds one sandbox process now
    assert chat(server, "Say hello.").choices[0].finish_reason in ("stop", "length")
    thread.join(TIMEOUT_S + SLACK_S + 40)
    answer, elapsed = answers[0]
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert f"checking the grammar exceeded its time limit of {TIMEOUT_S} s" in error["message"]
    assert elapsed < TIMEOUT_S + SLACK_S
    send()  # the same schema again: refused from what the sandbox remembers, without a check
    answer, elapsed = answers[1]
    assert answer.status_code == 400 and elapsed < 1.0, (answer.text, elapsed)


def test_a_template_past_its_memory_limit_gets_400_and_the_server_stays_small(server):
    with pytest.raises(openai.BadRequestError, match="exceeded its memory limit"):
        chat(server, "grow")
    status = open(f"/proc/{server.proc.pid}/status").read()
    peak_kib = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
    assert peak_kib < 1024 * 1024, f"the HTTP process peaked at {peak_kib} KiB"
    assert chat(server, "Say hello.").choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow  # a server of its own
def test_sigterm_does_not_wait_for_a_hanging_template(tiny_pair, tmp_path):
    target = with_template(tiny_pair[0], tmp_path / "target", TRIGGERED)
    srv = Server(target, tiny_pair[1], tmp_path / "server.log", "--chat-template-timeout", "600")
    try:
        threading.Thread(target=lambda: httpx.post(
            srv.url + "/v1/chat/completions", timeout=60,
            json={"model": "x", "messages": [{"role": "user", "content": "hang"}]}), daemon=True).start()
        time.sleep(1.0)
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)
        assert time.monotonic() - started < 15
    finally:
        srv.stop()


def start_refused(tmp_path, target, *flags):
    """Run a server whose chat template is to be refused: its exit code, its output, and what
    /health answered meanwhile."""
    srv = FlashtreeServer(tmp_path / "refused.log", "--target", str(target), "--mode", "ar", *flags,
                          max_ctx=256, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    answers, deadline = [], time.monotonic() + 120
    try:
        while srv.alive and time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
                answers.append((r.status_code, r.json()))
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return srv.proc.poll(), srv.log(), answers
    finally:
        srv.stop()


@pytest.mark.slow  # a server of its own
def test_a_template_past_its_time_limit_at_start_up_is_refused(tiny_pair, tmp_path):
    target = with_template(tiny_pair[0], tmp_path / "target", RANGE_BOMB)
    code, log, answers = start_refused(tmp_path, target, "--chat-template-timeout", "1")
    assert code == 1, log
    assert (f"flashtree serve: the chat template from {target / 'tokenizer_config.json'} (chat_template) "
            "cannot be served: the chat template exceeded its time limit of 1 s") in log
    assert all(status == 503 for status, _ in answers), answers
    checking = [body for _, body in answers if body["status"] == "loading"
                and "checking its chat template" in body["error"]["message"]]
    assert checking, answers


@pytest.mark.slow  # a server of its own
def test_a_gguf_whose_template_allocates_past_the_memory_limit_is_refused(tmp_path):
    hf = with_template(make_target(tmp_path / "made", layers=2, hidden=64), tmp_path / "hf", STRING_BOMB)
    convert(hf, tmp_path / "model.gguf")
    code, log, _ = start_refused(tmp_path, tmp_path / "model.gguf")
    assert code == 1, log
    assert (f"the chat template from {tmp_path / 'model.gguf'} (metadata tokenizer.chat_template) cannot be "
            "served: the chat template exceeded its memory limit") in log


@pytest.fixture(scope="module")
def template_tokenizer(tiny_pair):
    """The tiny model's tokenizer with another chat template, read from test.jinja."""
    base = load_tokenizer(tiny_pair[0])
    return lambda template: replace(base, chat_template=template, chat_template_source="test.jinja")


def test_the_start_up_check_refuses_a_broken_template_but_keeps_one_without_tools(template_tokenizer, caplog):
    sandbox = TemplateSandbox(RenderLimits.for_server(ServerConfig()))
    try:
        with pytest.raises(ChatTemplateError, match=r"from test\.jinja cannot be served: .*does not compile"):
            check_template(template_tokenizer("{% if %}"), sandbox, 4096)
        no_tools = "{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}" + CHAT_TEMPLATE
        check_template(template_tokenizer(no_tools), sandbox, 4096)
        assert "cannot render tools (tools are not supported)" in caplog.text
        # a rendering without the message: every chat request would get the same prompt
        for constant in ("<|im_start|>user\nHello<|im_end|>\n", "{% for m in messages %}{{ m.text }}{% endfor %}"):
            with pytest.raises(ChatTemplateError, match=r"from test\.jinja cannot be served: it renders a one-message "
                                                        r"conversation without the message's text"):
                check_template(template_tokenizer(constant), sandbox, 4096)
        # another model's markup, which this tokenizer would read as plain text
        foreign = CHAT_TEMPLATE.replace("<|im_start|>", "<|turn_start|>")
        with pytest.raises(ChatTemplateError, match=r"from test\.jinja cannot be served: it writes <\|turn_start\|>, "
                                                    r"which the tokenizer has no token for"):
            check_template(template_tokenizer(foreign), sandbox, 4096)
        # a preamble that fills the context: every chat request would be refused as too long
        padded = template_tokenizer("{{ 'spam ' * 1000 }}" + CHAT_TEMPLATE)
        check_template(padded, sandbox, 16384)
        with pytest.raises(ChatTemplateError, match=r"from test\.jinja cannot be served: it renders a "
                           r"one-message conversation to (at least )?\d+ tokens, .*4096-token context"):
            check_template(padded, sandbox, 4096)
    finally:
        sandbox.close()
