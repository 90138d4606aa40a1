"""Requests a fuzzer of the serving routes found answered without a clear refusal, each now a
4xx in its surface's error shape, after which the server still answers a normal request:

- a body that is not UTF-8 text (a Latin-1 byte) was a 400 saying only "There was an error
  parsing the body" (FastAPI's words); it now names the bad byte;
- a body sent with `Content-Encoding: gzip` was never decompressed: a real gzip body got the same
  bare parsing error, and a plain body that claimed gzip was served as if it had not; both are a
  415 naming the encoding.
"""

import gzip
import json

import pytest

from serve_harness import module_server

BODIES = {
    "/v1/chat/completions": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "x", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "x", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, max_ctx=256)


def error_of(response, status):
    """The error message of a refusal in either surface's shape (Anthropic's on /v1/messages)."""
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    if body.get("type") == "error":
        assert error["type"] == "invalid_request_error"
    else:
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] is None
    assert "Traceback" not in error["message"]
    return error["message"]


def plain(body):
    return json.dumps(body).encode()


def latin1(body):
    """The body with a string holding é as Latin-1's single byte 0xE9, not UTF-8."""
    return plain({**body, "user": "caf\u00e9"}).replace(b"\\u00e9", b"\xe9")


CASES = {
    "not utf-8": (latin1, {}, 400, "not UTF-8 text"),
    "gzip body": (lambda body: gzip.compress(plain(body)), {"content-encoding": "gzip"}, 415, "'gzip'"),
    "gzip claimed": (plain, {"content-encoding": "gzip"}, 415, "not supported"),
    "br claimed": (plain, {"content-encoding": "br"}, 415, "'br'"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("stream", [False, True])
def test_refused_with_a_clear_4xx(server, path, case, stream):
    encode, headers, status, words = CASES[case]
    body = {**BODIES[path], "stream": stream}
    message = error_of(server.post(path, content=encode(body), headers={**JSON, **headers}), status)
    assert words in message
    assert server.post(path, json=BODIES[path]).status_code == 200


def test_identity_encoding_is_served(server):
    r = server.post("/v1/chat/completions", content=plain(BODIES["/v1/chat/completions"]),
                    headers={**JSON, "content-encoding": "Identity"})
    assert r.status_code == 200, r.text
