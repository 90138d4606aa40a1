"""Hostile GGUF headers, written byte by byte: every malformed value is one
CheckpointError `<file>: <key or tensor>: <what is wrong>`, raised when the header is read, and a
header that lies about its counts is refused from the counts alone; a vocabulary that cannot
serve the model (short, duplicated, ids outside it) is refused by name; the CLI prints each as
one line and exits 2."""

import re
import struct

import gguf
import pytest

from flashtree.checkpoint import load_tokenizer
from flashtree.errors import CheckpointError
from flashtree.models.loader import read_configs
from gguf_convert import convert, rewrite
from test_cli_usage import assert_one_line_error, run
from tiny_models import make_target

UINT32, FLOAT32, STRING, ARRAY = 4, 6, 8, 9


def text(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def string_value(raw: bytes) -> tuple[int, bytes]:
    return STRING, text(raw)


def uint32_value(value: int) -> tuple[int, bytes]:
    return UINT32, struct.pack("<I", value)


def strings_value(items: list[bytes], count=None) -> tuple[int, bytes]:
    """An array of strings whose stated length is `count` (default: the truth)."""
    stated = len(items) if count is None else count
    return ARRAY, struct.pack("<IQ", STRING, stated) + b"".join(text(i) for i in items)


ARCH = (b"general.architecture", string_value(b"qwen3"))
EMBED = (b"token_embd.weight", (8, 4), 0, 0)  # F32, 8 x 4, at data offset 0


def raw_gguf(path, metadata=(ARCH,), tensors=(EMBED,), counts=None, data=bytes(128), cut=None):
    """A GGUF file written field by field: `metadata` [(key, (type, payload))], `tensors` [(name,
    dims in GGUF order, type, data offset)], then `data` at the next multiple of 32; `counts`
    states other (tensor, metadata) counts than the lists', `cut` keeps only that many bytes."""
    n_tensors, n_keys = counts or (len(tensors), len(metadata))
    out = [b"GGUF", struct.pack("<IQQ", 3, n_tensors, n_keys)]
    for key, (kind, payload) in metadata:
        out += [text(key), struct.pack("<I", kind), payload]
    for name, dims, kind, offset in tensors:
        out += [text(name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                struct.pack("<IQ", kind, offset)]
    header = b"".join(out)
    blob = header + bytes(-len(header) % 32) + data
    path.write_bytes(blob[:cut])
    return path


def refused(call, source, where, problem):
    """`call()` raises the CheckpointError `<source>: <where>: <problem>` (`problem` a regex)."""
    with pytest.raises(CheckpointError) as info:
        call()
    assert re.fullmatch(re.escape(f"{source}: {where}: ") + problem, str(info.value)), str(info.value)


def file_refused(path, where, problem, read=lambda path: read_configs(path, None)):
    """Reading the GGUF file `path` (its config, or with `read` its tokenizer) is refused so."""
    refused(lambda: read(path), path.resolve(), where, problem)


HOSTILE = {  # name -> (raw_gguf arguments, where, what is wrong as a regex)
    "value not UTF-8": (dict(metadata=[ARCH, (b"tokenizer.ggml.pre", string_value(b"gpt\xff2"))]),
                        "tokenizer.ggml.pre", r"not valid UTF-8 \(byte 3 of 5\)"),
    "key not UTF-8": (dict(metadata=[ARCH, (b"qwen3.\xc3", uint32_value(1))]),
                      "metadata entry 1", r"not valid UTF-8 \(byte 6 of 7\)"),
    "array item not UTF-8": (dict(metadata=[ARCH, (b"tokenizer.ggml.tokens", strings_value([b"a", b"\x80"]))]),
                             r"tokenizer.ggml.tokens[1]", r"not valid UTF-8 \(byte 0 of 1\)"),
    "key twice": (dict(metadata=[ARCH, (b"qwen3.block_count", uint32_value(1)),
                                 (b"qwen3.block_count", uint32_value(2))]),
                  "qwen3.block_count", "this key appears twice"),
    "empty tensor name": (dict(tensors=[(b"", (8, 4), 0, 0)]), "tensor entry 0", "its name is empty"),
    "tensor name twice": (dict(tensors=[EMBED, (b"token_embd.weight", (8, 4), 0, 128)], data=bytes(256)),
                          "token_embd.weight", "two tensors have this name"),
    "offset past the end": (dict(tensors=[(b"token_embd.weight", (8, 4), 0, 1 << 40)]),
                            "token_embd.weight", r"its 128 bytes at data offset 1099511627776 run past the end "
                                                 r"of the file \(\d+ bytes\)"),
    "data cut short": (dict(data=bytes(100)), "token_embd.weight",
                       r"its 128 bytes at data offset 0 run past the end of the file \(\d+ bytes\)"),
    "misaligned offset": (dict(tensors=[(b"token_embd.weight", (8, 4), 0, 4)], data=bytes(160)),
                          "token_embd.weight", "data offset 4 is not a multiple of the file's alignment 32"),
    "overlapping tensors": (dict(tensors=[EMBED, (b"output.weight", (8, 4), 0, 64)], data=bytes(256)),
                            "output.weight", r"its data \(at byte \d+\) overlaps token_embd.weight's \(128 bytes "
                                             r"at byte \d+\)"),
    "unknown tensor type": (dict(tensors=[(b"token_embd.weight", (8, 4), 99, 0)]),
                            "token_embd.weight", "unknown tensor type 99"),
    "empty dimension": (dict(tensors=[(b"token_embd.weight", (8, 0), 0, 0)]),
                        "token_embd.weight", r"shape \[8, 0\] has an empty dimension"),
    "rows not whole blocks": (dict(tensors=[(b"token_embd.weight", (8, 4), 8, 0)]),  # Q8_0: blocks of 32
                              "token_embd.weight", "rows of 8 values do not split into Q8_0 blocks of 32"),
    "bad alignment": (dict(metadata=[ARCH, (b"general.alignment", uint32_value(24))]),
                      "general.alignment", "must be a uint32 power of two, found a uint32 24"),
    "array of arrays": (dict(metadata=[ARCH, (b"tokenizer.ggml.merges", (ARRAY, struct.pack("<IQ", ARRAY, 1)))]),
                        "tokenizer.ggml.merges", r"an array of arrays \(not supported\)"),
    "array longer than the file": (dict(metadata=[ARCH, (b"tokenizer.ggml.tokens", strings_value([b"a"], 1 << 40))]),
                                   "tokenizer.ggml.tokens",
                                   r"an array of 1099511627776 items cannot fit in the \d+ bytes left"),
    "counts longer than the file": (dict(counts=(50_000, 1)), "header",
                                    r"50000 tensor entries and 1 metadata entries cannot fit in the \d+ bytes left "
                                    "in the file"),
    "header cut short": (dict(tensors=[], cut=60), "general.architecture",
                         r"the file ends inside it \(truncated at 60 bytes\)"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_malformed_header_is_refused_naming_the_problem(case, tmp_path):
    args, where, problem = HOSTILE[case]
    file_refused(raw_gguf(tmp_path / "bad.gguf", **args), where, problem)


def test_a_value_of_the_wrong_kind_is_refused_naming_the_key(tmp_path):
    heads = (b"qwen3.attention.head_count", (FLOAT32, struct.pack("<f", 4.0)))
    file_refused(raw_gguf(tmp_path / "float.gguf", metadata=[ARCH, heads]), "qwen3.attention.head_count",
            "expected an integer, found a float32")
    shape = [ARCH, (b"qwen3.attention.head_count", uint32_value(4)), (b"qwen3.embedding_length", uint32_value(4)),
             (b"qwen3.block_count", (ARRAY, struct.pack("<IQI", UINT32, 1, 2)))]
    file_refused(raw_gguf(tmp_path / "array.gguf", metadata=shape), "qwen3.block_count",
            "expected an integer, found an array of uint32")


def test_an_empty_vocabulary_is_refused(tmp_path):
    tokenizer = [ARCH, (b"tokenizer.ggml.model", string_value(b"gpt2")), (b"tokenizer.ggml.tokens", strings_value([]))]
    file_refused(raw_gguf(tmp_path / "empty.gguf", metadata=tokenizer), "tokenizer.ggml.tokens",
            "the vocabulary is empty", read=load_tokenizer)


def test_200000_tensor_entries_are_refused_by_their_count(tmp_path):
    """Such a file took `flashtree plan` tens of seconds and gigabytes in gguf's reader: the
    count alone refuses it now, before any entry is read."""
    entries = [(b"blk.%d.attn_norm.weight" % i, (1,), 0, 32 * i) for i in range(200_000)]
    path = raw_gguf(tmp_path / "many.gguf", tensors=entries, data=bytes(32 * 200_000))
    file_refused(path, "tensor count", "200000 tensors; a model has at most 100000")


# ---- vocabularies that cannot serve the model -------------------------------------------------

@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    convert(make_target(root / "hf", arch="qwen3", layers=1, hidden=64), root / "model.gguf")
    return root / "model.gguf"


def tokens_of(path):
    return gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()


def test_a_short_vocabulary_is_refused(model_file, tmp_path):
    tokens = tokens_of(model_file)  # 400, one per row of the embedding
    short = rewrite(model_file, tmp_path / "short.gguf", {"tokenizer.ggml.tokens": tokens[:399],
                                                          "tokenizer.ggml.token_type": [1] * 399})
    file_refused(short, "tokenizer.ggml.tokens", r"399 tokens for the 400 rows of token_embd.weight "
                                            r"\(there must be one per row\)", read=load_tokenizer)


def test_a_token_twice_is_refused(model_file, tmp_path):
    tokens = tokens_of(model_file)
    twice = rewrite(model_file, tmp_path / "twice.gguf", {"tokenizer.ggml.tokens": tokens[:-1] + [tokens[100]]})
    file_refused(twice, "tokenizer.ggml.tokens", re.escape(f"token {tokens[100]!r} appears twice (ids 100 and 399)"),
            read=load_tokenizer)


def test_a_special_token_id_outside_the_vocabulary_is_refused(model_file, tmp_path):
    eos = rewrite(model_file, tmp_path / "eos.gguf", {"tokenizer.ggml.eos_token_id": 400})
    file_refused(eos, "tokenizer.ggml.eos_token_id", r"400 is not a token id \(the vocabulary has 400 tokens\)",
            read=load_tokenizer)


def test_a_merge_of_unknown_tokens_is_refused(model_file, tmp_path):
    tokens = tokens_of(model_file)
    renamed = rewrite(model_file, tmp_path / "merge.gguf", {"tokenizer.ggml.tokens": [t + "\u2603" if i == 300 else t
                                                                                      for i, t in enumerate(tokens)]})
    file_refused(renamed, "tokenizer.ggml.merges", ".*out of vocabulary", read=load_tokenizer)


# ---- the CLI, run as a user runs it: one line, exit 2 -----------------------------------------

def test_the_cli_prints_a_header_error_as_one_line(tmp_path):
    bad = raw_gguf(tmp_path / "bad.gguf", tensors=[(b"", (8, 4), 0, 0)])
    assert_one_line_error(run("plan", "--target", str(bad), "--mode", "ar", "--gpu-memory", "24G"),
                          "tensor entry 0: its name is empty")


def test_the_cli_prints_a_vocabulary_error_as_one_line(model_file, tmp_path):
    """Before, tokenizers' own exception escaped as a traceback."""
    tokens = tokens_of(model_file)
    short = rewrite(model_file, tmp_path / "short.gguf", {"tokenizer.ggml.tokens": tokens[:300],
                                                          "tokenizer.ggml.token_type": [1] * 300})
    assert_one_line_error(run("generate", "--target", str(short), "--device", "cpu", "--mode", "ar",
                              "--max-tokens", "2", "--prompt", "hi"),
                          "tokenizer.ggml.tokens: 300 tokens for the 400 rows")
