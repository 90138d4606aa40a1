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


def trees_over_one_pool(model, recurrent):
    """Three sequences' trees of the same size (prompts of 11, 9 and 14 rows) over caches that
    share one page pool, as live sequences' caches do: a batch that attends in one launch."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    caches, parts = [], []
    pool = 3 * 256 + 64
    for n in (11, 9, 14):
        cache = model.new_cache(256, torch.float32, CPU, 8, pool=pool)
        pool = getattr(cache, "kv", cache).pool
        getattr(cache, "kv", cache).ensure(n + len(PARENTS))
        model(ForwardInput.prefill(torch.randint(0, vocab, (n,), generator=g), cache))
        cache.keep_rows(0, None)
        tree = TreeIndex.build(PARENTS, model.config.conv_kernel, CPU) if recurrent else None
        parts.append(ForwardInput(ids=torch.randint(0, vocab, (len(PARENTS),), generator=g), cache=cache,
                                  lengths=torch.tensor([n], dtype=torch.int32), positions=n + torch.tensor(DEPTHS),
                                  block_mask=ancestors(PARENTS), tree=tree))
        caches.append(getattr(cache, "kv", cache))
    return parts, caches


@torch.inference_mode()
def test_trees_over_one_pool_attend_in_one_launch_and_equal_each_alone(model):
    recurrent = hasattr(model.config, "linear_layers")
    alone = []
    for inp in trees_over_one_pool(model, recurrent)[0]:
        hidden, _ = model(inp)
        kv = getattr(inp.cache, "kv", inp.cache)
        alone.append((hidden, kv.rows(int(inp.lengths) + len(PARENTS))))
    parts, caches = trees_over_one_pool(model, recurrent)
    batch = ForwardInput.batch(parts)
    together = batch.attention_at_once(caches)
    assert together is not None and together.block_mask.shape == (3, len(PARENTS), len(PARENTS))
    hidden, _ = model(batch)
    for (want_h, want_rows), h, part, kv in zip(alone, hidden.split(len(PARENTS)), parts, caches):
        assert torch.allclose(h, want_h, atol=1e-5, rtol=1e-5)
        got_rows = kv.rows(int(part.lengths) + len(PARENTS))
        for name, rows in want_rows.items():
            assert torch.allclose(got_rows[name].clone(), rows.clone(), atol=1e-5, rtol=1e-5), name
    mixed = ForwardInput.batch([parts[0], ForwardInput(ids=parts[1].ids[:3], cache=parts[1].cache,
                                                       lengths=parts[1].lengths)])
    assert mixed.attention_at_once(caches[:2]) is None  # rows of different counts: a launch each
