"""Hostile checkpoint files (JSON, shard index, safetensors, tokenizer settings, chat template) are
refused with one line naming the file and what is wrong: never a traceback, a file read from
outside the model directory, a read without end, or a weight silently replaced."""

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from flashtree.checkpoint import ChatTemplateError, load_tokenizer, read_json, read_optional_json
from flashtree.checkpoint.chat_template import ChatTemplateLimit, render_template
from flashtree.checkpoint.files import SMALL_FILE_LIMIT
from flashtree.checkpoint.weights import build_module, read_state_dict, tensor_names, weight_files
from flashtree.cli import _render_chat
from flashtree.errors import CheckpointError

ASSET = Path(__file__).parent.parent / "flashtree" / "assets" / "target"
INDEX = "model.safetensors.index.json"


def write(path: Path, value) -> Path:
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


# --- JSON files (read_json) -------------------------------------------------------------------

def test_a_json_file_that_is_not_a_regular_file_is_refused(tmp_path):
    os.symlink("/dev/zero", tmp_path / "config.json")  # read without a cap: memory until the OOM killer
    with pytest.raises(CheckpointError, match="config.json: not a regular file"):
        read_json(tmp_path / "config.json")
    os.mkfifo(tmp_path / "generation_config.json")  # opened blocking: waits for a writer forever
    with pytest.raises(CheckpointError, match="generation_config.json: not a regular file"):
        read_optional_json(tmp_path / "generation_config.json")
    os.symlink(tmp_path / "absent", tmp_path / "tokenizer_config.json")  # present, yet no file: not "left out"
    with pytest.raises(CheckpointError, match="missing file .*tokenizer_config.json"):
        read_optional_json(tmp_path / "tokenizer_config.json")
    assert read_optional_json(tmp_path / "absent.json") is None
    os.mkdir(tmp_path / "tokenizer.json")  # a directory: Python's own open refuses it with a traceback
    with pytest.raises(CheckpointError, match="tokenizer.json: not a regular file"):
        read_json(tmp_path / "tokenizer.json")


def test_a_json_file_holding_an_integer_past_int_digits_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: .*4300 digits"):
        read_json(write(tmp_path / "config.json", '{"junk": 1' + "0" * 5000 + "}"))


def test_an_oversized_json_file_is_refused_without_reading_it_whole(tmp_path):
    with open(tmp_path / "config.json", "wb") as f:
        f.truncate(SMALL_FILE_LIMIT + 1)  # sparse: costs no disk
    with pytest.raises(CheckpointError, match="config.json: larger than its limit of 32 MiB"):
        read_json(tmp_path / "config.json")


@pytest.mark.parametrize("text,found", [("[1, 2, 3]", "an array"), ("null", "null"), ('"x"', "a string"),
                                        ("5", "a number"), ("true", "a boolean")])
def test_a_json_file_that_is_not_an_object_is_refused(tmp_path, text, found):
    with pytest.raises(CheckpointError, match=f"config.json: expected a JSON object, found {found}$"):
        read_json(write(tmp_path / "config.json", text))


def test_json_nested_past_the_recursion_limit_is_refused(tmp_path):
    deep = write(tmp_path / "config.json", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="cannot read .*config.json: nested too deeply"):
        read_json(deep)


# --- the shard index and safetensors files (weights.py) ---------------------------------------

def shard(path: Path, **tensors) -> Path:
    save_file({k: torch.full((2,), float(v)) for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("name", ["../out/evil.safetensors", "/etc/passwd", "../../../../etc/passwd",
                                  "sub/../../evil.safetensors", ".."])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tmp_path, name):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "out").mkdir()
    shard(tmp_path / "out" / "evil.safetensors", a=1)
    shard(model / "a.safetensors", b=2)
    write(model / INDEX, {"weight_map": {"a": name, "b": "a.safetensors"}})
    for read in (weight_files, tensor_names, lambda d: read_state_dict(d, torch.float32, torch.device("cpu"))):
        with pytest.raises(CheckpointError, match=f"names shard '{name}' outside {model}$"):
            read(model)


def test_an_index_may_name_shards_in_subfolders_of_the_model_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    shard(tmp_path / "sub" / "b.safetensors", b=2)
    shard(tmp_path / "a.safetensors", a=1)
    write(tmp_path / INDEX, {"weight_map": {"a": "./x/../a.safetensors", "b": "sub/b.safetensors"}})
    state = read_state_dict(tmp_path, torch.float32, torch.device("cpu"))
    assert {k: v[0].item() for k, v in state.items()} == {"a": 1.0, "b": 2.0}


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_weights_that_are_no_regular_file_are_refused_without_reading(tmp_path, kind):
    """A FIFO would block the load forever waiting for a writer."""
    weights = tmp_path / "model.safetensors"
    {"fifo": os.mkfifo, "directory": os.mkdir, "device": lambda p: os.symlink("/dev/zero", p)}[kind](weights)
    for read in (weight_files, load_all):
        with pytest.raises(CheckpointError, match=f"cannot read weights {weights}: not a regular file"):
            read(tmp_path)


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    """The shard is not the one the index was written with (a weight would go missing)."""
    shard(tmp_path / "a.safetensors", a=1)
    write(tmp_path / INDEX, {"weight_map": {"a": "a.safetensors", "lm_head.weight": "a.safetensors"}})
    with pytest.raises(CheckpointError, match=f"{INDEX} maps 1 tensor\\(s\\) to shards that do not hold them "
                                              r"\(e\.g\. lm_head\.weight to .*a\.safetensors\)"):
        load_all(tmp_path)


@pytest.mark.parametrize("index", [{"weight_map": []}, {"weight_map": "a.safetensors"},
                                   {"weight_map": {"a": 1}}, {"weight_map": {"a": None}}, {}])
def test_a_malformed_weight_map_is_refused(tmp_path, index):
    shard(tmp_path / "a.safetensors", a=1)
    write(tmp_path / INDEX, index)
    for read in (weight_files, tensor_names):
        with pytest.raises(CheckpointError, match=f"{INDEX}: weight_map must map tensor names to file names"):
            read(tmp_path)


def test_an_index_that_is_not_a_json_object_in_a_file_is_refused(tmp_path):
    shard(tmp_path / "a.safetensors", a=1)  # not read in the index's stead
    write(tmp_path / INDEX, "[]")
    with pytest.raises(CheckpointError, match=f"{INDEX}: expected a JSON object, found an array"):
        weight_files(tmp_path)
    (tmp_path / INDEX).unlink()
    os.symlink("/dev/zero", tmp_path / INDEX)
    with pytest.raises(CheckpointError, match=f"{INDEX}: not a regular file"):
        weight_files(tmp_path)


def test_model_safetensors_wins_over_an_index_beside_it_as_in_transformers(tmp_path):
    """transformers' from_pretrained loads the single file first; the index, broken here, is not read."""
    shard(tmp_path / "model.safetensors", a=1, b=2)
    shard(tmp_path / "model-1.safetensors", a=5)
    write(tmp_path / INDEX, {"weight_map": {"a": "model-1.safetensors", "c": "/etc/passwd"}})
    assert weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    assert sorted(tensor_names(tmp_path)) == ["a", "b"]
    assert {k: v[0].item() for k, v in load_all(tmp_path).items()} == {"a": 1.0, "b": 2.0}


def load_all(model: Path):
    return read_state_dict(model, torch.float32, torch.device("cpu"))


def test_a_tensor_in_two_files_is_refused(tmp_path):
    shard(tmp_path / "model-1.safetensors", a=1, b=2)
    shard(tmp_path / "model-2.safetensors", b=3)  # two shards, or a stray file beside them: no index
    with pytest.raises(CheckpointError, match="tensor b appears in both .*model-1.safetensors and .*model-2"):
        load_all(tmp_path)


def test_with_an_index_only_its_shards_are_read_each_tensor_from_its_own(tmp_path):
    shard(tmp_path / "model-1.safetensors", a=1)
    shard(tmp_path / "model-2.safetensors", b=2)
    shard(tmp_path / "stray.safetensors", a=9)
    write(tmp_path / INDEX, {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    assert {k: v[0].item() for k, v in load_all(tmp_path).items()} == {"a": 1.0, "b": 2.0}
    shard(tmp_path / "model-2.safetensors", b=2, a=5)  # a is mapped to model-1
    with pytest.raises(CheckpointError, match="tensor a is in .*model-2.safetensors, but .* maps it to .*model-1"):
        load_all(tmp_path)


def with_header(path: Path, tensor: str, **entry) -> Path:
    """The safetensors file `path` with its header entry for `tensor` changed by `entry`, its
    data left as it is."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    header[tensor].update(entry)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])
    return path


@pytest.mark.parametrize("entry,says", [
    (dict(dtype="F32"), "tensor b: dtype F32 and shape [2] make 8 bytes, but its data_offsets [8, 12] span 4"),
    (dict(shape=[3]), "tensor b: dtype F16 and shape [3] make 6 bytes, but its data_offsets [8, 12] span 4"),
    (dict(shape=[-2]), "tensor b: shape [-2] is not a list of sizes"),
])
def test_a_header_entry_that_does_not_add_up_is_refused_naming_file_and_tensor(tmp_path, entry, says):
    """safetensors says only "invalid shape, data type, or offset for tensor", naming neither."""
    save_file({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.float16)}, str(tmp_path / "model.safetensors"))
    bad = with_header(tmp_path / "model.safetensors", "b", **entry)
    for read in (tensor_names, load_all):
        with pytest.raises(CheckpointError) as info:
            read(tmp_path)
        assert str(info.value) == f"cannot read weights {bad}: {says}"


class Norm(nn.Module):
    """A float weight and an integer buffer, as a quantized linear holds its codes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.register_buffer("codes", torch.zeros(4, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.bool])
def test_an_integer_tensor_for_a_float_weight_is_refused(dtype):
    state = {"weight": torch.ones(4, dtype=dtype), "codes": torch.zeros(4, dtype=torch.int8)}
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=f"weight weight in DIR has dtype {name}, expected a floating-point"):
        build_module(Norm, state, "DIR")
    module = build_module(Norm, {"weight": torch.ones(4), "codes": torch.ones(4, dtype=torch.int8)}, "DIR")
    assert module.codes.dtype == torch.int8 and module.weight.dtype == torch.float32


# --- tokenizer settings (tokenizer.py) --------------------------------------------------------

@pytest.fixture
def tok_dir(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("value", [2.5, [[2]], [None], ["2", "x"], {"a": 1}, -1, 1e12, 10**30, [2, 10**12], True,
                                   "2"])
def test_an_eos_token_id_that_is_no_token_is_refused(tok_dir, value):
    write(tok_dir / "generation_config.json", {"eos_token_id": value})
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id: expected an int or a "
                                              r"list of ints inside the vocabulary \(0 to \d+: the "
                                              r"tokenizer's \d+ tokens\), got"):
        load_tokenizer(tok_dir)
    (tok_dir / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: eos_token_id: expected an int"):
        load_tokenizer(tok_dir, {"eos_token_id": value})


def test_a_list_of_too_many_eos_token_ids_is_refused_at_once(tok_dir):
    """Every id of a large vocabulary (a 30 MB generation_config.json) would end every answer
    before its first token; reading it once took minutes."""
    import time
    write(tok_dir / "generation_config.json", {"eos_token_id": list(range(8192)) * 40})
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id: 327680 ids; a model ends on a "
                                              r"few \(at most 256 are read\)"):
        load_tokenizer(tok_dir)
    assert time.monotonic() - start < 5


def test_eos_token_ids_inside_the_vocabulary_are_kept(tok_dir):
    write(tok_dir / "generation_config.json", {"eos_token_id": [2, 0]})
    tok = load_tokenizer(tok_dir, {"eos_token_id": [3, 2]})
    assert tok.eos_token_ids[:3] == [2, 0, 3], "each once, in the order the files name them"
    write(tok_dir / "generation_config.json", "[1]")
    with pytest.raises(CheckpointError, match="generation_config.json: expected a JSON object, found an array"):
        load_tokenizer(tok_dir)


@pytest.mark.parametrize("key,value", [("eos_token", 5), ("eos_token", ["a"]), ("bos_token", {"content": 1})])
def test_a_special_token_that_is_not_text_is_refused(tok_dir, key, value):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    write(tok_dir / "tokenizer_config.json", {**cfg, key: value})
    with pytest.raises(CheckpointError, match=f"tokenizer_config.json: {key}: expected a token string"):
        load_tokenizer(tok_dir)


@pytest.mark.parametrize("template", [["a"], [{"name": "default"}], [{"name": 1, "template": "x"}], 5,
                                      {"template": "x"}])
def test_a_chat_template_of_another_form_is_refused(tok_dir, template):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    write(tok_dir / "tokenizer_config.json", {**cfg, "chat_template": template})
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json \(chat_template\): expected a"):
        load_tokenizer(tok_dir)


def test_named_chat_templates_give_the_default_one(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    write(tok_dir / "tokenizer_config.json", {**cfg, "chat_template": named})
    assert load_tokenizer(tok_dir).chat_template == "D"


@pytest.mark.parametrize("setting", [
    {"truncation": {"direction": "Right", "max_length": 64, "strategy": "LongestFirst", "stride": 0}},
    {"padding": {"strategy": {"Fixed": 512}, "direction": "Left", "pad_to_multiple_of": None, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "<|endoftext|>"}},
])
def test_tokenizer_json_truncation_and_padding_are_ignored_as_in_transformers(tok_dir, setting):
    """Kept, a truncation of 64 cut every prompt to its first 64 tokens without a word (the
    load check's short round trip passed), and a padding put pad tokens before every prompt."""
    plain = load_tokenizer(tok_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 30
    write(tok_dir / "tokenizer.json", {**json.loads((tok_dir / "tokenizer.json").read_text()), **setting})
    tok = load_tokenizer(tok_dir)
    assert tok.encode(text) == tok.encode_plain(text) == plain.encode(text)
    assert len(plain.encode(text)) > 64 and tok.encode("Hi") == plain.encode("Hi")


def test_a_tokenizer_json_that_is_not_a_regular_file_is_refused(tok_dir):
    (tok_dir / "tokenizer.json").unlink()
    os.symlink("/dev/zero", tok_dir / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a regular file"):
        load_tokenizer(tok_dir)


# --- chat templates -----------------------------------------------------------------------------

@pytest.mark.parametrize("template", [
    "{% for i in range(10**9) %}{% endfor %}",  # the sandbox's range limit: OverflowError
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # RecursionError
    "{{ 1 / 0 }}",
])
def test_a_template_raising_python_errors_is_a_chat_template_error(template):
    with pytest.raises(ChatTemplateError, match="the chat template cannot render this conversation"):
        render_template(template, {"messages": []})


def test_generate_chat_renders_in_the_servers_sandbox():
    """Rendered in this process, the template would take 3 GB (it did: 11 GB with its pieces)."""
    tokenizer = SimpleNamespace(chat_template="{{ 'A' * 3000000000 }}", bos_token="", eos_token="",
                                chat_template_source="t.jinja")
    with pytest.raises(ChatTemplateLimit, match="the chat template from t.jinja: .*exceeded its memory limit"):
        _render_chat(tokenizer, "hi", None)
    tokenizer.chat_template = "{{ messages[0].content }}|{{ messages[1].content }}"
    assert _render_chat(tokenizer, "hi", "sys") == "sys|hi"
