import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: one thread is faster than two fighting over a 2-core machine with the
# server subprocesses that the serving tests start.
torch.set_num_threads(1)

from flashtree.runtime import faults  # noqa: E402
from tiny_models import make_tiny_pair  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_faults():
    """No injected fault (runtime/faults.py: the plan is the process's) outlives its test."""
    faults.configure("")
    yield
    faults.configure("")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A random qwen3 target (with tokenizer + chat template) and a random DFlash draft."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ref32(pair):
    """A float32 copy of the module's random `pair` target: judges bf16 ties in the GPU tests."""
    return copy.deepcopy(pair.target).float()


@pytest.fixture(scope="module")
def prompt(pair):
    """A 40-token random prompt in the module's `pair` vocabulary (GPU tests)."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, pair.target_cfg["vocab_size"] - 1, (40,), generator=g).tolist()
