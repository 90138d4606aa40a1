"""The chat page and the decoder-view extension, without a browser (tests/test_web_browser.py
drives the page in one).

- `/`, `/dashboard` and `/web/<asset>` are served from the package with their content types and
  a same-origin Content-Security-Policy, without the API key; every API route stays guarded.
- The page's files name no other host: it works offline and leaks nothing. Nor does the server
  offer FastAPI's /docs and /redoc, which load theirs from a CDN; /openapi.json stays.
- `flashtree_trace` is an extension a standard client never sees: through the real `openai`
  client, the `flashtree` field is there only when the request asked for it (`extra_body`), and
  then it carries every decode step with a well-formed tree and the answer's numbers.
- A client that closes its stream cancels the generation in the engine, which /metrics counts.
"""

import re
import time

import httpx
import pytest

from flashtree.serve import webpage
from serve_harness import module_server

KEY = "web-test-key"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    yield from module_server(tiny_pair, tmp_path_factory, api_key=KEY)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_pages_and_assets_are_served_public_with_their_types(server):
    for path, kind in [("/", "text/html"), ("/dashboard", "text/html"), ("/web/chat.js", "text/javascript"),
                       ("/web/dashboard.js", "text/javascript"), ("/web/style.css", "text/css")]:
        r = httpx.get(server.url + path, timeout=30)  # no key: the page is public
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith(kind), path
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.head(server.url + "/", timeout=30).status_code == 200  # reachability probes
    for name in webpage.assets():
        assert httpx.get(f"{server.url}/web/{name}", timeout=30).status_code == 200, name
    for path in ("/web/missing.js", "/web/..%2Fwebpage.py", "/web/%2E%2E/app.py"):
        assert httpx.get(server.url + path, timeout=30).status_code == 404, path


def test_the_api_behind_the_page_keeps_its_key(server):
    for path in ("/v1/models", "/metrics", "/props"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
        assert server.get(path).status_code == 200, path


def test_the_page_names_no_other_host():
    """No http(s) URL, no protocol-relative `//host`, and every file a page or module loads is one
    the server serves."""
    served = set(webpage.assets())
    for name, path in webpage.assets().items():
        text = path.read_text()
        assert not re.search(r"https?://", text, re.I), name
        assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?//""", text, re.I), name
        for ref in re.findall(r"""(?:src|href)="(/web/[^"]+)\"""", text):
            assert ref.removeprefix("/web/") in served, (name, ref)
        for ref in re.findall(r"""from\s+"\./([^"]+)\"""", text):
            assert ref in served, (name, ref)


def test_no_interactive_api_docs_but_the_schema(server):
    """FastAPI's /docs and /redoc load their scripts from a CDN, a blank page offline: there are
    none (with the key, so a 404, not a 401), /openapi.json, which they read, is served, and
    every link of the pages goes to a route the server has."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert server.get(path).status_code == 404, path
    routes = set(server.get("/openapi.json").json()["paths"]) | webpage.public_paths()
    assert "/v1/chat/completions" in routes
    for name, path in webpage.assets().items():
        for ref in re.findall(r"""href="(/[^"]*)\"""", path.read_text()):
            assert ref in routes, (name, ref)


def _check_step(step):
    assert step["n"] >= 0 and isinstance(step["text"], str)
    tree = step["tree"]
    if tree is None:
        return
    tokens, parents, accepted = tree["tokens"], tree["parents"], tree["accepted"]
    assert len(tokens) == len(parents) and parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert accepted[0] == 0 and all(parents[b] == a for a, b in zip(accepted, accepted[1:]))  # a path from the root
    assert step["n"] <= len(accepted)  # the accepted nodes after the root, then the target's token


def test_trace_is_sent_only_when_asked_streaming(client):
    plain = list(client.chat.completions.create(model="x", messages=USER, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}))
    assert plain and all("flashtree" not in (chunk.model_extra or {}) for chunk in plain)

    chunks = list(client.chat.completions.create(model="x", messages=USER, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"flashtree_trace": True}))
    steps = [s for c in chunks for s in (c.model_extra or {}).get("flashtree", {}).get("steps", [])]
    stats = [c.model_extra["flashtree"]["stats"] for c in chunks if "stats" in (c.model_extra or {}).get("flashtree", {})]
    usage = chunks[-1].usage
    assert [s["i"] for s in steps] == list(range(len(steps)))
    assert steps[0]["tree"] is None and all(s["tree"] is not None for s in steps[1:])  # the first: the prefill's
    assert sum(s["n"] for s in steps) == usage.completion_tokens
    for step in steps:
        _check_step(step)
    assert len(stats) == 1 and stats[0]["completion_tokens"] == usage.completion_tokens
    assert {"tokens_per_s", "prefill_s", "cached_tokens", "mean_accept_length"} <= set(stats[0])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(s["text"] for s in steps).startswith(text[:8])


def test_trace_is_sent_only_when_asked_whole(client):
    plain = client.chat.completions.create(model="x", messages=USER, max_tokens=16)
    assert "flashtree" not in (plain.model_extra or {})
    traced = client.chat.completions.create(model="x", messages=USER, max_tokens=16,
                                            extra_body={"flashtree_trace": True})
    ext = traced.model_extra["flashtree"]
    assert sum(s["n"] for s in ext["steps"]) == traced.usage.completion_tokens == ext["stats"]["completion_tokens"]
    for step in ext["steps"]:
        _check_step(step)


def test_closing_the_stream_cancels_the_generation(server):
    before = server.metric("flashtree_generations_total", finish_reason="cancelled")
    body = {"messages": USER, "max_tokens": 100000, "ignore_eos": True, "stream": True, "flashtree_trace": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"steps"' in line:
                break  # decoding has begun: the client goes away
    deadline = time.monotonic() + 60
    while server.metric("flashtree_generations_total", finish_reason="cancelled") <= before:
        assert time.monotonic() < deadline, "the engine never cancelled the abandoned generation"
        time.sleep(0.2)
    assert server.client().chat.completions.create(model="x", messages=USER, max_tokens=4).choices  # still serving
