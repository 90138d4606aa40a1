"""`flashtree train average`: two checkpoints of one model mixed weight by weight, the second's
config and tokenizer kept, anything that does not match refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtree.cli import main
from flashtree.train.average import average_checkpoints


def checkpoint(root: Path, seed: int, shapes: dict[str, tuple[int, ...]]) -> Path:
    g = torch.Generator().manual_seed(seed)
    root.mkdir()
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()},
              str(root / "model-00001-of-00001.safetensors"))
    (root / "config.json").write_text(json.dumps({"seed": seed}))
    return root


SHAPES = {"embed.weight": (64, 64), "layers.0.mlp.weight": (8, 8), "norm.weight": (8,)}


def test_the_average_mixes_every_tensor_and_keeps_the_seconds_files(tmp_path, capsys):
    a, b = checkpoint(tmp_path / "a", 1, SHAPES), checkpoint(tmp_path / "b", 2, SHAPES)
    out = tmp_path / "mix"
    assert main(["train", "average", "--first", str(a), "--second", str(b), "--weight", "0.3", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 3
    ta, tb = load_file(a / "model-00001-of-00001.safetensors"), load_file(b / "model-00001-of-00001.safetensors")
    mixed = load_file(out / "model-00001-of-00001.safetensors")
    for key in SHAPES:
        assert mixed[key].dtype == torch.bfloat16
        # this formula, not torch.lerp's (which rounds 10 of the 4,096 embedding values otherwise):
        # the one the shipped target was made with, so the documented command remakes it exactly
        want = (ta[key].float() * (1 - 0.3) + tb[key].float() * 0.3).to(torch.bfloat16)
        torch.testing.assert_close(mixed[key], want, rtol=0, atol=0)
        assert not torch.equal(mixed[key], ta[key]) and not torch.equal(mixed[key], tb[key])
    assert json.loads((out / "config.json").read_text()) == {"seed": 2}


def test_checkpoints_that_differ_or_an_existing_output_are_refused(tmp_path):
    a = checkpoint(tmp_path / "a", 1, SHAPES)
    wider = checkpoint(tmp_path / "wider", 2, {**SHAPES, "norm.weight": (9,)})
    other = checkpoint(tmp_path / "other", 3, {"embed.weight": (64, 64)})
    with pytest.raises(ValueError, match="norm.weight"):
        average_checkpoints(a, wider, tmp_path / "o1")
    with pytest.raises(ValueError, match="different tensors"):
        average_checkpoints(a, other, tmp_path / "o2")
    with pytest.raises(FileExistsError):
        average_checkpoints(a, a, wider)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()  # nothing half-written
    with pytest.raises(ValueError, match="weight"):
        average_checkpoints(a, a, tmp_path / "o3", weight=1.5)
