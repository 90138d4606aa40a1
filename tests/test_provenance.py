"""A benchmark result names the code it came from (flashtree/bench/provenance.py): the commit as
told or as .git has it, a digest of the package's sources that changes with any of them, and the
card it ran on as its file name carries it."""

from pathlib import Path

import pytest

from flashtree.bench.provenance import PACKAGE, commit, device_slug, provenance, source_digest


def test_the_digest_follows_the_sources_and_nothing_else(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    first = source_digest(pkg)
    (pkg / "notes.txt").write_text("changed, still not code")
    assert source_digest(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert source_digest(pkg) != first
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    assert source_digest(pkg) == first
    (pkg / "sub" / "b.py").rename(pkg / "b.py")  # same bytes, another path: other code
    assert source_digest(pkg) != first


def test_the_commit_is_the_one_told_else_the_checkouts(tmp_path, monkeypatch):
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("1" * 40 + "\n")
    monkeypatch.delenv("FLASHTREE_COMMIT", raising=False)
    assert commit(tmp_path) == "1" * 40
    (git / "refs" / "heads" / "main").unlink()  # packed by git gc
    (git / "packed-refs").write_text(f"# pack-refs\n{'2' * 40} refs/heads/main\n")
    assert commit(tmp_path) == "2" * 40
    (git / "HEAD").write_text("3" * 40 + "\n")  # detached
    assert commit(tmp_path) == "3" * 40
    assert commit(tmp_path / "elsewhere") == "unknown"
    monkeypatch.setenv("FLASHTREE_COMMIT", "abc1234")  # a stale copy's .git loses to what the run was told
    assert commit(tmp_path) == "abc1234"
    assert provenance() == {"commit": "abc1234", "source_digest": source_digest(PACKAGE)}
    assert PACKAGE == Path(__file__).resolve().parents[1] / "flashtree"


@pytest.mark.parametrize("name,slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"), ("NVIDIA", "gpu")])
def test_a_result_file_names_the_card_by_its_model(name, slug):
    """The model, not its memory size or type: an H100's results were once named after "HBM3"."""
    assert device_slug(name) == slug
