"""The server outlives what happens to a request or to the engine: client disconnects and stop
strings cancel the engine without leaking tokens into the next request, a SIGKILLed worker
costs only the request it was running, and a crowd of clients beyond --max-queue gets 429s
instead of hangs."""

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from serve_harness import module_server

PROBE = [{"role": "user", "content": "Say hello."}]  # reference request, compared across events
LONG = [{"role": "user", "content": "hi"}]
LONG_TOKENS = 900
NO_EOS = {"ignore_eos": True}  # long requests really run to max_tokens, whatever the random weights say


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, "--max-queue", "4")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def fresh_probe(client):
    """The probe's output on the fresh server, before anything else ran."""
    return probe(client)


def probe(client):
    r = client.chat.completions.create(model="x", messages=PROBE, max_tokens=24, temperature=0)
    return r.choices[0].message.content


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_client_disconnect_cancels_and_leaves_nothing_behind(server, client, fresh_probe):
    before = server.metric("flashtree_completion_tokens_total")
    stream = client.chat.completions.create(model="x", messages=LONG, max_tokens=LONG_TOKENS,
                                            temperature=0, stream=True, extra_body=NO_EOS)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_for(lambda: server.metric("flashtree_requests_running") == 0)
    generated = server.metric("flashtree_completion_tokens_total") - before
    assert generated < LONG_TOKENS, "the engine kept generating for a client that had left"
    assert probe(client) == fresh_probe


def test_client_gone_while_waiting_is_noticed(server, client, fresh_probe):
    """A non-streaming client that gives up (queued behind another request, or mid-generation)
    is answered 499 at once and its generation dropped, not run to the end for nobody."""
    running = client.chat.completions.create(model="x", messages=LONG, max_tokens=LONG_TOKENS,
                                             temperature=0, stream=True, extra_body=NO_EOS)
    next(iter(running))
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=0.5, json={
            "messages": LONG, "max_tokens": LONG_TOKENS, "temperature": 0, **NO_EOS})
    wait_for(lambda: server.metric("flashtree_requests_total",
                            endpoint="/v1/chat/completions", status="499") >= 1)
    running.close()
    wait_for(lambda: server.metric("flashtree_requests_running") == 0)
    assert server.metric("flashtree_queue_depth") == 0
    assert probe(client) == fresh_probe


def test_stop_string_cancels_and_leaves_nothing_behind(server, client, fresh_probe):
    text = client.chat.completions.create(model="x", messages=LONG, max_tokens=30, temperature=0,
                                          extra_body=NO_EOS).choices[0].message.content
    stop = text[8:11]
    before = server.metric("flashtree_completion_tokens_total")
    r = client.chat.completions.create(model="x", messages=LONG, max_tokens=LONG_TOKENS,
                                       temperature=0, stop=[stop], stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].delta.content or "" for c in r) == text[:text.index(stop)]
    assert server.metric("flashtree_completion_tokens_total") - before < LONG_TOKENS
    assert probe(client) == fresh_probe


def _kill_worker_when_running(server):
    pid = server.get("/health").json()["worker_pid"]
    wait_for(lambda: server.metric("flashtree_requests_running") == 1)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_worker_killed_mid_request_gets_503_then_recovers(server, client, fresh_probe):
    outcome = {}

    def request():
        try:
            client.chat.completions.create(model="x", messages=LONG, max_tokens=LONG_TOKENS, temperature=0,
                                           extra_body=NO_EOS)
            outcome["status"] = 200
        except openai.APIStatusError as e:
            outcome["status"], outcome["body"] = e.status_code, e.body

    thread = threading.Thread(target=request)
    thread.start()
    old_pid = _kill_worker_when_running(server)
    thread.join(60)
    assert outcome["status"] == 503
    assert outcome["body"]["code"] == "engine_restarting"
    health = server.wait_healthy(60)
    assert health["worker_pid"] != old_pid
    assert probe(client) == fresh_probe
    assert server.metric("flashtree_worker_restarts_total") >= 1


def test_worker_killed_mid_stream_sends_an_error_event(server, client, fresh_probe):
    stream = client.chat.completions.create(model="x", messages=LONG, max_tokens=LONG_TOKENS,
                                            temperature=0, stream=True, extra_body=NO_EOS)
    with pytest.raises(openai.APIError, match="restarting"):
        for i, _ in enumerate(stream):
            if i == 2:
                _kill_worker_when_running(server)
    server.wait_healthy(60)
    assert probe(client) == fresh_probe


@pytest.mark.slow  # the chat stream's case above is the fast suite's
def test_worker_killed_mid_responses_stream_fails_the_response(server, client, fresh_probe):
    events = []
    for event in client.responses.create(model="x", input="hi", max_output_tokens=LONG_TOKENS,
                                         temperature=0, stream=True, extra_body=NO_EOS):
        events.append(event)
        if len(events) == 5:
            _kill_worker_when_running(server)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"
    assert events[-1].response.error.code == "engine_restarting"
    server.wait_healthy(60)
    assert probe(client) == fresh_probe


def test_crowd_beyond_the_queue_gets_429_not_hangs(server, client, fresh_probe):
    clients = 20
    barrier = threading.Barrier(clients)
    results = [None] * clients

    def one(i):
        barrier.wait()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 48, "temperature": 0})
        results[i] = r

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(r is not None for r in results), "a client hung"
    served = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert len(served) + len(refused) == clients, [r.status_code for r in results]
    assert len(served) >= 5  # the running request and a full queue of 4 are always served
    for r in served:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    for r in refused:
        assert r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    assert server.get("/health").status_code == 200
    assert probe(client) == fresh_probe
