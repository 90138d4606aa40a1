"""Loading real-format checkpoints (local, sharded, HF cache), refusing bad ones with a clear
message, and the `flashtree generate` CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from flashtree import Engine
from flashtree.errors import CheckpointError, ContextLengthError
from tiny_models import make_draft, make_target


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(tiny_pair, tmp_path):
    target, draft = tiny_pair
    sharded = copy_dir(target, tmp_path / "sharded")
    state = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    keys = sorted(state)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(sharded / name))
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = Engine.from_pretrained(str(target), mode="ar").generate([1, 2, 3], max_tokens=8, stop_token_ids=[])
    b = Engine.from_pretrained(str(sharded), mode="ar").generate([1, 2, 3], max_tokens=8, stop_token_ids=[])
    assert a.token_ids == b.token_ids


def test_hf_cache_repo_id_loads_offline(tiny_pair, tmp_path, monkeypatch):
    """The engine passes `offline` to the resolver (tests/test_resolve.py covers the resolver)."""
    from huggingface_hub import constants

    target, _ = tiny_pair
    repo = tmp_path / "hub" / "models--acme--tiny"
    copy_dir(target, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    # huggingface_hub read HF_HUB_CACHE when this process imported it; point it at the fake cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    eng = Engine.from_pretrained("acme/tiny", mode="ar", offline=True)
    assert eng.model_dir.name == "abc123"
    with pytest.raises(CheckpointError, match="acme/absent is not .* in the local HF cache"):
        Engine.from_pretrained("acme/absent", mode="ar", offline=True)


def test_missing_and_bad_files_are_named(tiny_pair, tmp_path):
    target, _ = tiny_pair
    broken = copy_dir(target, tmp_path / "broken")
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Engine.from_pretrained(str(broken), mode="ar")
    broken2 = copy_dir(target, tmp_path / "broken2")
    (broken2 / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        Engine.from_pretrained(str(broken2), mode="ar")
    broken3 = copy_dir(target, tmp_path / "broken3")
    cfg = json.loads((broken3 / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (broken3 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="supported: qwen3, llama"):
        Engine.from_pretrained(str(broken3), mode="ar")
    broken4 = copy_dir(target, tmp_path / "broken4")
    (broken4 / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Engine.from_pretrained(str(broken4), mode="ar")
    broken5 = copy_dir(target, tmp_path / "broken5")
    state = load_file(str(broken5 / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(broken5 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj"):
        Engine.from_pretrained(str(broken5), mode="ar")


def test_draft_of_another_width_is_refused(tiny_pair, tmp_path):
    other = make_target(tmp_path / "wide", hidden=96)
    draft = make_draft(tmp_path / "d", other)
    with pytest.raises(CheckpointError, match="hidden_size 96 != target's 64"):
        Engine.from_pretrained(str(tiny_pair[0]), str(draft))


@pytest.mark.parametrize("change,message", [
    ({"dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 9}}, "target_layer_ids"),
    ({"dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 100000}}, "mask_token_id"),
])
def test_draft_that_does_not_fit_is_refused(tiny_pair, tmp_path, change, message):
    target, _ = tiny_pair
    draft = make_draft(tmp_path / "d", target)
    cfg = json.loads((draft / "config.json").read_text())
    cfg.update(change)
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        Engine.from_pretrained(str(target), str(draft))


def test_prompt_too_long_names_both_numbers(tiny_pair):
    eng = Engine.from_pretrained(str(tiny_pair[0]), mode="ar", max_ctx=16)
    with pytest.raises(ContextLengthError, match="20 tokens.*16"):
        eng.stream(list(range(20)))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "flashtree.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # 13-15 s of CLI processes
def test_cli_generate_json_and_trace(tiny_pair):
    target, draft = tiny_pair
    r = run_cli("generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                "--max-tokens", "12", "--json", "--trace", "--budget", "4", "--block-size", "4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == out["stats"]["completion_tokens"] <= 12
    assert set(out["stats"]) >= {"prompt_tokens", "completion_tokens", "steps", "accept_lengths",
                                 "mean_accept_length", "prefill_s", "decode_s", "tokens_per_s", "step_s",
                                 "device_mallocs", "device_frees"}
    assert 0 < out["stats"]["step_s"] <= out["stats"]["decode_s"]
    assert len(out["trace"]) == out["stats"]["steps"]
    for step in out["trace"]:
        # a step with room for one token only (the last) verifies the root alone, undrafted
        assert len(step["draft_tokens"]) == (3 if len(step["tree_tokens"]) > 1 else 0)
        assert step["tree_parents"][0] == -1 and len(step["tree_tokens"]) <= 5
        assert step["accepted"][0] == 0
    ar = run_cli("generate", "--target", str(target), "--mode", "ar", "--prompt", "def add(a, b):",
                 "--max-tokens", "12", "--json")
    assert json.loads(ar.stdout)["token_ids"] == out["token_ids"]


@pytest.mark.slow  # several CLI processes: ~11 s
def test_cli_streams_text_and_reports_errors(tiny_pair, tmp_path):
    target, draft = tiny_pair
    r = run_cli("generate", "--target", str(target), "--draft", str(draft), "--prompt", "hello",
                "--chat", "--max-tokens", "8")
    assert r.returncode == 0 and "tokens, finish=" in r.stderr
    bad = run_cli("generate", "--target", str(tmp_path / "nope"), "--prompt", "x")
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1, 2, 3]))
    r = run_cli("generate", "--target", str(target), "--prompt-ids", str(ids), "--max-tokens", "3", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["stats"]["prompt_tokens"] == 3
    for bad in ('{"a": 1}', "[true, 5]"):  # a boolean is no token id, though Python counts it an int
        ids.write_text(bad)
        r = run_cli("generate", "--target", str(target), "--prompt-ids", str(ids))
        assert r.returncode == 2 and "list of integers" in r.stderr


def test_generate_chat_bounds_the_rendering_and_names_the_template(tiny_pair, tmp_path):
    """A template that renders megabytes is refused once the prompt is known too long, without
    encoding it all; one that raises names the file it came from."""
    from argparse import Namespace
    from flashtree.checkpoint import ChatTemplateError
    from flashtree.cli import _prompt_ids
    from flashtree.train.chat_template import CHAT_TEMPLATE
    target = copy_dir(tiny_pair[0], tmp_path / "target")
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    args = Namespace(prompt_ids=None, chat=True, prompt="hello", system=None)
    config_file.write_text(json.dumps(dict(config, chat_template="{{ 'spam ' * 1000000 }}" + CHAT_TEMPLATE)))
    engine = Engine.from_pretrained(str(target), mode="ar", max_ctx=256)
    with pytest.raises(ContextLengthError) as err:
        _prompt_ids(args, engine)
    assert err.value.at_least and err.value.max_ctx == 256
    config_file.write_text(json.dumps(dict(config, chat_template="{{ raise_exception('no system turns') }}")))
    engine = Engine.from_pretrained(str(target), mode="ar", max_ctx=256)
    with pytest.raises(ChatTemplateError, match=f"the chat template from {config_file} .*no system turns"):
        _prompt_ids(args, engine)


@pytest.mark.slow  # 5 s: fresh interpreters
def test_cli_bench_package_is_imported_only_when_its_subcommand_runs(tmp_path):
    probe = "import sys, flashtree.cli; print([m for m in sys.modules if m.startswith('flashtree.bench')])"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "usage: flashtree bench" in r.stdout and "--preset" in r.stdout
    markdown = tmp_path / "PERFORMANCE.md"  # re-rendering a saved run needs no GPU
    saved = Path(__file__).resolve().parents[1] / "benchmarks/results/smoke-qwen3-1.7b.json"
    r = run_cli("bench", "--from-json", str(saved), "--markdown", str(markdown))
    assert r.returncode == 0 and "<!-- bench:smoke-qwen3-1.7b start -->" in markdown.read_text(), r.stderr
    r = run_cli("bench", "--iters", "many")
    assert r.returncode == 2 and "flashtree bench: error" in r.stderr
    r = run_cli("generate", "--prompt", "x", "--no-such-flag")  # bench's pass-through is bench's alone
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr
