"""One target forward over several sequences' rows (ForwardInput.batch): each sequence's hidden
states, features, KV rows and recurrent-state scratch equal its forward alone, for a prefill
chunk, a tree (with its mask and, on a hybrid, its tree index) and a causal chain in one batch,
dense and hybrid, float32."""

import pytest
import torch

from flashtree.kernels.gated_delta import TreeIndex
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_target, read_configs
from tiny_models import make_target

CPU = torch.device("cpu")
PARENTS = [-1, 0, 0, 1, 3]  # a tree: node 0 the root; 1 and 2 its children; 3 under 1; 4 under 3
DEPTHS = [0, 1, 1, 2, 3]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request, tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp(request.param) / "t", arch=request.param, layers=4)
    _, cfg, _ = read_configs(path, None)
    return load_target(path, cfg, torch.float32, CPU, 256)


def ancestors(parents):
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, p in enumerate(parents):
        if p >= 0:
            mask[node] = mask[p]
        mask[node, node] = True
    return mask


def prefilled(model, prompt):
    cache = model.new_cache(256, torch.float32, CPU, 8)
    model(ForwardInput.prefill(torch.tensor(prompt), cache))
    cache.keep_rows(0, None)
    return cache


def inputs(model, recurrent):
    """Three sequences' inputs over fresh caches: a prefill chunk after 11 rows, a tree after 9,
    a chain of 4 after 14 (the same inputs each time it is called)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g)

    prompts = [ids(11).tolist(), ids(9).tolist(), ids(14).tolist()]
    caches = [prefilled(model, p) for p in prompts]
    length = [torch.tensor([len(p)], dtype=torch.int32) for p in prompts]
    tree = TreeIndex.build(PARENTS, model.config.conv_kernel, CPU) if recurrent else None
    return [ForwardInput(ids=ids(6), cache=caches[0], lengths=length[0]),
            ForwardInput(ids=ids(5), cache=caches[1], lengths=length[1], positions=9 + torch.tensor(DEPTHS),
                         block_mask=ancestors(PARENTS), tree=tree),
            ForwardInput(ids=ids(4), cache=caches[2], lengths=length[2])]


def scratch(cache, start, rows):
    """What a forward wrote for its rows: the KV rows past the committed ones, and a hybrid's
    recurrent scratch (a sequence's pending states, a tree's per-node inputs)."""
    kv = getattr(cache, "kv", cache)
    out = {name: t[:, start:start + rows].clone() for name, t in kv.pool.tensors.items()}  # a cache alone: in order
    if hasattr(cache, "ssm"):
        out.update(pending=cache.pending_ssm.clone(), conv=cache.pending_conv.clone(),
                   node_k=cache.node_k[:rows].clone(), node_g=cache.node_g[:rows].clone(),
                   node_conv=cache.node_conv[:rows].clone())
    return out


@torch.inference_mode()
def test_a_batch_of_sequences_equals_each_alone(model):
    recurrent = hasattr(model.config, "linear_layers")
    feature_layers = (1, 2)
    alone = []
    for inp in inputs(model, recurrent):
        hidden, feats = model(ForwardInput(**{**inp.__dict__, "feature_layers": feature_layers}))
        alone.append((hidden, feats, scratch(inp.cache, int(inp.lengths), inp.ids.shape[0])))
    parts = inputs(model, recurrent)
    hidden, feats = model(ForwardInput.batch(parts, feature_layers))
    assert hidden.shape[0] == feats.shape[0] == sum(p.ids.shape[0] for p in parts)
    rows = [p.ids.shape[0] for p in parts]
    for (want_h, want_f, want_s), h, f, part in zip(alone, hidden.split(rows), feats.split(rows), parts):
        assert torch.allclose(h, want_h, atol=1e-5, rtol=1e-5)
        assert torch.allclose(f, want_f, atol=1e-5, rtol=1e-5)
        got_s = scratch(part.cache, int(part.lengths), part.ids.shape[0])
        for name, want in want_s.items():
            assert torch.allclose(got_s[name], want, atol=1e-5, rtol=1e-5), name


def test_a_batch_keeps_every_per_sequence_field_in_its_parts(model):
    parts = inputs(model, hasattr(model.config, "linear_layers"))
    batch = ForwardInput.batch(parts)
    assert batch.sequences() == tuple(parts) and ForwardInput.batch(parts[:1]) is parts[0]
    assert batch.row_positions().tolist() == [*range(11, 17), *(9 + torch.tensor(DEPTHS)).tolist(), *range(14, 18)]
    with pytest.raises(ValueError, match="in its parts"):
        ForwardInput(ids=batch.ids, parts=batch.parts, cache=parts[0].cache)
    with pytest.raises(ValueError, match="needs its cache and lengths"):
        ForwardInput(ids=batch.ids)
