"""Model references: local directories, .gguf files and HF repo ids through huggingface_hub's cache.

Nothing here touches the network: repo ids are resolved offline, against a fake HF cache in
tmp_path. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported, so those
cases run in a fresh interpreter with the environment a user would set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtree.checkpoint import resolve_model
from flashtree.errors import CheckpointError

REPO_ROOT = Path(__file__).resolve().parent.parent
RESOLVE = """
import sys
from flashtree.checkpoint import resolve_model
from flashtree.errors import CheckpointError
try:
    print(resolve_model(sys.argv[1], offline=sys.argv[2] == "offline"))
except CheckpointError as e:
    print("CheckpointError:", e)
"""


def fake_hf_cache(root: Path, repo_id: str, commit: str = "0123abcd") -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def hub_env(cache: Path, hub_offline: bool) -> dict[str, str]:
    """The environment of a user whose HF cache is `cache` (offline with `hub_offline`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_CACHE=str(cache), PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    if hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def resolve_fresh(ref: str, cache: Path, hub_offline: bool, flag: str = "") -> str:
    r = subprocess.run([sys.executable, "-c", RESOLVE, ref, flag], capture_output=True, text=True,
                       env=hub_env(cache, hub_offline), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_local_directory_and_gguf_file(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == gguf  # a target's or a draft's
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model(other)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(tmp_path / "missing")
    fifo = tmp_path / "piped.gguf"
    os.mkfifo(fifo)  # opening it would wait for a writer
    with pytest.raises(CheckpointError, match=f"{fifo} is neither a directory nor a regular file"):
        resolve_model(fifo)


def test_cached_repo_resolves_with_hf_hub_offline(tmp_path):
    snapshot = fake_hf_cache(tmp_path / "hub", "acme/tiny")
    assert resolve_fresh("acme/tiny", tmp_path / "hub", hub_offline=True) == str(snapshot)


def test_offline_flag_alone_reads_the_cache_only(tmp_path):
    snapshot = fake_hf_cache(tmp_path / "hub", "acme/tiny")
    assert resolve_fresh("acme/tiny", tmp_path / "hub", hub_offline=False, flag="offline") == str(snapshot)
    out = resolve_fresh("acme/absent", tmp_path / "hub", hub_offline=False, flag="offline")
    assert out.startswith("CheckpointError:") and "acme/absent" in out


def test_uncached_repo_offline_names_the_repo_and_how_to_fetch_it(tmp_path):
    fake_hf_cache(tmp_path / "hub", "acme/tiny")
    out = resolve_fresh("acme/absent", tmp_path / "hub", hub_offline=True)
    assert out.startswith("CheckpointError: model acme/absent is not (completely) in the local HF cache")
    assert str(tmp_path / "hub") in out
    assert "`hf download acme/absent`" in out and "HF_HUB_OFFLINE=1" in out


def test_plan_offline_asks_to_fetch_the_config_alone(tmp_path):
    """`flashtree plan` reads config.json and nothing else, so that is the download its offline
    error suggests (what loads the weights is told to fetch the model, above)."""
    fake_hf_cache(tmp_path / "hub", "acme/tiny")
    r = subprocess.run([sys.executable, "-m", "flashtree.cli", "plan", "--target", "acme/absent",
                        "--gpu-memory", "24G"], capture_output=True, text=True, timeout=120,
                       env=hub_env(tmp_path / "hub", hub_offline=True))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "`hf download acme/absent config.json`" in r.stderr


def test_a_config_only_resolve_downloads_config_json_alone(tmp_path, monkeypatch):
    import huggingface_hub

    asked = {}

    def snapshot_download(repo_id, allow_patterns, local_files_only):
        asked[repo_id] = allow_patterns
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("acme/tiny", config_only=True) == tmp_path
    assert resolve_model("acme/full") == tmp_path
    assert asked == {"acme/tiny": ["config.json"], "acme/full": ["*.json", "*.safetensors", "*.jinja"]}
