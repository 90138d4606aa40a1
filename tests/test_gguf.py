"""GGUF targets: files written as llama.cpp's converter writes them (tests/gguf_convert.py) from
random qwen3, llama and qwen3.5 checkpoints load to the weights of a dequantized safetensors copy
and give its logits; their tokenizer, rebuilt from the metadata alone, encodes and decodes like
the tokenizer.json it came from; bad files are clear errors; the engine serves one."""

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer as RawTokenizer

from flashtree import Engine
from flashtree.checkpoint import load_tokenizer, render_chat
from flashtree.checkpoint.gguf_file import open_gguf
from flashtree.errors import CheckpointError
from flashtree.models.loader import load_target, read_configs
from flashtree.models.inputs import ForwardInput
from flashtree.models.quant import GroupQuantized, QuantizedEmbedding, QuantizedLinear, quant_label
from gguf_convert import convert, rewrite, save_reference, write_tokenizer
from tiny_models import make_target

CPU = torch.device("cpu")
ASSETS = Path(__file__).resolve().parent.parent / "flashtree" / "assets"
IDS = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9, 31, 200, 11]
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.Q4_K, Q.Q5_K,
         Q.Q6_K, Q.Q3_K, Q.Q2_K]
TEXTS = [
    "def add(a, b):\n    return a + b\n\n\n",
    "The quick brown fox -- it's 12345 + 678 = 13023, isn't it? I'LL SEE.",
    "caf\u00e9 na\u00efve \u2603 \u4f60\u597d\u4e16\u754c \U0001F600 e\u0301 \u00a0nbsp\ttab",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "   leading spaces and trailing   \n\n  \r\n mixed\r\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}<tool_call>x</tool_call>',
]


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    """A random checkpoint whose matrices all split into 256-wide K-quant super-blocks (but
    the hybrid's out_proj, which falls back to Q8_0 as llama-quantize's fallback would)."""
    return make_target(tmp_path_factory.mktemp(request.param) / "hf", arch=request.param,
                       layers=3, hidden=256)


def load(path, max_pos=64, quantize=None):
    _, cfg, _ = read_configs(path, None)
    return load_target(path, cfg, torch.float32, CPU, max_pos, quantize)


def logits(model, ids=IDS):
    st = model.new_cache(64, torch.float32, CPU)
    h, _ = model(ForwardInput.prefill(torch.tensor(ids), st))
    return model.logits(h)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def weights(model):
    """Every weight as the model computes with it: a quantized slot's (or embedding table's)
    dequantized matrix."""
    out = dict(model.named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, GroupQuantized):
            out[f"{name}.weight"] = m.dequantized()
            out.pop(f"{name}.bias", None)
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias
    return out


# float16 storage of the scale products (d * sc) and minimums of the types with sub-scales: 2**-11 relative
# (IQ4_XS's table layout keeps d and sc apart)
EXACT_SCALES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_weights_and_logits_equal_a_dequantized_safetensors_copy(checkpoint, qtype, tmp_path):
    held = convert(checkpoint, tmp_path / "model.gguf", qtype)
    reference = load(save_reference(checkpoint, held, tmp_path / "dequantized"))
    model = load(tmp_path / "model.gguf")
    ours, theirs = weights(model), weights(reference)
    assert ours.keys() == theirs.keys()
    slots = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert bool(slots) == (qtype not in (Q.F32, Q.F16, Q.BF16))  # quantized blocks stay quantized
    for key in ours:
        # float32 rounding of the converter's arithmetic (1 + w norms, -exp(A_log)), and the
        # float16 scales and minimums of the K-quants
        exact = qtype in EXACT_SCALES
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5 if exact else 1e-3,
                                   atol=1e-6 if exact else 2e-3 * theirs[key].abs().max().item(), msg=key)
    assert rel_err(logits(model), logits(reference)) < (1e-5 if qtype in EXACT_SCALES else 3e-3)
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):  # quantized from the checkpoint, not random blocks
        original = logits(load(checkpoint))
        assert rel_err(logits(model), original) < {Q.F32: 1e-6, Q.F16: 5e-3, Q.BF16: 0.03, Q.Q8_0: 0.05}[qtype]


def test_a_q4_k_m_mix_packs_its_parts_in_one_format(checkpoint, tmp_path):
    """Q4_K_M stores q/k/gate/up in Q4_K and v/down in Q6_K (and small tensors in F32): a packed
    slot takes the most bits and the smallest group of its parts, which holds them all exactly."""
    held = convert(checkpoint, tmp_path / "mix.gguf", Q.Q4_K, overrides={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K})
    reference = load(save_reference(checkpoint, held, tmp_path / "dequantized"))
    model = load(tmp_path / "mix.gguf")
    formats = {(m.bits, m.group) for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert (8, 16) in formats and (4, 32) in formats  # qkv promoted by its Q6_K part; gate_up kept
    assert rel_err(logits(model), logits(reference)) < 3e-3


@pytest.mark.parametrize("qtype,overrides,tables", [
    (Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}, set()), (Q.IQ4_XS, {"attn_v": Q.Q6_K}, {("IQ4_XS", 8)}),
    (Q.IQ4_NL, {"ffn_down": Q.IQ4_XS}, {("IQ4_NL", None), ("IQ4_XS", 8)}),
    (Q.IQ4_NL, {"attn_v": Q.IQ4_XS}, {("IQ4_NL", None), ("IQ4_XS", 1)})],
    ids=["Q4_K_M-like", "IQ4_XS with Q6_K values", "IQ4_NL with IQ4_XS down", "IQ4_NL with IQ4_XS values"])
def test_the_plan_counts_what_the_loader_holds(checkpoint, qtype, overrides, tables, tmp_path):
    """The memory plan's GGUF weight bytes (from the header alone) equal the bytes the loaded
    model holds, for mixes whose packed slots change format: a slot of IQ4 parts stays in the
    table layout (IQ4_XS's two levels in super-blocks of 8 groups; with an IQ4_NL part, of one,
    its d the super-scale), and IQ4 packed with Q6_K is widened."""
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    convert(checkpoint, tmp_path / "mix.gguf", qtype, overrides=overrides)
    model = load(tmp_path / "mix.gguf")
    planned = gguf_weight_bytes(tmp_path / "mix.gguf", torch.float32, model.config.num_layers)
    assert sum(planned.values()) == held_bytes(model)
    kept = {(m.lookup, m.super_groups) for m in model.modules() if isinstance(m, GroupQuantized) and m.lookup}
    assert kept == tables
    assert all(planned[quant_label(4, 32, *table)] for table in tables)


def test_iq4_xs_is_held_in_two_levels_at_4_3125_bits_a_weight_exactly(tmp_path):
    """An IQ4_XS file's weights stay 4-bit codes under an int8 sub-scale per 32 and a float16
    super-scale per 256 (4 + 8/32 + 16/256 = 4.3125 bits a weight, and the table's 64 bytes a
    layer), as the plan counts them; a hybrid's out_proj, whose value heads of 128 the loader
    reorders across super-blocks, a super-scale per 128 (4.375 bits). Every weight is gguf's
    dequantized one bit for bit, and the logits are those of the dequantized copy."""
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    hf = make_target(tmp_path / "hf", arch="qwen3_5", layers=3, hidden=256, text_extra={"linear_value_head_dim": 128})
    held = convert(hf, tmp_path / "model.gguf", Q.IQ4_XS)
    model = load(tmp_path / "model.gguf")
    reference = load(save_reference(hf, held, tmp_path / "dequantized"))
    ours, theirs = weights(model), weights(reference)
    tables = {name: m for name, m in model.named_modules() if isinstance(m, GroupQuantized)}
    assert tables and all(m.lookup == "IQ4_XS" and m.bias is None for m in tables.values())
    per_label = {}
    for name, m in tables.items():
        super_groups = 4 if name.endswith("linear_attn.out_proj") else 8
        n = m.out_features * m.in_features
        assert m.super_groups == super_groups and m.scale.dtype == torch.int8
        assert m.nbytes == n * (4 + 8 / 32 + 16 / (32 * super_groups)) / 8 + 64, name
        assert torch.equal(ours[f"{name}.weight"], theirs[f"{name}.weight"]), name
        label = quant_label(4, 32, "IQ4_XS", super_groups)
        per_label[label] = per_label.get(label, 0) + m.nbytes
    assert set(per_label) == {"int4 IQ4_XS g32/256", "int4 IQ4_XS g32/128"}
    planned = gguf_weight_bytes(tmp_path / "model.gguf", torch.float32, model.config.num_layers)
    assert {label: planned[label] for label in per_label} == per_label
    assert sum(planned.values()) == held_bytes(model)
    assert rel_err(logits(model), logits(reference)) < 1e-5


def held_bytes(model):
    """The bytes the model's weights hold (tied ones once), without its RoPE tables."""
    held = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(held.values()) - sum(b.numel() * b.element_size() for b in model.rope.buffers())


def test_quantize_int4_rounds_the_layers_wider_slots_and_the_plan_counts_it(checkpoint, tmp_path):
    """--quantize int4 with a GGUF target: the decoder layers' slots kept in 8 bits (promoted by
    a Q6_K part) are rounded to int4 in groups of 32, close to the file's weights; the 4-bit ones
    are the file's codes unchanged; the memory plan counts what the loader holds."""
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    convert(checkpoint, tmp_path / "mix.gguf", Q.Q4_K, overrides={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K})
    exact, small = load(tmp_path / "mix.gguf"), load(tmp_path / "mix.gguf", quantize="int4")
    layers = {n: m for n, m in small.named_modules() if isinstance(m, QuantizedLinear) and ".layers." in n}
    originals = dict(exact.named_modules())
    assert {(m.bits, m.group) for m in layers.values()} == {(4, 32)}
    rounded = [n for n in layers if originals[n].bits == 8]
    assert rounded and len(rounded) < len(layers)
    for name, layer in layers.items():
        before, after = originals[name].dequantized(), layer.dequantized()
        if name in rounded:  # int4 rounding of the file's values (random 6-bit codes: ~1/15; the
            # reference rounds the float16-stored scales, so a few codes at a boundary differ)
            assert 0 < rel_err(after, before) < 0.1, name
            assert rel_err(after, QuantizedLinear.from_float(before, 4, 32).dequantized()) < 0.03, name
        else:
            assert torch.equal(after, before), name
    planned = gguf_weight_bytes(tmp_path / "mix.gguf", torch.float32, small.config.num_layers, max_bits=4)
    assert sum(planned.values()) == held_bytes(small) < held_bytes(exact)
    exact_plan = gguf_weight_bytes(tmp_path / "mix.gguf", torch.float32, small.config.num_layers)
    assert planned["int4 g32"] > exact_plan["int4 g32"]


def test_quantize_int4_of_a_dense_gguf_is_counted_as_loaded(checkpoint, tmp_path):
    """An F32 file under --quantize int4: its layers quantized as a checkpoint's would be, the
    embedding and lm_head to int8; the plan's bytes are the loaded model's."""
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    convert(checkpoint, tmp_path / "f32.gguf", Q.F32)
    model = load(tmp_path / "f32.gguf", quantize="int4")
    assert {m.bits for m in model.modules() if isinstance(m, GroupQuantized)} == {4, 8}
    planned = gguf_weight_bytes(tmp_path / "f32.gguf", torch.float32, model.config.num_layers, max_bits=4)
    assert sum(planned.values()) == held_bytes(model)


def test_tied_embeddings_have_no_output_tensor(tmp_path):
    hf = make_target(tmp_path / "hf", arch="qwen3", layers=2, hidden=64, tie=True)
    convert(hf, tmp_path / "tied.gguf", Q.Q8_0)
    assert "output.weight" not in open_gguf(tmp_path / "tied.gguf").tensors
    raw, cfg, _ = read_configs(tmp_path / "tied.gguf", None)
    assert cfg.tie_word_embeddings and raw["vocab_size"] == 400
    model = load(tmp_path / "tied.gguf")  # the Q8_0 table stays quantized, once, for both
    table, head = model.model.embed_tokens, model.lm_head
    assert isinstance(table, QuantizedEmbedding) and isinstance(head, QuantizedLinear)
    assert head.codes is table.codes and head.scale is table.scale and (table.bits, table.group) == (8, 32)
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    held = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    rope = sum(b.numel() * b.element_size() for b in model.rope.buffers())
    planned = gguf_weight_bytes(tmp_path / "tied.gguf", torch.float32, model.config.num_layers)
    assert sum(planned.values()) == sum(held.values()) - rope and planned["int8 g32"] >= table.nbytes
    assert rel_err(logits(model), logits(load(hf))) < 0.05


def test_config_from_metadata_equals_config_json(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "model.gguf")
    _, ours, _ = read_configs(tmp_path / "model.gguf", None)
    _, theirs, _ = read_configs(checkpoint, None)
    if ours.rope["rope_type"] == "freq_factors":  # llama3 scaling, as the per-frequency divisors
        from flashtree.models.rope import rope_inv_freq
        torch.testing.assert_close(rope_inv_freq(ours.head_dim, ours.rope, 64)[0],
                                   rope_inv_freq(theirs.head_dim, theirs.rope, 64)[0], rtol=1e-6, atol=0)
        ours.rope = theirs.rope
    assert ours == theirs


# ---- tokenizer --------------------------------------------------------------------------------

def assert_same_tokenizer(ours, theirs):
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode_plain(text) == theirs.encode_plain(text), text
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.special_tokens == theirs.special_tokens
    assert ours.vocab_size == theirs.vocab_size


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    hf = make_target(tmp_path / "hf", arch="qwen3", layers=1, hidden=64)
    convert(hf, tmp_path / "model.gguf")
    (tmp_path / "alone").mkdir()
    alone = shutil.move(tmp_path / "model.gguf", tmp_path / "alone" / "model.gguf")  # no HF folder beside it
    ours, theirs = load_tokenizer(Path(alone)), load_tokenizer(hf)
    assert_same_tokenizer(ours, theirs)
    assert sorted(ours.eos_token_ids) == sorted(theirs.eos_token_ids)
    assert ours.eos_token == theirs.eos_token
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(ours, messages) == render_chat(theirs, messages)


# what the tokenizer.json files of the families llama.cpp names (Qwen2/3, Qwen3.5, LLaMA-3) have:
# split regex, NFC normalizer, BPE ignore_merges
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILY_SPLITS = {
    "qwen2": (QWEN2_SPLIT, True, False),
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", True, False),
    "llama-bpe": (QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|"), False, True),
}


@pytest.mark.parametrize("pre", sorted(FAMILY_SPLITS))
def test_embedded_vocabulary_round_trips_under_each_family(pre, tmp_path):
    """The embedded model's 8192-token vocabulary, merges and special tokens through the GGUF
    arrays. Its own split regex is none that llama.cpp names, so the reference is its
    tokenizer.json with the named family's split, normalizer and merge rule put in."""
    spec = json.loads((ASSETS / "target" / "tokenizer.json").read_text())
    regex, nfc, ignore_merges = FAMILY_SPLITS[pre]
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": regex}
    spec["normalizer"] = {"type": "NFC"} if nfc else None
    spec["model"]["ignore_merges"] = ignore_merges
    hf = tmp_path / "hf"
    shutil.copytree(ASSETS / "target", hf, ignore=shutil.ignore_patterns("*.safetensors*"))
    (hf / "tokenizer.json").write_text(json.dumps(spec))
    cfg = json.loads((hf / "config.json").read_text())
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "qwen3")
    write_tokenizer(w, hf, cfg["vocab_size"], pre, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = load_tokenizer(tmp_path / "tok.gguf"), load_tokenizer(hf, cfg)
    assert_same_tokenizer(ours, theirs)
    assert RawTokenizer.from_str(ours.raw.to_str()).get_vocab() == theirs.raw.get_vocab()
    assert ours.chat_template == theirs.chat_template


# ---- errors -----------------------------------------------------------------------------------

def small_gguf(path, arch="qwen3", tensors=(), pre="gpt-2", strings=()):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in strings:
        w.add_string(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    for name, data, raw_dtype in tensors:
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file .*missing.gguf does not exist"):
        Engine.from_pretrained(str(tmp_path / "missing.gguf"), mode="ar", device="cpu")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(CheckpointError, match="junk.gguf: version: GGUF version 50462976 is not supported"):
        read_configs(tmp_path / "junk.gguf", None)
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gpt2'"):
        read_configs(small_gguf(tmp_path / "gpt2.gguf", arch="gpt2"), None)
    with pytest.raises(CheckpointError, match=r"nokeys.gguf: qwen3\.attention\.head_count: missing \(a required key\)"):
        read_configs(small_gguf(tmp_path / "nokeys.gguf", tensors=[
            ("token_embd.weight", np.zeros((8, 32), np.float32), None)]), None)
    with pytest.raises(CheckpointError, match="qwen3.attention.head_count: expected an integer, found a string"):
        read_configs(small_gguf(tmp_path / "str.gguf", strings=[("qwen3.attention.head_count", "four")]), None)
    with pytest.raises(CheckpointError, match="unsupported tokenizer.ggml.pre 'tekken'"):
        load_tokenizer(small_gguf(tmp_path / "pre.gguf", pre="tekken"))


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    hf = make_target(tmp_path / "hf", arch="qwen3", layers=1, hidden=256)  # whole TQ2_0 blocks
    convert(hf, tmp_path / "model.gguf")
    rewrite(tmp_path / "model.gguf", tmp_path / "tq2.gguf", types={"blk.0.ffn_up.weight": Q.TQ2_0})
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight: has type TQ2_0"):
        load(tmp_path / "tq2.gguf")


def test_types_held_in_more_bits_than_the_file_are_named_at_load(checkpoint, tmp_path, caplog):
    """Q5_0 (5-bit codes) loads exactly as 8-bit codes, and so does IQ4_XS packed with a Q6_K
    part (a table of 16 values is not affine), and the load says so; Q4_K, whose codes the kernels
    take as they are, and IQ4_XS alone, kept in the 4-bit table layout, load without a word."""
    for qtype, overrides, widened in ((Q.Q5_0, {}, "Q5_0"), (Q.IQ4_XS, {"attn_v": Q.Q6_K}, "IQ4_XS"),
                                      (Q.Q4_K, {}, None), (Q.IQ4_XS, {}, None)):
        convert(checkpoint, tmp_path / "model.gguf", qtype, overrides=overrides)
        caplog.clear()
        with caplog.at_level("WARNING", logger="flashtree.load"):
            model = load(tmp_path / "model.gguf")
        said = [r.getMessage() for r in caplog.records if "held as 8-bit codes" in r.getMessage()]
        assert (f"{widened} weights are held as 8-bit codes" in said[0]) if widened else not said, (qtype, said)
        if qtype == Q.IQ4_XS:  # (the hybrid's out_proj, Q8_0 in the file, is 8-bit either way)
            bits = {(m.bits, m.lookup) for m in model.modules() if isinstance(m, QuantizedLinear)}
            assert (4, "IQ4_XS") in bits and (8, None) in bits if overrides else (4, "IQ4_XS") in bits


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_an_iq4_xs_target_generates_its_dequantized_copys_greedy_tokens(arch, tmp_path):
    """An IQ4_XS file's layers stay 4-bit (the table layout, not widened), and greedy AR output
    equals that of the safetensors copy of the weights the file holds, dequantized."""
    hf = make_target(tmp_path / "hf", arch=arch, layers=3, hidden=256)
    held = convert(hf, tmp_path / "model.gguf", Q.IQ4_XS)
    ours = Engine.from_pretrained(str(tmp_path / "model.gguf"), mode="ar", device="cpu", max_ctx=128)
    layers = [m for n, m in ours.target.named_modules() if isinstance(m, QuantizedLinear) and ".layers." in n
              and m.in_features % 256 == 0]  # (the hybrid's out_proj, 128 wide, falls back to Q8_0)
    assert layers and all(m.lookup == "IQ4_XS" and m.codes.shape[1] == m.in_features // 2 for m in layers)
    theirs = Engine.from_pretrained(str(save_reference(hf, held, tmp_path / "dequantized")), mode="ar",
                                    device="cpu", max_ctx=128)
    prompt = IDS[:10]
    got = ours.generate(prompt, max_tokens=12, stop_token_ids=[]).token_ids
    assert len(got) == 12 and got == theirs.generate(prompt, max_tokens=12, stop_token_ids=[]).token_ids


# ---- serving ----------------------------------------------------------------------------------

def test_engine_serves_a_gguf_target(tmp_path):
    """AR mode: no draft (a DFlash draft needs the target's vocabulary and layers; the engine
    loads none in AR). Greedy output equals the same checkpoint's from safetensors."""
    hf = make_target(tmp_path / "hf", arch="qwen3_5", layers=3, hidden=64)
    convert(hf, tmp_path / "model.gguf", Q.F32)
    prompt = IDS[:10]
    ours = Engine.from_pretrained(str(tmp_path / "model.gguf"), mode="ar", device="cpu", max_ctx=128)
    theirs = Engine.from_pretrained(str(hf), mode="ar", device="cpu", max_ctx=128)
    got = ours.generate(prompt, max_tokens=8, stop_token_ids=[]).token_ids
    assert len(got) == 8
    assert got == theirs.generate(prompt, max_tokens=8, stop_token_ids=[]).token_ids
    assert ours.tokenizer.eos_token_ids == [ours.tokenizer.token_to_id("<|im_end|>"),
                                            ours.tokenizer.token_to_id("<|endoftext|>")]


def chat_answer(target, log):
    from serve_harness import Server

    srv = Server(None, None, log, "--target", str(target), "--mode", "ar", max_ctx=256)
    try:
        r = srv.client().chat.completions.create(
            model="x", messages=[{"role": "user", "content": "What is 2 + 2? caf\u00e9 <tool_call>"}],
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    finally:
        srv.stop()
    return r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].message.content


@pytest.mark.slow  # two live servers, about a minute on two cores
def test_server_answers_from_a_gguf_file_alone(tmp_path):
    """`flashtree serve --target model.gguf` with nothing beside the file: the HTTP process reads
    the tokenizer and chat template from the file, and the chat answer (greedy, AR) is the one
    the server gives for the safetensors checkpoint."""
    hf = make_target(tmp_path / "hf", arch="llama", layers=2, hidden=64)
    (tmp_path / "alone").mkdir()
    convert(hf, tmp_path / "alone" / "model.gguf", Q.F32)
    got = chat_answer(tmp_path / "alone" / "model.gguf", tmp_path / "gguf.log")
    assert got[1] == 6
    assert got == chat_answer(hf, tmp_path / "hf.log")
