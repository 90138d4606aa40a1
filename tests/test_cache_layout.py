"""Disk-cache files whose checksum is valid but whose tensors do not fit the model:
rows cut short, a head cut, a tensor missing, another dtype, a tensor too many, for a
dense pair and for a hybrid with a quantized cache (scales, recurrent states, checkpoints). Each
file is re-signed after the damage, so only the layout check can tell; each must be deleted with
the tensor named in the warning, the request prefilled to the cold answer, and the cache usable
again. Also: any other failure while restoring drops the entry instead of failing every request,
and the live server answers such a file instead of 503 on every request."""

import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashtree import Engine
from flashtree.runtime import disk_tier
from serve_harness import Server
from tiny_models import make_draft, make_target

A = [5 + (i * 7) % 300 for i in range(90)]       # the conversation whose state is on disk
B = [6 + (i * 11) % 300 for i in range(80)]      # a diverging one: sends A's state to disk
ONLY_DISK = dict(prefix_cache_slots=0, host_cache_bytes=0)



@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A Qwen3.5-shaped hybrid with a head_dim of 32 (one quantization block) and its draft."""
    root = tmp_path_factory.mktemp("hybrid_layout")
    target = make_target(root / "target", arch="qwen3_5", layers=5, hidden=128)
    return target, make_draft(root / "draft", target, block_size=8, layers=1, target_layer_ids=[1, 3])


MODELS = {  # model fixture, engine options
    "dense": ("tiny_pair", dict(mode="ddtree", budget=8)),
    "hybrid": ("hybrid_pair", dict(mode="ddtree", budget=6, prefill_ubatch=32, kv_type="q8_0")),
}


def engine(pair, kind, cache_dir):
    target, draft = pair
    return Engine.from_pretrained(str(target), str(draft), device="cpu", max_ctx=512, max_sequences=1,
                                  cache_dir=str(cache_dir),
                                  **ONLY_DISK, **MODELS[kind][1])


def gen(eng, prompt):
    return eng.generate(prompt, max_tokens=12, stop_token_ids=[])


def write_genuine(pair, kind, cache_dir):
    """(A's snapshot file as the engine writes it, A's cold answer as ids and as text)."""
    eng = engine(pair, kind, cache_dir)
    cold = gen(eng, A).token_ids
    gen(eng, B)  # A's state goes straight to disk
    [path] = cache_dir.glob("*.safetensors")
    return path, cold, eng.tokenizer.decode(cold)


@pytest.fixture(scope="module")
def dense_file(tiny_pair, tmp_path_factory):
    return write_genuine(tiny_pair, "dense", tmp_path_factory.mktemp("dense_cache"))


@pytest.fixture(scope="module")
def hybrid_file(hybrid_pair, tmp_path_factory):
    return write_genuine(hybrid_pair, "hybrid", tmp_path_factory.mktemp("hybrid_cache"))


def resign(path, tamper):
    """Apply `tamper` to the file's tensors and write it back with a valid checksum of the result,
    as a writer of another layout (or a hostile one) would. Returns what `tamper` returns."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    why = tamper(tensors)
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    meta.pop("checksum")
    meta["checksum"] = disk_tier.checksum(meta, tensors)
    save_file(tensors, str(path), metadata=meta)
    return why


def shape_of(t):
    return f"{t.dtype} {list(t.shape)}"


def changed(tensors, name, new):
    """Replace one tensor; the reason the check must give."""
    old, tensors[name] = tensors[name], new
    return f"tensor {name}: expected {shape_of(old)}, found {shape_of(new)}"


def cut_rows(tensors):
    """Every cache's rows cut short alike (scales too): fewer rows than the snapshot's tokens."""
    reasons = {name: changed(tensors, name, tensors[name][:, :50]) for name in list(tensors) if name[0] in "td"}
    return reasons["tk"]  # the target's keys are checked first


def missing(name):
    def tamper(tensors):
        return f"tensor {name} is missing (expected {shape_of(tensors.pop(name))})"
    return tamper


def extra(tensors):
    tensors["junk"] = torch.zeros(3)
    return "unexpected tensors junk"


def checkpoint_at_zero(tensors):
    """A checkpoint at length 0: `load` would take it as the state of an empty sequence."""
    tensors.update({"conv@0": torch.ones_like(tensors["conv"]), "ssm@0": torch.ones_like(tensors["ssm"])})
    return "unexpected tensors conv@0, ssm@0"


DAMAGE = {
    "dense": {
        "rows cut": cut_rows,
        "head_dim cut": lambda t: changed(t, "tk", t["tk"][..., :8]),
        "tensor missing": missing("dv"),
        "wrong dtype": lambda t: changed(t, "tv", t["tv"].double()),
        "unexpected tensor": extra,
    },
    "hybrid": {  # A's 90 tokens restore from the checkpoint at 89
        "rows cut": cut_rows,
        "scale missing": missing("tk_scale"),
        "checkpoint head cut": lambda t: changed(t, "ssm@89", t["ssm@89"][..., :1]),  # copy_ would broadcast it
        "checkpoint state missing": missing("conv@89"),  # load would start from zeros
        "wrong dtype": lambda t: changed(t, "ssm@89", t["ssm@89"].double()),
        "unexpected tensor": checkpoint_at_zero,
    },
}
CASES = [(kind, damage) for kind in MODELS for damage in DAMAGE[kind]]


@pytest.mark.parametrize("kind,damage", CASES)
def test_a_signed_file_of_the_wrong_layout_is_deleted_and_prefilled_right(request, kind, damage, tmp_path, caplog):
    genuine, cold, _ = request.getfixturevalue(f"{kind}_file")
    path = tmp_path / genuine.name
    shutil.copy(genuine, path)
    why = resign(path, DAMAGE[kind][damage])
    eng = engine(request.getfixturevalue(MODELS[kind][0]), kind, tmp_path)  # a restart finds the file
    assert [e.tier for e in eng.cache.entries] == ["disk"]
    with caplog.at_level(logging.WARNING, logger="flashtree"):
        res = gen(eng, A)
    assert res.token_ids == cold and res.stats.cached_tokens == 0
    assert not path.exists() and eng.cache.entries == []
    assert f"deleting cache file {path}: its tensors do not fit this model's state layout: {why}" in caplog.text
    gen(eng, B)  # A's state is saved again, from its prefill, and that file is restored
    again = gen(eng, A)
    assert again.token_ids == cold and again.stats.cached_tokens == len(A) - 1
    assert eng.cache.stats()["disk"]["hits"] == 1


def test_any_other_failure_while_restoring_drops_the_entry(tiny_pair, dense_file, tmp_path, caplog, monkeypatch):
    """A restore that raises something other than an OOM (here injected into the state's load,
    after the file passed every check) costs the entry and its file, not this request and every
    later one sharing the prefix."""
    genuine, cold, _ = dense_file
    path = tmp_path / genuine.name
    shutil.copy(genuine, path)
    eng = engine(tiny_pair, "dense", tmp_path)
    load = eng.state.load

    def fails_half_way(tokens, tensors, held=None):
        load(tokens, tensors, held)
        raise ValueError("injected restore failure")

    monkeypatch.setattr(eng.state, "load", fails_half_way)
    res = gen(eng, A)
    assert res.token_ids == cold and res.stats.cached_tokens == 0
    assert not path.exists() and eng.cache.entries == []
    assert "restoring it failed (ValueError: injected restore failure)" in caplog.text
    again = gen(eng, A)
    assert again.token_ids == cold and again.stats.cached_tokens == len(A) - 1


def test_the_server_answers_a_prefix_whose_file_lacks_a_tensor(tiny_pair, dense_file, tmp_path):
    """Before the check every request with the prefix was a 503, across restarts."""
    genuine, _, cold_text = dense_file
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    path = cache_dir / genuine.name
    shutil.copy(genuine, path)
    resign(path, missing("dv"))
    srv = Server(*tiny_pair, tmp_path / "server.log", "--cache-dir", str(cache_dir),
                 "--prefix-cache-slots", "0", "--host-cache-bytes", "0")
    try:
        assert srv.metric("flashtree_prefix_cache_entries", tier="disk") == 1  # found at the start
        for cached in (0, len(A) - 1):  # prefilled, then the next request reuses the live state
            r = srv.post("/v1/completions", json={"model": "x", "prompt": A, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            assert body["choices"][0]["text"] == cold_text
        assert not path.exists()
    finally:
        srv.stop()
    assert "tensor dv is missing" in (tmp_path / "server.log").read_text()
