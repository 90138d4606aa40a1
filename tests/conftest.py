import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: one thread is faster than two fighting over a 2-core machine with the
# server subprocesses that the serving tests start.
torch.set_num_threads(1)

from tiny_models import make_tiny_pair  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A random qwen3 target (with tokenizer + chat template) and a random DFlash draft."""
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"))
