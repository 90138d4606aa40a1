"""GGUF blocks as group codes (flashtree/checkpoint/gguf_codes.py): codes * scale + minimum (the
IQ4 types: IQ4_VALUES[codes] * scale, IQ4_XS's scale its two levels' product, and so are their
widened 8-bit codes) is gguf.quants.dequantize's value, exactly, for every supported type, on
random blocks; IQ4_XS's two levels survive a column order that splits its super-blocks; and a
GGUF file's linear weights handed to the loader's hook still quantized come out, once expanded,
equal to the dequantized weights the loader reads, every row and column reorder included."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from flashtree.checkpoint.gguf_codes import (IQ4_VALUES, GroupCodes, decompose, group_codes, group_scales,
                                             part_format, super_groups, widen)
from flashtree.checkpoint.gguf_file import open_gguf
from flashtree.checkpoint.gguf_tensors import QuantizedTensor, read_tensors
from flashtree.errors import CheckpointError
from gguf_convert import convert, random_blocks
from tiny_models import make_target

EXPECTED = {Q.Q8_0: (32, 8, 256), Q.Q4_0: (32, 4, 16), Q.Q4_1: (32, 4, 16), Q.Q5_0: (32, 8, 32),
            Q.Q5_1: (32, 8, 32), Q.IQ4_NL: (32, 4, 16), Q.IQ4_XS: (32, 4, 16), Q.Q4_K: (32, 4, 16),
            Q.Q5_K: (32, 8, 32), Q.Q6_K: (16, 8, 64), Q.Q3_K: (16, 8, 8),
            Q.Q2_K: (16, 8, 4)}  # group, bits, how many code values a type has


def expand(c: GroupCodes) -> np.ndarray:
    if c.lookup is not None:
        return IQ4_VALUES[c.codes].astype(np.float32) * np.repeat(group_scales(c), c.group, axis=1)
    return (c.codes.astype(np.float32) * np.repeat(c.scale, c.group, axis=1)
            + np.repeat(c.minimum, c.group, axis=1))


def blocks_of(qtype, rows, cols, rng):
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # real scales, then random codes (all values)
        blocks = quantize(rng.normal(0, 1, (rows, cols)).astype(np.float32), qtype)
        blocks = blocks.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
        scales = 4 if qtype in (Q.Q4_1, Q.Q5_1) else 2  # d, and m
        blocks[..., scales:] = rng.integers(0, 256, blocks[..., scales:].shape, dtype=np.uint8)
        return blocks.reshape(rows, -1)
    return random_blocks(rows, cols, qtype, rng)


@pytest.mark.parametrize("qtype", list(EXPECTED), ids=lambda q: q.name)
def test_codes_times_scale_plus_minimum_is_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 24, 512
    blocks = blocks_of(qtype, rows, cols, rng)
    c = decompose(qtype.name, blocks, (rows, cols))
    group, bits, values = EXPECTED[qtype]
    assert (c.group, c.bits) == (group, bits)
    assert c.codes.shape == (rows, cols) and c.codes.dtype == np.uint8
    assert c.scale.shape == (rows, cols // group)
    assert c.codes.max() < 2 ** bits and len(np.unique(c.codes)) == values  # every code value occurs
    want = dequantize(blocks, qtype)
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):  # the table layout: gguf's own float32 products, bit for bit
        assert c.lookup == qtype.name and c.minimum is None
        if qtype == Q.IQ4_XS:  # two levels: a float16 d per 256, an integer ls - 32 per group
            assert c.superscale.shape == (rows, cols // 256)
            assert np.array_equal(c.superscale.astype(np.float16).astype(np.float32), c.superscale)
            assert np.array_equal(c.scale, np.round(c.scale)) and c.scale.min() == -32 and c.scale.max() == 31
        else:
            assert c.superscale is None
        np.testing.assert_array_equal(expand(c), want)
        c = widen(c)  # as 8-bit affine codes, packed with another type
        assert (c.bits, c.lookup) == (8, None)
    assert c.minimum.shape == (rows, cols // group)
    np.testing.assert_allclose(expand(c), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_bad_blocks_are_refused():
    with pytest.raises(CheckpointError, match="do not hold a 4x64 weight"):
        decompose("Q8_0", np.zeros((4, 34), np.uint8), (4, 64))
    with pytest.raises(CheckpointError, match="IQ2_XXS has no group-wise form"):
        decompose("IQ2_XXS", np.zeros((4, 66), np.uint8), (4, 256))
    blocks = quantize(np.ones((2, 64), np.float32), Q.Q8_0)
    order = np.concatenate([np.arange(16, 64), np.arange(16)])  # moves half groups
    with pytest.raises(CheckpointError, match="splits the 32-wide groups"):
        group_codes(QuantizedTensor("w", "Q8_0", blocks, (2, 64), order))


def test_a_column_order_across_super_blocks_narrows_them():
    """IQ4_XS under a column order that moves 128-wide blocks (qwen35's out_proj with value heads
    of 128) keeps a super-scale per 4 groups, each its stored super-block's d; one that moves whole
    super-blocks keeps 8, and one whose neighbouring groups come from different super-blocks 1.
    The weights stay gguf's."""
    rng = np.random.default_rng(3)
    rows, cols = 8, 1024
    blocks = random_blocks(rows, cols, Q.IQ4_XS, rng)
    want = dequantize(blocks, Q.IQ4_XS).reshape(rows, cols)
    heads = np.arange(cols).reshape(8, 128)
    for order, kept in ((heads[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1), 4),
                        (np.concatenate([np.arange(512, 1024), np.arange(512)]), 8),
                        (np.arange(cols).reshape(4, 8, 32).transpose(1, 0, 2).reshape(-1), 1)):
        assert super_groups("IQ4_XS", order) == kept and part_format("IQ4_XS", order) == (4, 32, "IQ4_XS", kept)
        c = group_codes(QuantizedTensor("w", "IQ4_XS", blocks, (rows, cols), order))
        assert c.superscale.shape == (rows, cols // 32 // kept)
        np.testing.assert_array_equal(expand(c), want[:, order])
    assert super_groups("IQ4_NL", heads.reshape(-1)) is None and super_groups("IQ4_XS", None) == 8


@pytest.mark.parametrize("arch,qtype", [("qwen3_5", Q.Q8_0), ("qwen3_5", Q.Q6_K), ("llama", Q.Q4_K),
                                        ("llama", Q.Q4_0), ("qwen3", Q.Q5_K), ("qwen3_5", Q.IQ4_XS),
                                        ("qwen3_5", Q.Q3_K), ("llama", Q.Q5_1)])
def test_hooked_weights_expand_to_the_loaded_weights(arch, qtype, tmp_path):
    hf = make_target(tmp_path / "hf", arch=arch, layers=3, hidden=256)
    convert(hf, tmp_path / "model.gguf", qtype)
    g = open_gguf(tmp_path / "model.gguf")
    seen = []

    def hook(t):
        seen.append((t.name, t.qtype, t.column_order is not None))
        elems, size = GGML_QUANT_SIZES[Q[t.qtype]]
        assert t.blocks.shape == (t.shape[0], t.shape[1] // elems * size)
        return group_codes(t)

    dense = dict(read_tensors(g))
    hooked = dict(read_tensors(g, hook))
    assert dense.keys() == hooked.keys()
    assert {name for name, _, _ in seen} == {n for n, v in hooked.items() if isinstance(v, GroupCodes)}
    assert any(name.endswith("q_proj.weight") for name, _, _ in seen)
    if arch == "qwen3_5":  # the out_proj's tiled value heads are reordered as codes
        assert any(name.endswith("out_proj.weight") and moved for name, _, moved in seen)
    for name, value in hooked.items():
        if isinstance(value, GroupCodes):
            np.testing.assert_allclose(expand(value), dense[name], rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(value, dense[name])
