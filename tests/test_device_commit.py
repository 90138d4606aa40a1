"""A step's commit with no host value that depends on its result: the caches keep a path padded
with its last node at the device's length, a hybrid's fold takes the padding steps as
identities, and the sequence state's length moves on the device while the host's tokens follow
when it reads the step (models/state.py, runtime/sequence.py)."""

import pytest
import torch

from flashtree.kernels.kv_storage import PAGE_ROWS
from flashtree.models.kv_cache import KVCache, PagePool, keep_paths
from flashtree.models.state import HybridState
from flashtree.runtime.sequence import SequenceState

LENGTH, N = 9, 7


def random_cache(kind=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(2, 32, 2, 32, torch.float32, "cpu", kind)
    for t in cache.pool.tensors.values():  # a cache alone: its rows in order
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 200, t.shape, generator=g))
    return cache


def padded(path, rows):
    return torch.tensor(path + [path[-1]] * (rows - len(path)))


@pytest.mark.parametrize("kind", [None, "q8_0", "fp8"])
@pytest.mark.parametrize("path", [[0], [0, 2], [0, 1, 4, 6]])
def test_keep_path_moves_what_compact_moves(kind, path):
    """The committed rows after the step are compact's; rows past them are scratch."""
    want, got = random_cache(kind), random_cache(kind)
    want.compact(LENGTH, torch.tensor(path))
    got.keep_path(torch.tensor([LENGTH], dtype=torch.int32), padded(path, 5), torch.tensor([len(path)]))
    end = LENGTH + len(path)
    for name in want.pool.tensors:
        assert torch.equal(got.pool.tensors[name][:, :end], want.pool.tensors[name][:, :end]), name


def random_hybrid(seed=0):
    g = torch.Generator().manual_seed(seed)
    st = HybridState(1, 32, 2, 16, torch.float32, "cpu", linear_layers=2, value_heads=3, key_dim=8,
                     value_dim=8, conv_channels=12, conv_window=3, max_nodes=N)
    for t in (st.kv.k, st.kv.v, st.ssm, st.conv, st.node_conv, st.node_v):
        t.copy_(torch.randn(t.shape, generator=g))
    st.node_k.copy_(torch.nn.functional.normalize(torch.randn(st.node_k.shape, generator=g), dim=-1))
    st.node_g.copy_(-torch.rand(st.node_g.shape, generator=g))
    st.node_beta.copy_(torch.rand(st.node_beta.shape, generator=g))
    return st


@pytest.mark.parametrize("path", [[0], [0, 3], [0, 1, 2, 5]])
def test_a_padded_fold_is_the_real_paths_fold(path):
    """Padding steps fold as identities (g = 0, beta = 0): the states equal keep_rows' with the
    unpadded path, bit for bit, and the conv window is the last real node's."""
    want, got = random_hybrid(), random_hybrid()
    want.keep_rows(LENGTH, torch.tensor(path))
    got.keep_path(torch.tensor([LENGTH], dtype=torch.int32), padded(path, N), torch.tensor([len(path)]))
    assert torch.equal(got.ssm, want.ssm) and torch.equal(got.conv, want.conv)
    end = LENGTH + len(path)
    assert torch.equal(got.kv.k[:, :end], want.kv.k[:, :end]) and torch.equal(got.kv.v[:, :end], want.kv.v[:, :end])


def test_the_identity_step_is_exact_in_the_definition():
    """What the padded fold relies on: exp(0) == 1 and a zero beta leaves the state unchanged."""
    from flashtree.kernels.reference import gated_delta_update

    st = random_hybrid()
    state = st.ssm[0]
    k = torch.nn.functional.normalize(torch.randn(3, 8), dim=-1)
    out = gated_delta_update(state, k, torch.randn(3, 8), torch.zeros(3), torch.zeros(3))
    assert torch.equal(out, state)


def test_preserved_puts_the_recurrent_states_back():
    st = random_hybrid()
    before = {k: v.clone() for k, v in st.states().items()}
    with st.preserved():
        st.keep_path(torch.tensor([LENGTH], dtype=torch.int32), padded([0, 2], N), torch.tensor([2]))
        assert not torch.equal(st.ssm, before["ssm"])
    assert all(torch.equal(st.states()[k], v) for k, v in before.items())


def sequence():
    return SequenceState(KVCache(1, 40, 1, 4, torch.float32, "cpu"), None, torch.device("cpu"))


def test_device_commits_are_read_in_order():
    state = sequence()
    state.commit([1, 2, 3])
    state.commit_on_device(torch.tensor([2]))
    state.launched(4)
    assert state.length == 3 and int(state.length_dev) == 5 and state.bound == 7
    state.commit_on_device(torch.tensor([1]))
    state.launched(2)
    assert state.bound == 9
    with pytest.raises(RuntimeError, match="not yet read"):
        state.truncate(1)
    with pytest.raises(RuntimeError, match="not yet read"):
        state.commit([4])
    with pytest.raises(RuntimeError, match="at most 4"):
        state.settle([7, 7, 7, 7, 7])
    state.settle([7, 8])
    state.settle([9])
    assert state.tokens == [1, 2, 3, 7, 8, 9] and int(state.length_dev) == 6 and state.bound == 6
    with pytest.raises(RuntimeError, match="without an unread"):
        state.settle([1])
    state.truncate(2)
    assert int(state.length_dev) == 2


def test_room_is_checked_against_the_bound():
    state = sequence()
    state.commit([0] * 30)
    state.commit_on_device(torch.tensor([1]))
    state.launched(8)
    state.check_room(2)
    with pytest.raises(RuntimeError, match="overflow"):
        state.check_room(3)


def test_preserved_puts_the_length_back():
    state = sequence()
    state.commit([1, 2])
    with state.preserved():
        state.commit_on_device(torch.tensor([3]))
    assert int(state.length_dev) == 2 and not state.unread


def pooled_caches(kind, lengths, seed=1):
    """Caches over one shared pool, rows [0, length + 8) each given pages, random pool rows;
    the second holds the first's first page by reference (a shared prefix)."""
    pool = PagePool(2, 256, 2, 32, torch.float32, "cpu", kind)
    caches = [KVCache(2, 96, 2, 32, torch.float32, "cpu", kind, pool=pool) for _ in lengths]
    caches[0].ensure(lengths[0] + 8)
    caches[1].share_pages(caches[0].held, PAGE_ROWS)
    for cache, length in zip(caches, lengths):
        cache.ensure(length + 8)
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g) if t.is_floating_point()
                else torch.randint(0, 200, t.shape, generator=g))
    return pool, caches


@pytest.mark.parametrize("kind", [None, "q4_0"])
def test_keep_paths_moves_each_caches_rows_as_alone(kind):
    """Several caches' paths moved in one gather and scatter (a shared verify phase's commit)
    leave every pool row as each cache's own keep_path does, in turn: the shared page untouched."""
    lengths = [PAGE_ROWS + 3, PAGE_ROWS + 11, 5]
    paths = [padded(p, 5) for p in ([0, 2], [0, 1, 3, 4], [0])]
    (want, alone), (got, together) = pooled_caches(kind, lengths), pooled_caches(kind, lengths)
    assert alone[1].held[0] == alone[0].held[0], "the second cache shares the first's first page"
    for cache, length, path in zip(alone, lengths, paths):
        cache.keep_path(torch.tensor([length], dtype=torch.int32), path, torch.tensor([5]))
    launches = []
    move_rows = together[0].pool.move_rows
    together[0].pool.move_rows = lambda src, dest: launches.append(len(src)) or move_rows(src, dest)
    keep_paths(together, [torch.tensor([n], dtype=torch.int32) for n in lengths], paths)
    assert launches == [3 * 5], "one gather and scatter for the three caches"
    for name, t in want.tensors.items():
        assert torch.equal(got.tensors[name], t), name


def test_keep_paths_over_different_pools_moves_each_alone():
    lengths = [LENGTH, LENGTH + 4]
    caches = [random_cache(seed=s) for s in (0, 1)]
    want = [random_cache(seed=s) for s in (0, 1)]
    paths = [padded([0, 3], 4), padded([0, 1, 2], 4)]
    keep_paths(caches, [torch.tensor([n], dtype=torch.int32) for n in lengths], paths)
    for cache, w, length, path in zip(caches, want, lengths, paths):
        w.keep_path(torch.tensor([length], dtype=torch.int32), path, torch.tensor([4]))
        assert all(torch.equal(cache.pool.tensors[n], t) for n, t in w.pool.tensors.items())
