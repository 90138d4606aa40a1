"""Target architectures are found in one table (models/registry.py): by config.json model_type and
by GGUF general.architecture, each name served by one entry, other names refused with the
supported ones; and each entry's StateShape is what its model's new_cache allocates, which the
memory plan counts before anything is allocated."""

from pathlib import Path

import pytest
import torch

from flashtree.checkpoint.presets import target_config
from flashtree.errors import CheckpointError
from flashtree.models.loader import target_config as parse
from flashtree.models.registry import ARCHITECTURES, architecture_of, by_gguf, by_model_type


def test_each_name_is_served_by_one_architecture():
    types = [t for a in ARCHITECTURES for t in a.model_types]
    names = [n for a in ARCHITECTURES for n in a.gguf_names]
    assert len(types) == len(set(types)) and len(names) == len(set(names))
    for arch in ARCHITECTURES:
        assert all(by_model_type(t) is arch for t in arch.model_types)
        assert all(by_gguf(n, Path("m.gguf")) is arch for n in arch.gguf_names)


def test_other_names_are_refused_with_the_supported_ones():
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'; supported: qwen3, llama, qwen3_5_text"):
        by_model_type("gpt2")
    with pytest.raises(CheckpointError, match="m.gguf: general.architecture: unsupported GGUF architecture 'gpt2'; "
                                              "supported: qwen3, llama, qwen35"):
        by_gguf("gpt2", Path("m.gguf"))


def test_qwen38_flash_next_is_refused_saying_what_it_adds():
    """Qwen3.8-Flash-Next is transformers' Qwen4Exp (GGUF `qwen4exp`), not Qwen3.5's architecture
    as Qwen3.8's 27B and 2.4T-A95B are: refused by name, with what flashtree does not run."""
    with pytest.raises(CheckpointError, match="model_type 'qwen4_exp' is not supported: it is Qwen3.8-Flash-Next "
                                              r"\(Qwen4Exp\), whose hyper-connection .*; supported: qwen3, "):
        by_model_type("qwen4_exp")
    with pytest.raises(CheckpointError, match="m.gguf: general.architecture: GGUF architecture 'qwen4exp' is not "
                                              "supported: it is Qwen3.8-Flash-Next .*; supported: qwen3, llama, qwen35"):
        by_gguf("qwen4exp", Path("m.gguf"))


@pytest.mark.parametrize("preset", ["qwen3-1.7b", "llama3.1-8b", "qwen3.5-4b"])
def test_a_state_shape_is_what_new_cache_allocates(preset):
    lm = parse(target_config(preset))
    arch = architecture_of(lm)
    shape = arch.shape(lm)
    with torch.device("meta"):
        state = arch.model(lm, 16).new_cache(16, torch.bfloat16, "meta", 4)
    assert getattr(state, "kv", state).k.shape[0] == shape.attention_layers
    assert arch.recurrent == bool(state.states())
    if arch.recurrent:
        assert state.ssm.shape[0] == state.conv.shape[0] == shape.recurrent_layers
        assert state.ssm[0].numel() == shape.state_floats and state.conv[0].numel() == shape.window_values
        node = [state.node_k, state.node_v, state.node_g, state.node_beta]
        assert sum(t[0, 0].numel() for t in node) == shape.node_floats
