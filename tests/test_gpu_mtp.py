"""`--draft mtp` on CUDA in bf16: greedy chain and ddtree against greedy AR, with CUDA graphs
(the MTP chain captured in the draft phase, its commit in the verify phase) and without, on a
tiny random Qwen3.5 checkpoint with an MTP layer (or a first divergence that is a bf16 tie of the
float32 model, as test_gpu_decode.same_or_tie judges)."""

import pytest
import torch

from flashtree import Engine
from flashtree.models.loader import load_target, read_configs
from test_gpu_decode import same_or_tie
from tiny_models import add_mtp, make_target

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9, 31, 200, 11]
N = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return add_mtp(make_target(tmp_path_factory.mktemp("mtp_gpu"), arch="qwen3_5", layers=4, hidden=256))


@pytest.fixture(scope="module")
def ref32(target):
    _, cfg, _ = read_configs(target, None)
    return load_target(target, cfg, torch.float32, DEV, 1024)


def generate(target, mode, graphs=True):
    eng = Engine.from_pretrained(str(target), "mtp" if mode != "ar" else None, device="cuda", dtype="bfloat16",
                                 mode=mode, max_ctx=1024, max_sequences=1, cuda_graphs=graphs)
    return eng, eng.generate(PROMPT, max_tokens=N, stop_token_ids=[])


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["chain", "ddtree"])
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_mtp_equals_ar(target, ref32, mode, graphs):
    _, want = generate(target, "ar")
    eng, got = generate(target, mode, graphs)
    assert eng.runner.captures == graphs
    assert len(got.token_ids) == N
    assert same_or_tie(ref32, PROMPT, want.token_ids, got.token_ids)
